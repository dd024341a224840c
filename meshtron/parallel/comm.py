"""Tensor- and sequence-parallel communication as small autograd functions.

Activations are laid out [sequence, batch, hidden], so the sequence-parallel
split is along dimension 0 and every gather/scatter works on contiguous memory.
Each function is the identity when ``group`` is None (a group of one).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    x = x.contiguous()
    assert x.shape[0] % world == 0, f"dimension 0 ({x.shape[0]}) not divisible by group size {world}"
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    chunk = x.shape[0] // world
    return x.narrow(0, _rank(group) * chunk, chunk).contiguous()


def all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    chunk = x.shape[-1] // world
    return x.narrow(-1, _rank(group) * chunk, chunk).contiguous()


class _CopyToRegion(torch.autograd.Function):
    """Forward identity, backward all-reduce: entering a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward all-reduce, backward identity: leaving a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward all-gather along the sequence, backward reduce-scatter (or split).

    ``grad_is_partial``: the consumers on each rank produce a partial gradient (a
    column-parallel linear), so backward sums over ranks (reduce-scatter). Otherwise
    each rank's gradient is complete and backward only keeps its own chunk.
    """

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group = group
        ctx.grad_is_partial = grad_is_partial
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim0(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward reduce-scatter along the sequence, backward all-gather (after a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward keep this rank's sequence chunk, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherLast(torch.autograd.Function):
    """Forward all-gather along the last dimension, backward keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, grad_is_partial: bool = True) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherFromSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherLast.apply(x, group)
