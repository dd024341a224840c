"""Pipeline parallelism: stage partitioning, point-to-point exchange, schedules.

The training loop's entry points are :func:`build_model_chunks`, :func:`get_schedule`,
:func:`is_data_rank`, and the batch helpers of :mod:`meshtron.pipeline.batches`.

This package's face imports nothing heavy: torch, the model and the schedules load when a
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
from meshtron.pipeline.partition import PipelineLayout, check_micro_batches, partition_layers

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from meshtron.parallel.context import ParallelContext
    from meshtron.parallel.random import RNGTracker
    from meshtron.pipeline.schedules import ScheduleStats

__all__ = ["PipelineLayout", "ScheduleStats", "build_model_chunks", "check_micro_batches", "get_schedule",
           "is_data_rank", "layout_from_config", "partition_layers"]

#: Names this package re-exports from modules that load on first use: name -> module.
_LAZY = {"ScheduleStats": "meshtron.pipeline.schedules", "layout_from_config": "meshtron.validation"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recompute_layer_ids(cfg: MeshtronConfig, layer_ids: list[int]) -> list[int]:
    """Layers run under full activation recomputation in one model chunk (``block``: its first N)."""
    t = cfg.train
    if t.recompute_granularity != "full":
        return []
    if t.recompute_method == "block":
        return layer_ids[: t.recompute_num_layers]
    return list(layer_ids)


def _check_stages(layout: PipelineLayout, ctx: ParallelContext) -> None:
    if layout.stages != ctx.pp:
        raise ConfigError(f"--pipeline-model-parallel-size is {layout.stages} but the process groups were built "
                          f"with {ctx.pp} pipeline stages")


def build_model_chunks(cfg: MeshtronConfig, ctx: ParallelContext, vocab_size: int, tracker: RNGTracker,
                       dtype: torch.dtype, make_mlp: Optional[Callable] = None) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), initialised and ready to train.

    Chunk ``v`` of pipeline rank ``p`` holds the layers of :func:`layout_from_config`; the embedding
    is on chunk 0 of stage 0, the output layer and loss on the last chunk of the last stage.
    ``make_mlp`` replaces layers' MLPs (default: mixture-of-experts layers when --num-experts is set).
    """
    from meshtron.layers.fp8 import enable_fp8
    from meshtron.layers.linear import set_tp_comm_overlap
    from meshtron.layers.moe import moe_mlp_factory
    from meshtron.model import GPTModel
    from meshtron.parallel import comm
    from meshtron.parallel.sharding import initialize_parameters
    from meshtron.validation import layout_from_config

    layout = layout_from_config(cfg)
    _check_stages(layout, ctx)
    if make_mlp is None:
        make_mlp = moe_mlp_factory(cfg)
    chunks: list[nn.Module] = []
    for v in range(layout.virtual_stages):
        layer_ids = layout.layers(ctx.pp_rank, v)
        model = GPTModel(cfg.model, ctx, vocab_size, layer_ids=layer_ids,
                         pre_process=layout.has_embedding(ctx.pp_rank, v),
                         post_process=layout.has_loss(ctx.pp_rank, v),
                         sequence_parallel=cfg.parallel.sequence_parallel,
                         recompute_layers=recompute_layer_ids(cfg, layer_ids),
                         selective_recompute=cfg.train.recompute_granularity == "selective", make_mlp=make_mlp)
        initialize_parameters(model, cfg.train.seed, ctx.device, dtype)
        model.set_rng_tracker(tracker)
        if cfg.train.fp8_format:
            enable_fp8(model, cfg.train.fp8_format, cfg.train.fp8_recipe)
        set_tp_comm_overlap(model, cfg.parallel.tp_comm_overlap)
        if cfg.train.compile:
            comm.set_micro_pipelined_tp(cfg.parallel.async_tensor_parallel, ctx.tp_group)
            for layer in model.layers.values():
                layer.compile()
        chunks.append(model)
    return chunks


def get_schedule(cfg: MeshtronConfig, ctx: ParallelContext) -> Callable:
    """The forward/backward schedule: ``schedule(model_chunks, micro_batches, forward_only=False,
    before_last_backward=None) -> summed weighted loss`` (a tensor; zero on stages without the loss).

    One stage: no pipelining. Several: 1F1B, or interleaved 1F1B with virtual stages; the
    returned callable carries this rank's point-to-point communicator.
    """
    import torch

    from meshtron.pipeline.p2p import PipelineP2P, activation_shape
    from meshtron.pipeline.schedules import forward_backward_no_pipelining, forward_backward_pipelining
    from meshtron.validation import layout_from_config

    if ctx.pp == 1:
        return forward_backward_no_pipelining
    layout = layout_from_config(cfg)
    _check_stages(layout, ctx)
    t = cfg.train
    if t.global_batch_size is not None:
        check_micro_batches(t.global_batch_size // (t.micro_batch_size * ctx.dp), ctx.pp, layout.virtual_stages)
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    p2p = PipelineP2P(ctx, activation_shape(cfg, ctx), dtype, ctx.device)
    return functools.partial(forward_backward_pipelining, p2p=p2p, overlap_p2p=cfg.parallel.overlap_p2p_comm)


def is_data_rank(ctx: ParallelContext, cfg: Optional[MeshtronConfig] = None) -> bool:
    """Ranks that read training data: the first stage (tokens) and the last (labels and loss mask).

    With --reset-position-ids or --reset-attention-mask every stage needs the per-token
    positions and document ids, so every rank reads data.
    """
    if cfg is not None and (cfg.data.reset_position_ids or cfg.data.reset_attention_mask):
        return True
    return ctx.is_first_stage or ctx.is_last_stage
