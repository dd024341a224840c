"""Pipeline parallelism: stage partitioning and schedules."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import initialize_parameters
from meshtron.pipeline.schedules import forward_backward_no_pipelining


def recompute_layer_ids(cfg: MeshtronConfig, layer_ids: list[int]) -> list[int]:
    """Layers run under full activation recomputation on this stage."""
    t = cfg.train
    if t.recompute_granularity != "full":
        return []
    if t.recompute_method == "block":
        return layer_ids[: t.recompute_num_layers]
    return list(layer_ids)


def build_model_chunks(cfg: MeshtronConfig, ctx: ParallelContext, vocab_size: int, tracker: RNGTracker,
                       dtype: torch.dtype) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), initialised and ready to train."""
    layer_ids = list(range(cfg.model.num_layers))
    model = GPTModel(cfg.model, ctx, vocab_size, layer_ids=layer_ids,
                     sequence_parallel=cfg.parallel.sequence_parallel,
                     recompute_layers=recompute_layer_ids(cfg, layer_ids))
    initialize_parameters(model, cfg.train.seed, ctx.device, dtype)
    model.set_rng_tracker(tracker)
    if cfg.train.compile:
        for layer in model.layers.values():
            layer.compile()
    return [model]


def get_schedule(cfg: MeshtronConfig, ctx: ParallelContext) -> Callable:
    """The forward/backward schedule: ``schedule(model_chunks, micro_batches, forward_only=False,
    before_last_backward=None) -> summed weighted loss`` (a tensor; zero on stages without the loss)."""
    return forward_backward_no_pipelining


def is_data_rank(ctx: ParallelContext) -> bool:
    """Ranks that read training data: the first stage (tokens) and the last (labels and loss mask)."""
    return ctx.is_first_stage or ctx.is_last_stage
