"""Run one rank of a large layout for real on the local device, in an emulated world.

:func:`emulate_rank` does what ``meshtron bench`` does for a row (build the configuration, the Trainer, time
warm-up + timed iterations and the step's split passes, read the allocator's peak), but inside a world of
``world_size`` ranks in which this process plays ``rank`` (:mod:`meshtron.emulation.process_group`): the
rank builds exactly its own stage, virtual chunks, TP/CP/EP shards, ZeRO shards, optimizer state and buffers,
and runs its real schedule. One more iteration is recorded (:mod:`meshtron.emulation.trace`), and
:mod:`meshtron.emulation.predict` turns the measured passes and the recorded communication into a predicted
step time.

:func:`emulate_training` runs the ``meshtron train`` program itself in the emulated world (for the trace
contract: an emulated rank issues exactly the operations of its real twin).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from meshtron.emulation.process_group import BACKEND, init_emulated_world
from meshtron.emulation.trace import GROUP_FIELDS, CollectiveRecorder, trace_path

#: The checks that would react to emulated values, and the settings that turn them off.
_CHECKS_OFF = {
    "check_for_nan_in_loss_and_grad": False, "check_for_spiky_loss": False, "rerun_mode": "disabled",
    "check_weight_hash_across_dp_replicas_interval": None, "hang_timeout_seconds": 0.0, "inject_fault": [],
    "log_straggler_interval": 0, "log_straggler": False, "generate_sample": False, "exit_signal_handler": False,
}
NOTICE = ("meshtron emulate: every collective is emulated (values are not the real ones), so the checks that "
          "would react to them are off: NaN/inf skip and re-run, spike check, weight hash, hang watchdog, "
          "straggler detection; no checkpoint is read or written")


def emulation_overrides(cfg) -> None:
    """Turn off, in place, what would react to emulated values or touch shared files."""
    for section in (cfg.train, cfg.log, cfg.optim, cfg.checkpoint, cfg.parallel):
        for name, value in _CHECKS_OFF.items():
            if hasattr(section, name):
                setattr(section, name, value)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.log.metrics_file = cfg.log.tensorboard_dir = cfg.log.wandb_project = None


def _enter_world(world_size: int, rank: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if world_size == 1:  # nothing to emulate: the one-device program itself, as `meshtron train` runs it
        return
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    init_emulated_world(world_size, rank)


def _leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)


def _config(argv: Sequence[str], world_size: int, iterations: int):
    from meshtron.cli import build_config
    from meshtron.validation import validate_config

    cfg = build_config(["--mock-data", "--eval-interval", "0", "--train-iters", str(iterations),
                        "--log-interval", str(10**9)] + list(argv))
    emulation_overrides(cfg)
    validate_config(cfg, world_size)
    if world_size > 1:
        cfg.parallel.distributed_backend = BACKEND  # every group of the layout is an emulated one
    return cfg


def emulate_training(argv: Sequence[str], world_size: int, rank: int):
    """``meshtron train`` with ``argv`` as rank ``rank`` of an emulated world (checks off, see :data:`NOTICE`)."""
    from meshtron.cli import build_config
    from meshtron.training.trainer import run_training

    _enter_world(world_size, rank)
    try:
        cfg = build_config(list(argv))
        emulation_overrides(cfg)
        if world_size > 1:
            cfg.parallel.distributed_backend = BACKEND
        return run_training(cfg)
    finally:
        _leave_world()


@dataclass
class EmulatedRank:
    """What one emulated rank measured and recorded."""

    rank: int
    coordinates: dict  # tp/cp/dp/pp/ep ranks
    layout: str
    device: str
    micro_batches: int  # the job's per step
    measured_micro_batches: int  # what the measured steps ran (fewer with --measure-micro-batches)
    peak_mem_gib: Optional[float]  # the allocator's peak (None on CPU)
    peak_reserved_gib: Optional[float]
    est_mem_gib: float  # meshtron's memory model for this stage
    step_s: float  # measured step with emulated (instant) communication
    forward_s: float
    backward_s: float
    optimizer_s: float
    data_s: float
    step_times_s: list = field(default_factory=list)  # each timed step (the median is ``step_s``)
    alloc_retries: Optional[int] = None  # the allocator's cache flushes during the timed steps (None off CUDA)
    records: list = field(default_factory=list)  # the operations of one recorded step
    spans_nodes: dict = field(default_factory=dict)  # group name -> its ranks sit on several nodes


def _spans_nodes(ctx, gpus_per_node: int) -> dict:
    """Which of this rank's groups span nodes, from the layout's members."""
    from meshtron.planning.fake_context import planned_context

    planned = planned_context(ctx.world_size, ctx.rank, ctx.tp, ctx.cp, ctx.pp, ctx.ep,
                              replicas=ctx.dp_cp_replicas)
    spans = {}
    for name in GROUP_FIELDS:
        group = getattr(planned, f"{name}_group")
        if group is not None:
            spans[name] = len({m // gpus_per_node for m in group.members}) > 1
    for size, group in planned.later_groups.tp.items():
        if group is not None:
            spans[f"tp_sub{size}"] = len({m // gpus_per_node for m in group.members}) > 1
    spans["world"] = ctx.world_size > gpus_per_node
    return spans


def emulate_rank(argv: Sequence[str], world_size: int, rank: int, gpus_per_node: int = 8, warmup: int = 2,
                 steps: int = 3, record_path: Optional[str] = None,
                 measure_micro_batches: Optional[int] = None, split_repeats: int = 3) -> EmulatedRank:
    """Build and run rank ``rank`` of ``world_size`` for ``warmup + steps`` timed iterations plus one recorded.

    ``measure_micro_batches``: run steps of that many micro-batches (a smaller global batch) instead of the
    job's; :attr:`EmulatedRank.micro_batches` stays the job's and the caller scales (a pipeline's passes and
    per-micro-batch communication grow linearly with the micro-batches; the bubble is simulated at the job's).
    ``split_repeats``: runs of each pass in the forward/backward split (1 for steps of minutes)."""
    from meshtron.bench import RandomTokens, _measure
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    _enter_world(world_size, rank)
    trainer = None
    try:
        cfg = _config(argv, world_size, warmup + steps + 1)
        t = cfg.train
        dp = world_size // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.context_parallel_size
                            * cfg.parallel.pipeline_model_parallel_size)
        job_micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
        if measure_micro_batches and measure_micro_batches < job_micro_batches:
            # Enough micro-batches that a forward runs after a backward, as in the job's steady state: the
            # peak holds the gradients and the in-flight activations together.
            measured = min(job_micro_batches, max(measure_micro_batches, steady_state_micro_batches(cfg)))
            t.global_batch_size = measured * t.micro_batch_size * dp
        ctx = context_from_config(cfg)
        if cfg.model.moe_router_force_skew and ctx.ep_group is not None:
            ctx.ep_group.counts_from_own_share = True  # see EmulatedProcessGroup
        dev = ctx.device
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        n_micro = t.global_batch_size // (t.micro_batch_size * ctx.dp)
        data = RandomTokens(cfg.model.vocab_size or 32000, cfg.model.seq_length, t.micro_batch_size, n_micro, t.seed)
        trainer = Trainer(cfg, ctx, data=data)
        hold_optimizer_state(trainer)
        row = _measure(trainer, cfg, ctx, data, warmup, steps, True, False, False, None, list(argv), split_repeats)
        iteration = warmup + steps + 1
        batches = next(data.train_batches())
        progress = trainer.progress
        recorder = CollectiveRecorder(ctx, lambda: (iteration, progress.phase))
        if ctx.world_size > 1:
            # One more step, recorded (recording slows it: the timed steps are over). torch.compile runs eagerly
            # under the recorder's dispatch mode, so this step can need more memory than the timed ones; a world
            # of one has nothing to record and skips it.
            with recorder:
                trainer.train_step(batches, iteration)
        if record_path:
            recorder.write(trace_path(record_path, rank))
        coords = {"tp": ctx.tp_rank, "cp": ctx.cp_rank, "dp": ctx.dp_rank, "pp": ctx.pp_rank, "ep": ctx.ep_rank}
        return EmulatedRank(
            rank=rank, coordinates=coords, layout=ctx.describe(), device=str(dev.type),
            micro_batches=job_micro_batches, measured_micro_batches=n_micro,
            peak_mem_gib=row["peak_mem_gib"], peak_reserved_gib=row["peak_reserved_gib"],
            est_mem_gib=row["est_mem_gib"], step_s=row["step_s"], forward_s=row["forward_s"] or 0.0,
            backward_s=row["backward_s"] or 0.0, optimizer_s=row["optimizer_s"] or 0.0, data_s=row["data_s"] or 0.0,
            step_times_s=row["step_times_s"], alloc_retries=row["alloc_retries"],
            records=[r for r in recorder.records if r["iteration"] == iteration],
            spans_nodes=_spans_nodes(ctx, gpus_per_node))
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _leave_world()


def hold_optimizer_state(trainer) -> None:
    """Have the optimizer's state created at the first step, applied or not, as the real rank creates it.

    The optimizers create their moments at their first step, and a step is applied only when the loss and the
    gradient norm are finite. An emulated rank's values are not the real ones: on the GPU under torch 2.11 the
    single-tensor all-gathers and reduce-scatters (sequence parallelism's) leave their outputs as allocated, and
    stale bf16 bits are often NaN or inf, so every step of such a rank can be skipped and its peak would miss the
    moments (8 bytes per parameter of the optimizer's shard): the rows of benchmarks/emulated.jsonl measured
    before this (docs/planning.md, "The planner against emulation"). The state is made where the first step
    would make it, after that step's backward, not before the first forward: the allocator then lays out the
    step's blocks in the real rank's order."""
    trainer.create_state_on_skipped_step = True


def steady_state_micro_batches(cfg) -> int:
    """The fewest micro-batches per step whose schedule runs a forward after a backward on every rank (the
    job's steady state, where its memory peaks with the gradients and the in-flight activations together):
    two without pipelining, PP + 1 for 1F1B and zero-bubble, and for interleaved 1F1B enough chunk-forwards
    past the first rank's warm-up (2 (PP - 1) + (V - 1) PP of them), rounded up to a multiple of PP."""
    p = cfg.parallel
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if pp == 1:
        return 2
    if v == 1 or p.pipeline_schedule in ("zero-bubble-h1", "zbv"):
        return pp + 1
    warmup = 2 * (pp - 1) + (v - 1) * pp
    needed = -(-(warmup + 2) // v)
    return -(-needed // pp) * pp


def default_ranks(world_size: int, tp: int, cp: int, pp: int) -> list[int]:
    """One rank per pipeline stage: the first rank (TP, CP and DP rank 0) of each."""
    per_stage = world_size // pp
    return [stage * per_stage for stage in range(pp)]
