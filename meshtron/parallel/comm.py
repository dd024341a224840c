"""Tensor- and sequence-parallel communication as small autograd functions.

Activations are laid out [sequence, batch, hidden], so the sequence-parallel
split is along dimension 0 and every gather/scatter works on contiguous memory.
Each function is the identity when ``group`` is None (a group of one).

The collectives are torch's functional collectives (they return new tensors instead
of writing into a given one): these are what torch.compile traces faithfully inside
a compiled layer. In-place ``dist.*`` collectives inside the autograd functions of a
compiled layer silently cut the layer's parameters off from their gradients on
torch 2.11 (tests/parallel/test_tp_gpu.py). In eager mode a functional collective
returns at once and is waited for where its result is first used, so a caller can
overlap it with independent work.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Group = Optional[dist.ProcessGroup]

# Newer torch names these ``*_single`` (same arguments) and deprecates the ``*_tensor`` names that
# older releases (2.11) have alone.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def set_micro_pipelined_tp(enabled: bool, group: Group) -> None:
    """Let (or stop) torch.compile split the all-gather + matmul and matmul + reduce-scatter pairs of
    compiled layers into pieces that overlap (``--async-tensor-parallel``). This is a process-wide
    compiler setting, so every model build sets it for its own run."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = enabled
    if enabled and group is not None:
        from torch.distributed import _symmetric_memory

        enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)  # needed by older torch only
        if enable is not None:
            enable(group.group_name)


def group_size(group: Group) -> int:
    """Ranks in ``group`` (1 for None: no process group, one process)."""
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def wait(x: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once the collective has finished (eager mode);
    a traced collective's result is returned as it is (the compiler places the wait)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def all_reduce_async(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over ``group`` (a new tensor; ``op``: "sum" or "max"), not yet waited for: pass it
    through :func:`wait`."""
    return x if group_size(group) == 1 else funcol.all_reduce(x.contiguous(), op, group)


def all_gather_dim0_async(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The ranks' ``x`` concatenated along dimension 0, not yet waited for."""
    return x if group_size(group) == 1 else _all_gather(x.contiguous(), 0, group)


def reduce_scatter_dim0_async(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunk (along dimension 0) of the sum of ``x`` over ``group``, not yet waited for."""
    world = group_size(group)
    if world == 1:
        return x
    assert x.shape[0] % world == 0, f"dimension 0 ({x.shape[0]}) not divisible by group size {world}"
    return _reduce_scatter(x.contiguous(), "sum", 0, group)


def all_reduce(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    return wait(all_reduce_async(x, group, op))


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    return wait(all_gather_dim0_async(x, group))


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    return wait(reduce_scatter_dim0_async(x, group))


def all_gather_bytes_dim0_async(x: torch.Tensor, group: Group) -> torch.Tensor:
    """:func:`all_gather_dim0_async` for one-byte dtypes such as FP8, which gloo lacks. On CUDA the tensor
    is gathered as it is, so that the compiler sees an FP8 all-gather feeding an FP8 matmul (the pair
    that ``--async-tensor-parallel`` splits into overlapping pieces); elsewhere through a uint8 view, already
    waited for (so that the result can be viewed back as the one-byte dtype)."""
    if x.is_cuda or group_size(group) == 1:
        return all_gather_dim0_async(x, group)
    return wait(all_gather_dim0_async(x.view(torch.uint8), group)).view(x.dtype)


def split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    chunk = x.shape[0] // world
    return x.narrow(0, _rank(group) * chunk, chunk).contiguous()


def all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return wait(_all_gather(x.contiguous(), x.dim() - 1, group))


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
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
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, grad_is_partial: bool = True) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherLast.apply(x, group)
