"""The pipeline balance hint: the output layer's cost in layers, and the split it suggests."""

from __future__ import annotations

import pytest

from meshtron.cli import build_config
from meshtron.pipeline.balance import output_layer_cost, pipeline_balance_hint, suggest_last_stage_layers


def _cfg(*flags):
    return build_config(["--mock-data", "--device", "cpu"] + list(flags))


def test_llama3_3b_output_layer_costs_about_three_layers():
    cfg = _cfg("--model", "llama3-3b", "--seq-length", "4096")
    # 6*h*V against 6*N_layer + 12*h*s per token: 2.36e9 / 7.55e8
    assert output_layer_cost(cfg, 128256) == pytest.approx(3.13, abs=0.02)


def test_llama3_3b_on_two_stages_gets_a_shorter_last_stage():
    cfg = _cfg("--model", "llama3-3b", "--seq-length", "4096", "--pipeline-model-parallel-size", "2")
    s = suggest_last_stage_layers(cfg, 128256)
    assert s.last_stage_layers == 12  # stages of 16 and 12 + 3.1: slowest 16 against 14 + 3.1
    assert s.slowest_stage_speedup == pytest.approx((14 + 3.13) / 16, abs=0.01)
    assert "--decoder-last-pipeline-num-layers 12" in pipeline_balance_hint(cfg, 128256)


def test_virtual_stages_keep_every_stage_divisible():
    cfg = _cfg("--model", "llama3-3b", "--seq-length", "4096", "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2")
    s = suggest_last_stage_layers(cfg, 128256)
    assert s.last_stage_layers % 2 == 0 and (28 - s.last_stage_layers) % 2 == 0


def test_no_hint_without_pipeline_with_an_explicit_split_or_a_small_vocabulary():
    assert pipeline_balance_hint(_cfg("--model", "llama3-3b"), 128256) is None
    explicit = _cfg("--model", "llama3-3b", "--pipeline-model-parallel-size", "2",
                    "--decoder-last-pipeline-num-layers", "12")
    assert pipeline_balance_hint(explicit, 128256) is None
    small_vocab = _cfg("--model", "llama3-8b", "--pipeline-model-parallel-size", "2")
    assert suggest_last_stage_layers(small_vocab, 1000) is None  # the output layer costs almost nothing
