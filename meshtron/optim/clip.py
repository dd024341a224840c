"""Global gradient norm over every parallel group, and clipping."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of


def grad_norm_squared(params: Sequence[nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """This rank's contribution to the squared global norm of the main gradients.

    Parameters replicated over TP are counted on TP rank 0 only; the caller sums
    the contributions over the groups that hold different parameters.
    """
    grads = [p.main_grad for p in params if not (spec_of(p).tp_replicated and ctx.tp_rank != 0)]
    if not grads:
        device = params[0].main_grad.device if params else ctx.device
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
    return torch.stack(norms).square().sum()


def global_grad_norm(params: Sequence[nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """The L2 norm of all gradients of the model (a 0-d tensor, no host sync).

    After the data-parallel reduction every DP/CP replica holds the same gradients,
    so the sum runs over the ranks that hold different parameters: TP x PP.
    """
    sq = grad_norm_squared(params, ctx)
    if ctx.model_parallel_group is not None:
        dist.all_reduce(sq, group=ctx.model_parallel_group)
    return sq.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / norm) as a tensor (1 when clipping is off)."""
    if max_norm <= 0:
        return torch.ones_like(total_norm)
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
