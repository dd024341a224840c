"""Tensor parallelism through the trainer, and the dropout RNG tracker."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.cli import build_config
from meshtron.parallel.random import RNGTracker
from meshtron.training.trainer import run_training
from tests.distributed.launch import run_distributed

ARGS = ["--mock-data", "--vocab-size", "200", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--device", "cpu", "--train-iters", "20", "--log-interval", "1",
        "--eval-interval", "0", "--make-vocab-size-divisible-by", "64", "--no-generate-sample"]


def _train(rank, world, extra):
    return run_training(build_config(ARGS + extra)).train_losses


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "selective"],
                                       pytest.param(["--no-tp-comm-overlap"], marks=pytest.mark.slow)],
                         ids=["plain", "selective", "no-overlap"])
def test_tp2_sp_trains_like_one_process(recompute):
    """20 iterations with TP=2 and sequence parallelism print the losses of the one-process run
    (also with selective recomputation, whose backward must not re-run the TP collectives wrongly,
    and with the backward communication overlap switched off)."""
    reference = run_training(build_config(ARGS)).train_losses
    results = run_distributed(_train, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + recompute)
    assert sorted(reference) == list(range(1, 21))
    for losses in results:
        for it, ref in reference.items():
            assert abs(losses[it] - ref) <= 1e-5 * abs(ref), (it, losses[it], ref)


def _dropout_masks(rank, world):
    out = []
    for _ in range(2):  # the same seed twice gives the same masks
        tracker = RNGTracker(seed=11, tp_rank=rank, pp_rank=0, device=torch.device("cpu"))
        tracker.seed_default()
        x = torch.ones(256)
        outside = F.dropout(x, 0.5, True)
        with tracker.fork():
            inside = F.dropout(x, 0.5, True)
        after = F.dropout(x, 0.5, True)  # the default stream continues as if fork never happened
        out.append((outside, inside, after))
    gathered = [None] * world
    dist.all_gather_object(gathered, out[0])
    return out, gathered


def test_rng_tracker_dropout_streams():
    results = run_distributed(_dropout_masks, 2)
    (runs0, gathered), (runs1, _) = results
    for runs in (runs0, runs1):
        for a, b in zip(runs[0], runs[1]):
            assert torch.equal(a, b)  # reproducible from the seed
    (out0, in0, after0), (out1, in1, after1) = gathered
    assert torch.equal(out0, out1) and torch.equal(after0, after1)  # outside TP regions: identical
    assert not torch.equal(in0, in1)  # inside TP regions: different per TP rank
    assert not torch.equal(out0, after0)


# TP=2 + SP is the fast representative; the other layouts' FP8 runs are slow (their bf16 runs are fast).
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  "--recompute-granularity", "full", "--recompute-method", "uniform",
                                                  "--recompute-num-layers", "1"], marks=pytest.mark.slow),
                                    pytest.param(["--use-distributed-optimizer"], marks=pytest.mark.slow),
                                    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
                                    pytest.param(["--context-parallel-size", "2"], marks=pytest.mark.slow)],
                         ids=["tp2-sp", "tp2-sp-full-recompute", "dp2-distopt", "pp2", "cp2"])
def test_fp8_layouts_follow_one_process_fp8(layout):
    """FP8 in every two-rank layout against one process's FP8 run. FP8 rounding is discontinuous, so the
    bf16 layouts' last-bit differences (about 6e-5 relative in the loss here) flip some FP8 roundings, and
    under TP and CP each rank scales its own shard (of a weight, a row-parallel input, a column-parallel
    output gradient, a part of the sequence), as Transformer Engine does. The losses stay within FP8's
    rounding of the one-process run (measured: at most 6e-4 relative over 20 iterations), while a wrongly
    scaled or wired operand would be off by far more."""
    fp8 = ["--bf16", "--fp8-format", "e4m3"]
    reference = run_training(build_config(ARGS + fp8)).train_losses
    results = run_distributed(_train, 2, layout + fp8)
    for it, ref in reference.items():
        assert abs(results[-1][it] - ref) <= 2e-3 * abs(ref), (it, results[-1][it], ref)
