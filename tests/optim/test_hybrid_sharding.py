"""Hybrid sharded data parallelism (``--num-distributed-optimizer-instances R``) trains the one-process model.

Four gloo processes run the tiny model of test_sharding_strategies.py with ZeRO-1/2/3 sharded inside groups
of S = DP x CP / R ranks and replicated over R = 2 of them: losses and gradient norms equal one process's to
1e-5, the final checkpoints' layout-free tensors equal the one-process run's, and each rank allocates what
the static memory model predicts (state divided by S, not DP x CP). A run saved with hybrid sharding resumes
without it and the reverse. One launch serves every case; an eight-process launch (marked slow) adds
DP=8 and TP=2 x DP=4 with R=2. Plus the groups themselves and the flags' validation.
"""

from __future__ import annotations

import os

import pytest
import torch

from meshtron.errors import ConfigError
from tests.distributed.launch import run_distributed
from tests.optim.test_sharding_strategies import (ITERS, _assert_logs, _checkpoint_tensors, _config, _latest, _run)

HALF = ITERS // 2


def _worker(rank: int, world: int, cases: list) -> list:
    from meshtron.parallel.context import context_from_config  # noqa: F401 - imported in the child

    return [_run(_config(**kwargs)) for _, kwargs in cases]


def _cases(root: str) -> list:
    r2 = dict(num_distributed_optimizer_instances=2)
    cases = [
        ("dp4r2_zero1", dict(use_distributed_optimizer=True, overlap_grad_reduce=True, **r2)),
        ("dp4r2_zero2", dict(data_parallel_sharding_strategy="optim_grads", **r2)),
        # The meshtron spelling: shards of S=2 ranks, so R = 4 / 2.
        ("dp4s2_zero3", dict(data_parallel_sharding_strategy="optim_grads_params", data_parallel_shard_size=2)),
        ("tp2dp2r2_zero3", dict(data_parallel_sharding_strategy="optim_grads_params", tensor_model_parallel_size=2,
                                sequence_parallel=True, **r2)),
        ("pp2dp2r2_zero1", dict(use_distributed_optimizer=True, pipeline_model_parallel_size=2, **r2)),
        # Resume across hybrid and plain sharding: CP=2 x DP=2 ZeRO-3 in shards of two saves halfway (one process
        # continues it); DP=4 ZeRO-2 in shards of two continues the one-process run's halfway checkpoint.
        ("cp2dp2r2_zero3_save", dict(use_megatron_fsdp=True, context_parallel_size=2, iters=HALF,
                                     save=os.path.join(root, "hsdp"), **r2)),
        ("hsdp_load", dict(data_parallel_sharding_strategy="optim_grads", load=os.path.join(root, "plain"),
                           save=os.path.join(root, "hsdp_final"), **r2)),
    ]
    for name, kwargs in cases:
        kwargs.setdefault("save", os.path.join(root, name))
    return cases


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("meshtron.data.mock")
    from meshtron.training.trainer import run_training

    root = str(tmp_path_factory.mktemp("hsdp_ref"))
    os.environ.pop("WORLD_SIZE", None)
    ref_dir = os.path.join(root, "ref")
    return run_training(_config(save=ref_dir)), ref_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference):
    from meshtron.training.trainer import run_training

    root = str(tmp_path_factory.mktemp("hsdp"))
    os.environ.pop("WORLD_SIZE", None)
    plain_half = run_training(_config(iters=HALF, save=os.path.join(root, "plain")))
    cases = _cases(root)
    results = run_distributed(_worker, 4, cases, timeout=400)
    out = {name: [r[i] for r in results] for i, (name, _) in enumerate(cases)}
    # One process continues the hybrid-sharded run's halfway checkpoint.
    resumed = run_training(_config(load=os.path.join(root, "hsdp"), save=os.path.join(root, "plain_final")))
    out["plain_half"], out["plain_load"] = plain_half, resumed
    return root, out


def _assert_checkpoint(root: str, name: str, ref_dir: str) -> None:
    want = _checkpoint_tensors(_latest(ref_dir))
    got = _checkpoint_tensors(_latest(os.path.join(root, name)))
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")


