"""The planner against every emulated row of benchmarks/emulated.jsonl (docs/planning.md, "The planner against
emulation"), each row against the model of its own pipeline stage (its memory, and the step as that stage's
micro-batches set it, :meth:`StepPrediction.stage_step_s`): step time within 10% of the emulated
prediction and memory within 3% of the measured peak, except where a bound below says how far and why.

Rows recorded before ``hold_optimizer_state`` (every row so far: no ``optimizer_state_held`` field) may miss the
optimizer's moments: an emulated rank's values are not the real ones, every one of its steps could be skipped as
non-finite, and the optimizers create their moments at the first applied step. Their real twin holds the measured
peak or the measured peak plus the moments; the planner must be within 3% of one of the two. Rows measured with
fewer micro-batches than the job's steady state (before ``steady_state_micro_batches``) miss the moment where
gradients and in-flight activations meet: their memory is not compared. A rank that ran out of memory must be
one the planner says does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtron.cli import build_config
from meshtron.emulation.runner import steady_state_micro_batches
from meshtron.memory import stage_estimates
from meshtron.optim.registry import matrix_state_bytes
from meshtron.planning.validate import validate_for_plan
from meshtron.planning.profiles import builtin_profile
from meshtron.planning.step_time import Links, predict_step

ROWS = [json.loads(line) for line in
        (Path(__file__).resolve().parents[2] / "benchmarks" / "emulated.jsonl").read_text().splitlines()
        if line.strip()]

#: What an 80 GB H100's allocator can hand out (the emulated runs' device).
H100_USABLE_GIB = 79.18
MEMORY_TOLERANCE = 0.03
STEP_TOLERANCE = 0.10
#: Rows the planner does not follow yet: (lowest, highest) planner / emulated step time, and why
#: (docs/planning.md says more). Bounds a little past today's figures, so that a change either way is seen.
STEP_GAPS = {
    # llama2-7b DP=8 (no TP, 32 heads at 4,096 tokens): the planner's layers 9% over the measured passes; the
    # rank ran 2 of the job's 128 micro-batches, whose first takes its gradients as a copy (6 bytes per
    # parameter, not the 10 of an add), so the emulated step is about 2% light as well.
    "e3": (1.05, 1.14),
    # FP8, interleaved (V = 5 and 8), TP 4-8, each stage against its own: the planner's FP8 layers 10-15% under
    # the measured passes (its one FP8 speed-up, fitted to one- and two-GPU rows of larger GEMMs); measured with 8
    # of the 16 micro-batches of the steady state.
    "e9": (0.82, 0.90), "e10": (0.84, 0.90), "e13": (0.83, 0.90), "e14": (0.83, 0.90),
    # llama3-405b TP=8 CP=2 PP=8 at 2,048 tokens per rank: the H100 sustains 6.1% under the planner's borrowed
    # GEMM rate at these shapes (docs/planning.md); e17/e18 (before the optimizer state was held) also measured
    # slower passes than their replacements e25/e26 (the last stage, e26, is within 6%).
    "e17": (0.81, 0.90), "e18": (0.80, 0.90), "e25": (0.87, 0.90),
    # DeepSeek-V3 EP=64, selective recomputation: the expert all-to-all now as emulation counts it (6 per MoE
    # layer, the whole sequence on each TP rank); the stage's measured passes take 1.7x the planner's compute
    # (288 against 178 ms per micro-batch on e19; the recomputing backward measures 3.6x the forward).
    "e19": (0.83, 0.89), "e20": (0.84, 0.90),
    # the same two stages re-emulated with the optimizer's state held (2026-12-07, commit 17b095b): the same gap
    "e28": (0.83, 0.89), "e29": (0.82, 0.88),
    # llama3-8b at 1,048,576 tokens, CP=32 over 4 nodes, as recorded: its one step was the first (7.2 s of
    # compilation) and its ring hops counted twice (send and receive); recomputed with today's arithmetic the
    # planner is within 5% (docs/planning.md). The planner's ring now counts the fp32 gradient: 95.2 of 111.2 s.
    "e27": (0.80, 0.90),
}
#: (lowest, highest) planner / measured peak, and why, where the memory model misses an emulated peak by more
#: than 3%.
MEMORY_GAPS = {
    # llama3-8b at 1,048,576 tokens, CP=32, full recomputation: the planner is 8.7 GiB under the recorded peak
    # (51.2 of 59.8). That peak was not a training step's: the allocator's history (benchmarks/
    # emulated_peak_sites.py) puts it at setup, where the distributed optimizer's flat weight buffer (15 GiB)
    # was allocated beside the weights it copies and the fp32 gradient buffer (30 GiB). The flat weights are
    # built first since; the training step's own peak is to be re-emulated.
    "e27": (0.80, 0.97),
}


def _planned(row: dict):
    cfg = validate_for_plan(build_config(row["argv"].split()), row["world_size"])  # the GPU's defaults, here
    vocab = cfg.model.vocab_size
    step = predict_step(cfg, row["world_size"], builtin_profile(row["profile"]), vocab, Links(row["gpus_per_node"]))
    stages = stage_estimates(cfg, vocab, world_size=row["world_size"])
    if "coordinates" in row:  # the row's own pipeline stage: one rank predicts the step as its stage sets it
        pp = row["coordinates"]["pp"]
        return cfg, step.stage_step_s(pp), stages[pp]
    return cfg, step.step_s, max(stages, key=lambda s: s.total)


def _moments_gib(cfg, stage) -> float:
    """The optimizer's moments in the modelled optimizer state (the rest is the fp32 master weights)."""
    moments = matrix_state_bytes(cfg)
    return stage.optimizer_state * moments / (4 + moments) / 2**30


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_planner_follows_the_emulated_rows(row):
    cfg, step_s, stage = _planned(row)
    memory_gib = stage.total / 2**30
    if "error" in row:  # out of memory on the device
        assert memory_gib > 0.95 * H100_USABLE_GIB, f"{row['id']}: ran out of memory, planner {memory_gib:.1f} GiB"
        return
    ratio = step_s / row["predicted"]["step_s"]
    low, high = STEP_GAPS.get(row["id"], (1 - STEP_TOLERANCE, 1 + STEP_TOLERANCE))
    assert low < ratio < high, f"{row['id']}: planner {step_s:.2f} s, emulated {row['predicted']['step_s']:.2f} s"
    if row["measured_micro_batches"] < min(row["micro_batches"], steady_state_micro_batches(cfg)):
        return
    peak = row["measured"]["peak_mem_gib"]
    twins = [peak] if row.get("optimizer_state_held") else [peak, peak + _moments_gib(cfg, stage)]
    errors = [memory_gib / twin - 1 for twin in twins]
    if row["id"] in MEMORY_GAPS:
        low, high = MEMORY_GAPS[row["id"]]
        assert low < memory_gib / peak < high, f"{row['id']}: planner {memory_gib:.1f} GiB, peak {peak:.1f}"
        assert min(abs(e) for e in errors) > MEMORY_TOLERANCE, f"{row['id']} is followed now: drop its bound"
        return
    assert min(abs(e) for e in errors) < MEMORY_TOLERANCE, (
        f"{row['id']}: planner {memory_gib:.2f} GiB, measured {peak:.2f} (its twin: "
        + " or ".join(f"{t:.2f}" for t in twins) + ")")


def test_every_gap_names_a_row():
    ids = {r["id"] for r in ROWS}
    assert set(STEP_GAPS) <= ids and set(MEMORY_GAPS) <= ids
