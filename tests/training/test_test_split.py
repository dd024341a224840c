"""The test split (--split's third share, or --test-data-path) is evaluated once at the end of a run, as
Megatron-LM does: a ``test`` record in the metrics file and a line on the console; also with --skip-train,
and on pipeline / data-parallel layouts with the one-process loss."""

from __future__ import annotations

import json
import math
import os

import pytest

from meshtron.cli import build_config
from meshtron.training.trainer import run_training
from tests.distributed.launch import run_distributed

TINY = ["--mock-data", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--device", "cpu",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--no-generate-sample",
        "--no-compile", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "2", "--seed", "7"]


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(tmp_path, *flags: str):
    os.environ.pop("WORLD_SIZE", None)
    metrics = tmp_path / "m.jsonl"
    result = run_training(build_config(TINY + ["--metrics-file", str(metrics), *flags]))
    return result, _records(metrics)


def test_a_test_share_is_evaluated_once_at_the_end(tmp_path, capsys) -> None:
    result, records = _train(tmp_path, "--split", "90,5,5")
    [test] = [r for r in records if r["type"] == "test"]
    assert test["iteration"] == 3 and records[-1] == test  # after the last validation
    assert math.isfinite(test["loss"]) and test["ppl"] == pytest.approx(math.exp(test["loss"]), rel=1e-9)
    assert result.test_losses == {3: pytest.approx(test["loss"])}
    assert test["loss"] != result.eval_losses[3]  # another split
    lines = [line for line in capsys.readouterr().out.splitlines() if "test at iteration" in line]
    assert len(lines) == 1 and "test at iteration 3 | loss: " in lines[0]


def test_without_a_test_share_nothing_is_evaluated(tmp_path, capsys) -> None:
    result, records = _train(tmp_path, "--split", "90,10,0")
    assert [r for r in records if r["type"] == "test"] == [] and result.test_losses == {}
    assert result.eval_losses  # validation still runs
    assert "test at iteration" not in capsys.readouterr().out


def test_skip_train_evaluates_validation_then_test(tmp_path) -> None:
    result, records = _train(tmp_path, "--split", "90,5,5", "--skip-train")
    assert [r["type"] for r in records] == ["eval", "test"]
    assert result.train_losses == {} and list(result.test_losses) == [0]


def _layouts(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    out = []
    for flags in layouts:
        out.append(run_training(build_config(TINY + ["--split", "90,5,5", *flags])).test_losses)
    return out


def test_pipeline_and_data_parallel_give_the_one_process_test_loss(tmp_path) -> None:
    reference, _ = _train(tmp_path, "--split", "90,5,5")
    layouts = [["--pipeline-model-parallel-size", "2"], []]  # PP=2, then DP=2
    results = run_distributed(_layouts, 2, layouts, timeout=240)
    for rank, per_layout in enumerate(results):
        for flags, got in zip(layouts, per_layout):
            assert got.keys() == reference.test_losses.keys(), (rank, flags)
            assert got[3] == pytest.approx(reference.test_losses[3], rel=1e-5), (rank, flags)
