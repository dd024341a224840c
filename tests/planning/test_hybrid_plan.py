"""Hybrid sharding (--num-distributed-optimizer-instances) in the memory model, the step-time model and the search."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.planning.profiles import H100


def _base():
    from meshtron.cli import build_config
    from meshtron.validation import resolve

    base = build_config(["--model", "llama2-7b", "--seq-length", "4096", "--global-batch-size", "256",
                         "--device", "cuda"])
    resolve(base, None)
    return base


def _layout(sharding: str, replicas: int = 1):
    from meshtron.planning.search import Layout

    return Layout(1, 1, 1, 1, 1, 64, 1, "full", sharding, False, replicas=replicas)


@pytest.mark.parametrize("sharding", ["optim", "optim_grads_params"])
def test_state_divided_by_the_shard_size(sharding):
    from meshtron.memory import estimate_memory
    from meshtron.planning.search import apply_layout

    base = _base()
    plain, hybrid = (estimate_memory(apply_layout(base, _layout(sharding, r)), base.model.vocab_size,
                                     world_size=64) for r in (1, 8))
    # Shards of 8 ranks instead of 64: 8x the optimizer state per rank.
    assert hybrid.optimizer_state == pytest.approx(8 * plain.optimizer_state, rel=0.01)
    assert hybrid.activations == plain.activations


def test_hybrid_sharding_cuts_the_exposed_data_parallel_time_across_nodes():
    from meshtron.planning.search import apply_layout
    from meshtron.planning.step_time import Links, predict_step

    base = _base()
    slow = H100.with_(network_gbps=5.0)
    for sharding in ("optim", "optim_grads_params"):
        plain, hybrid = (predict_step(apply_layout(base, _layout(sharding, r)), 64, slow, base.model.vocab_size,
                                      Links(8)) for r in (1, 8))
        assert hybrid.comm_by_kind_s["dp"] < 0.5 * plain.comm_by_kind_s["dp"], sharding
        assert hybrid.step_s < plain.step_s
    # Inside one node (8 GPUs) hybrid sharding moves the same bytes over NVLink plus an all-reduce: never better.
    small = dataclasses.replace(_layout("optim", 2), dp=8)
    plain8 = predict_step(apply_layout(base, dataclasses.replace(small, replicas=1)), 8, slow,
                          base.model.vocab_size, Links(8))
    hybrid8 = predict_step(apply_layout(base, small), 8, slow, base.model.vocab_size, Links(8))
    assert hybrid8.comm_by_kind_s["dp"] >= plain8.comm_by_kind_s["dp"]


def test_plan_proposes_hybrid_sharding_on_many_nodes_with_a_slow_network():
    from meshtron.cli import build_config
    from meshtron.planning.search import SearchSpace, hybrid_replicas, search

    argv = ["--model", "llama2-7b", "--seq-length", "4096", "--global-batch-size", "256"]
    fixed = dict(tp=1, pp=1, cp=1, recompute="full", micro_batch=1, async_tp=False)
    plans, _, _ = search(build_config(argv), argv, 64, H100.with_(network_gbps=5.0), top=1,
                         space=SearchSpace(allow_fp8=False, fixed=fixed))
    best = plans[0]
    assert best.layout.replicas == 8, best.layout.describe()
    assert "--num-distributed-optimizer-instances" in best.command and "hsdp=8x8" in best.layout.describe()
    # Not proposed where the data-parallel ranks sit in one node, nor without sharding, nor with EP.
    assert hybrid_replicas(dataclasses.replace(best.layout, dp=8), 8) == 1
    assert hybrid_replicas(dataclasses.replace(best.layout, sharding="no_shard"), 8) == 1
    assert hybrid_replicas(dataclasses.replace(best.layout, ep=2), 8) == 1
    assert hybrid_replicas(dataclasses.replace(best.layout, tp=2, dp=32), 8) == 8  # shards of 4 x TP 2
