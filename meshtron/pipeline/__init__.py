"""Pipeline parallelism: stage partitioning, point-to-point exchange, schedules.

The training loop's entry points are :func:`get_schedule`, :func:`is_data_rank`, and the batch
helpers of :mod:`meshtron.pipeline.batches`. The model chunks a schedule runs are built by
:mod:`meshtron.build`: this package never imports the model or its layers.

This package's face imports nothing heavy: torch and the schedules load when a
function below runs or a name of :data:`_LAZY` is first read. So :mod:`meshtron.pipeline.partition`
(plain integer arithmetic) stays importable without torch, and checking a configuration
(:mod:`meshtron.validation`) needs no model code.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, Optional

from meshtron.config import MeshtronConfig
from meshtron.errors import ConfigError
from meshtron.pipeline.partition import SPLIT_BACKWARD
from meshtron.pipeline.partition import PipelineLayout, check_micro_batches, partition_layers

if TYPE_CHECKING:
    from meshtron.parallel.context import ParallelContext
    from meshtron.pipeline.schedules import ForwardStep, ScheduleStats
    from meshtron.run_layout import RunLayout

__all__ = ["PipelineLayout", "ScheduleStats", "check_micro_batches", "check_stage_count", "get_schedule",
           "is_data_rank", "layout_from_config", "partition_layers"]

#: Names this package re-exports from modules that load on first use: name -> module.
_LAZY = {"ScheduleStats": "meshtron.pipeline.schedules", "layout_from_config": "meshtron.run_layout"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_stage_count(layout: PipelineLayout, ctx: ParallelContext) -> None:
    """The layout's pipeline stages are those the process groups were built with."""
    if layout.stages != ctx.pp:
        raise ConfigError(f"--pipeline-model-parallel-size is {layout.stages} but the process groups were built "
                          f"with {ctx.pp} pipeline stages")


def get_schedule(cfg: MeshtronConfig, ctx: ParallelContext, forward_step: ForwardStep,
                 layout: Optional[RunLayout] = None) -> Callable:
    """The forward/backward schedule: ``schedule(model_chunks, micro_batches, forward_only=False,
    on_chunk_grads_ready=None) -> summed weighted loss`` (a tensor; zero on stages without the loss).

    ``forward_step`` runs one micro-batch through one model chunk
    (:data:`~meshtron.pipeline.schedules.ForwardStep`; GPTModel's is :func:`meshtron.build.gpt_forward_step`).
    One stage: no pipelining. Several: 1F1B, interleaved 1F1B with virtual stages, or the
    ``--pipeline-schedule`` named (ZB-H1: :mod:`meshtron.pipeline.zero_bubble`); the returned
    callable carries ``forward_step``, this rank's point-to-point communicator and, for ZB-H1, the
    weight-gradient store its backward passes defer into. ``layout``: the run's resolved layout (stage layout
    and compute dtype; resolved here from ``cfg`` when not given).
    """
    import torch

    from meshtron.pipeline.p2p import PipelineP2P, activation_shape
    from meshtron.pipeline.schedules import forward_backward_no_pipelining, forward_backward_pipelining
    from meshtron.run_layout import compute_dtype_name, layout_from_config

    if ctx.pp == 1:
        return functools.partial(forward_backward_no_pipelining, forward_step=forward_step)
    stages = layout.pipeline if layout is not None else layout_from_config(cfg)
    check_stage_count(stages, ctx)
    t = cfg.train
    if t.global_batch_size is not None:
        check_micro_batches(t.global_batch_size // (t.micro_batch_size * ctx.dp), ctx.pp, stages.virtual_stages)
    dtype = getattr(torch, layout.compute_dtype if layout is not None else compute_dtype_name(cfg, ctx.device.type))
    p2p = PipelineP2P(ctx, activation_shape(cfg, ctx), dtype, ctx.device)
    schedule = cfg.parallel.pipeline_schedule
    extra = {}
    if schedule in SPLIT_BACKWARD:
        from meshtron.pipeline.zero_bubble import WeightGradStore

        # Only an overlapped reduction is armed by on_chunk_grads_ready, and only it needs the held sums.
        extra["wgrad_store"] = WeightGradStore(hold_after_last_backward=cfg.parallel.overlap_grad_reduce)
    return functools.partial(forward_backward_pipelining, forward_step=forward_step, p2p=p2p,
                             overlap_p2p=cfg.parallel.overlap_p2p_comm, schedule=schedule, **extra)


def is_data_rank(ctx: ParallelContext, cfg: Optional[MeshtronConfig] = None) -> bool:
    """Ranks that read training data: the first stage (tokens) and the one with the loss (labels and loss
    mask: the last stage, or the first under ZBV).

    With --reset-position-ids or --reset-attention-mask every stage needs the per-token
    positions and document ids, so every rank reads data.
    """
    if cfg is not None and (cfg.data.reset_position_ids or cfg.data.reset_attention_mask):
        return True
    return ctx.is_first_stage or ctx.is_loss_stage