LAYOUTS = ["dp4r2_zero1", "dp4r2_zero2", "dp4s2_zero3", "tp2dp2r2_zero3", "pp2dp2r2_zero1"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_hybrid_sharding_trains_the_single_process_model(runs, reference, name):
    root, results = runs
    ref, ref_dir = reference
    _assert_logs(results[name], ref, range(1, ITERS + 1))
    _assert_checkpoint(root, name, ref_dir)


@pytest.mark.parametrize("name", LAYOUTS + ["cp2dp2r2_zero3_save", "hsdp_load"])
def test_hybrid_sharding_allocates_what_the_memory_model_predicts(runs, name):
    _, results = runs
    for rank, (_, _, memory, _) in enumerate(results[name]):
        for kind, (got, planned) in memory.items():
            assert got == planned, f"{name} rank {rank}: {kind} allocated {got} bytes, the model predicts {planned}"


def test_checkpoints_resume_across_hybrid_and_plain_sharding(runs, reference):
    root, results = runs
    ref, ref_dir = reference
    _assert_logs(results["cp2dp2r2_zero3_save"], ref, range(1, HALF + 1))
    resumed = results["plain_load"]
    _assert_logs([(resumed.train_losses, resumed.grad_norms)], ref, range(HALF + 1, ITERS + 1))
    _assert_checkpoint(root, "plain_final", ref_dir)
    _assert_logs(results["hsdp_load"], ref, range(HALF + 1, ITERS + 1))
    _assert_checkpoint(root, "hsdp_final", ref_dir)


def test_state_is_divided_by_the_shard_size(runs):
    """DP=4 with R=2 holds the optimizer state of S=2 ranks: over the four ranks, twice the whole model's."""
    _, results = runs
    per_rank = [memory["optimizer"][0] for _, _, memory, _ in results["dp4s2_zero3"]]
    assert per_rank[0] == per_rank[2] and per_rank[1] == per_rank[3]  # replicas hold the same shard
    assert per_rank[0] + per_rank[1] == pytest.approx(sum(per_rank) / 2)


@pytest.mark.slow
def test_eight_processes(tmp_path, reference):
    ref, ref_dir = reference
    root = str(tmp_path)
    cases = [("dp8r2_zero3", dict(data_parallel_sharding_strategy="optim_grads_params",
                                  num_distributed_optimizer_instances=2, save=os.path.join(root, "dp8r2_zero3"))),
             ("tp2dp4r2_zero2", dict(data_parallel_sharding_strategy="optim_grads", tensor_model_parallel_size=2,
                                     sequence_parallel=True, num_distributed_optimizer_instances=2,
                                     save=os.path.join(root, "tp2dp4r2_zero2")))]
    results = run_distributed(_worker, 8, cases, timeout=600)
    for i, (name, _) in enumerate(cases):
        per_rank = [r[i] for r in results]
        _assert_logs(per_rank, ref, range(1, ITERS + 1))
        _assert_checkpoint(root, name, ref_dir)
        for rank, (_, _, memory, _) in enumerate(per_rank):
            for kind, (got, planned) in memory.items():
                assert got == planned, f"{name} rank {rank}: {kind} {got} != planned {planned}"


# ------------------------------------------------------------------------------------------------ groups, flags

def test_shard_and_replica_groups():
    from meshtron.parallel.context import hybrid_groups
    from meshtron.planning.fake_context import planned_context

    # TP=2, DP=4, R=2: DP x CP index j = dp_rank; shard groups are consecutive DP ranks (neighbours on a node).
    shards, replicas = hybrid_groups(2, 1, 4, 1, 2)
    assert shards == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    ctx = planned_context(8, 6, tp=2, replicas=2)
    assert ctx.dp_cp_shard == 2 and ctx.dp_cp_shard_group.members == (4, 6)
    assert ctx.dp_cp_replica_group.members == (2, 6)
    assert (ctx.dp_cp_shard_rank, ctx.dp_cp_replica_rank) == (1, 1)
    plain = planned_context(8, 6, tp=2)
    assert plain.dp_cp_shard == 4 and plain.dp_cp_shard_group is None and plain.dp_cp_shard_rank == 3


def test_trace_and_hang_reports_know_the_groups():
    from meshtron.emulation.trace import GROUP_FIELDS
    from meshtron.resilience.hang import CONTEXT_GROUPS

    assert {"dp_cp_shard", "dp_cp_replica"} <= set(GROUP_FIELDS)
    assert {"dp_cp_shard", "dp_cp_replica"} <= {name for _, name in CONTEXT_GROUPS}


def _validated(args: list, world: int = 8):
    from meshtron.cli import build_config
    from meshtron.validation import validate_config

    cfg = build_config(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--device", "cpu"] + args)
    return validate_config(cfg, world)


def test_flags():
    cfg = _validated(["--use-distributed-optimizer", "--data-parallel-shard-size", "2"])
    assert cfg.parallel.num_distributed_optimizer_instances == 4
    cfg = _validated(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"])
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    with pytest.raises(ConfigError, match="must divide"):
        _validated(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"])
    with pytest.raises(ConfigError, match="needs a sharded optimizer"):
        _validated(["--num-distributed-optimizer-instances", "2"])
    with pytest.raises(ConfigError, match="agree"):
        _validated(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                    "--data-parallel-shard-size", "2"])
    with pytest.raises(ConfigError, match="expert-model-parallel-size"):
        _validated(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                    "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32"])
