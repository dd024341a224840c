"""The model builder: every choice the configuration makes about a stage is made there, and the
pipeline package stays free of the model."""

from __future__ import annotations

import subprocess
import sys

import torch

from meshtron.build import build_model_chunks, build_stage, recompute_layer_ids
from meshtron.config import MeshtronConfig
from meshtron.layers.mlp import MLP
from meshtron.layers.moe import MoELayer, moe_layers
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker

VOCAB = 96


def _tiny(experts: int = 0) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 4, 32, 4, 64, 8
    m.make_vocab_size_divisible_by = 8
    if experts:
        m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_first_dense_layers = experts, 16, 2, 1
    cfg.train.device, cfg.train.compile = "cpu", False
    return cfg


def test_pipeline_package_imports_no_model_code():
    # A fresh interpreter: this one has imported the model already.
    code = ("import sys, meshtron.pipeline, meshtron.pipeline.schedules, meshtron.pipeline.p2p, "
            "meshtron.pipeline.batches, meshtron.pipeline.balance, meshtron.pipeline.timing\n"
            "bad = [m for m in sys.modules if m == 'meshtron.model' or m.startswith('meshtron.layers')]\n"
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_moe_is_chosen_from_the_config():
    dense = build_stage(_tiny(), ParallelContext(), VOCAB)
    assert not moe_layers([dense])
    moe = build_stage(_tiny(experts=4), ParallelContext(), VOCAB)
    kinds = [type(layer.mlp) for layer in moe.layers.values()]
    assert kinds == [MLP, MoELayer, MoELayer, MoELayer]  # --moe-first-dense-layers 1


def test_make_mlp_overrides_the_config_choice():
    cfg = _tiny(experts=4)
    model = build_stage(cfg, ParallelContext(), VOCAB, make_mlp=lambda m, ctx, i, sp: MLP(m, ctx, f"layers.{i}.mlp", sp))
    assert not moe_layers([model])


def test_construction_settings_come_from_the_config():
    cfg = _tiny()
    cfg.parallel.cp_comm_type = "allgather"
    cfg.train.recompute_granularity, cfg.train.recompute_method, cfg.train.recompute_num_layers = "full", "block", 1
    model = build_stage(cfg, ParallelContext(), VOCAB, layer_ids=[2, 3], post_process=False)
    assert model.cp_comm_type == "allgather"
    assert [layer.recompute for layer in model.layers.values()] == ["full", None]
    assert recompute_layer_ids(cfg, [2, 3]) == [2]


def test_chunks_are_initialised_with_the_tracker():
    cfg = _tiny()
    tracker = RNGTracker(cfg.train.seed, 0, 0, torch.device("cpu"))
    (model,) = build_model_chunks(cfg, ParallelContext(), VOCAB, tracker, torch.float32)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(layer.tracker is tracker for layer in model.layers.values())


def test_checkpoint_bench_builds_the_experts_of_a_moe_preset():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint_io.py"
    spec = importlib.util.spec_from_file_location("checkpoint_io", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench_config, bench_model = bench.bench_config, bench.bench_model

    cfg = bench_config("mixtral-8x7b", tp=1, seq_length=64, distributed_optimizer=False, world=1,
                       device="cpu")
    model = bench_model(cfg, ParallelContext())  # on the meta device: nothing allocated
    layers = moe_layers([model])
    assert len(layers) == cfg.model.num_layers
    assert all(p.is_meta for p in model.parameters())
