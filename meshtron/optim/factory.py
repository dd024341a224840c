"""Builds the gradient buffers, gradient reduction and optimizer for a run from its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.optim.clip import global_grad_norm
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.grads import GradientSync
from meshtron.optim.optimizer import MixedPrecisionAdamW
from meshtron.parallel.context import ParallelContext


@dataclass
class Optimization:
    """Everything the training step needs after the forward/backward passes.

    grad_buffer: zero() before an iteration; .data is scaled by the clip coefficient.
    grad_sync: start_overlap() before the last backward, finish() after it.
    grad_norm: () -> 0-d tensor, the global gradient norm (after finish()).
    optimizer: step(lr), plus the checkpoint interface (state_tensors, load_state_tensors, ...).
    """

    grad_buffer: GradBuffer
    grad_sync: GradientSync
    grad_norm: Callable[[], torch.Tensor]
    optimizer: MixedPrecisionAdamW


def build_optimization(cfg: MeshtronConfig, ctx: ParallelContext, model_chunks: Sequence[nn.Module]) -> Optimization:
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    grad_dtype = torch.bfloat16 if cfg.parallel.grad_reduce_in_bf16 else torch.float32
    buffer = GradBuffer(params, dtype=grad_dtype, device=ctx.device)
    sync = GradientSync(model_chunks, params, ctx, buffer)
    optimizer = MixedPrecisionAdamW(params, cfg.optim)
    return Optimization(buffer, sync, lambda: global_grad_norm(params, ctx), optimizer)
