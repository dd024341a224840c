"""FP8 column- and row-parallel linear layers under sequence parallelism: cast first, then communicate.

With sequence parallelism a column-parallel layer all-gathers its input along the sequence and a
row-parallel layer all-gathers its output gradient in backward. Cast after the all-gather, as a plain
FP8 linear would, every TP rank moves bf16 bytes and then casts the whole gathered tensor (the same work
on every rank), and the compiler sees a cast between the all-gather and the FP8 matmul, so
``--async-tensor-parallel`` cannot split the pair into overlapping pieces.

Here each rank casts only its own sequence shard, with the scale of the whole gathered tensor (the
shards' absolute maxima are max-reduced over TP first, a one-element all-reduce), and all-gathers the
FP8 values: half the bytes, 1/TP of the cast work, and the FP8 all-gather feeds the FP8 matmul directly,
the pattern that the compiler's micro-pipelined TP fuses (likewise the FP8 matmul that feeds a
reduce-scatter). Because the scale is the gathered tensor's, the results equal a plain FP8 linear on
the gathered input bit for bit (tests/parallel/test_fp8_sequence_parallel.py).

The weight gradient needs the gathered operand transposed ([features, all tokens]): each rank saves
its shard's transposed copy (written by the same cast) and backward all-gathers those, so saved
activations shrink to 1/TP of the gathered FP8 input. Tensorwise scaling only (``--fp8-recipe rowwise``
and ``blockwise`` take the plain path: cast after the all-gather).

Zero-bubble schedules (``deferral``, as in meshtron.layers.fp8): the collectives stay in the input-gradient
pass; the gathered transposed operand is kept for the weight-gradient matmul, which the store runs later.
"""

from __future__ import annotations

import torch

from meshtron.layers.fp8.recipes import (E4M3, cast_both_layouts, cast_weight, output_dtype, recast_weight,
                                         scale_from_amax, scaled_mm, tensor_amax, weight_grad_now_or_deferred)
from meshtron.layers.fp8.cast import cast_transpose
from meshtron.parallel import comm
from meshtron.parallel.comm import Group


def _group_scale(x: torch.Tensor, dtype: torch.dtype, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) of the tensor that the ranks' shards ``x`` make together."""
    return scale_from_amax(comm.all_reduce(tensor_amax(x), group, op="max"), dtype)


def _finish_transpose(parts: torch.Tensor, shard_t: torch.Tensor, group: Group) -> torch.Tensor:
    """The ranks' transposed shards [C, n] (tokens last), all-gathered along dimension 0 into [tp * C, n],
    laid out as [C, tp * n]: the transposed matrix of all tokens, in rank order."""
    world, (cols, n) = comm.group_size(group), shard_t.shape
    return comm.wait(parts).view(world, cols, n).permute(1, 0, 2).reshape(cols, world * n)


class _ColumnSequenceParallelFP8(torch.autograd.Function):
    """y = all_gather(x) W^T + b with x cast to FP8 before the all-gather; backward reduce-scatters
    the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, grad_dtype, deferral=None):
        scale, x_inv = _group_scale(x, E4M3, group)
        xq, xq_t = cast_transpose(x, scale, E4M3)                    # this rank's tokens
        wq, w_scale, w_inv = cast_weight(weight)
        total = comm.wait(comm.all_gather_bytes_dim0_async(xq, group))  # [s, b, K], all tokens
        y = scaled_mm(total.reshape(-1, total.shape[-1]), x_inv, wq.t(), w_inv, output_dtype(x.dtype),
                      fast_accum=True).reshape(*total.shape[:-1], weight.shape[0])
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xq_t, x_inv, weight, w_scale, w_inv)  # the weight's copy is cast again
        ctx.group, ctx.grad_dtype, ctx.has_bias = group, grad_dtype, bias is not None
        ctx.x_dtype, ctx.w_dtype, ctx.deferral = x.dtype, weight.dtype, deferral
        return y

    @staticmethod
    def backward(ctx, grad):
        xq_t, x_inv, weight, w_scale, w_inv = ctx.saved_tensors
        parts = comm.all_gather_bytes_dim0_async(xq_t, ctx.group)  # overlaps the input-gradient matmul
        gq, gq_t, g_inv = cast_both_layouts(grad, ctx.grad_dtype)
        wq_t = recast_weight(weight, w_scale)
        grad_total = scaled_mm(gq.reshape(-1, gq.shape[-1]), g_inv, wq_t.t(), w_inv,
                               output_dtype(ctx.x_dtype)).reshape(*grad.shape[:-1], wq_t.shape[0])
        grad_x = comm.reduce_scatter_dim0_async(grad_total, ctx.group)  # overlaps the weight gradient
        total_t, w_dtype = _finish_transpose(parts, xq_t, ctx.group), output_dtype(ctx.w_dtype)
        grad_w = weight_grad_now_or_deferred(ctx.deferral, lambda: scaled_mm(gq_t, g_inv, total_t.t(), x_inv, w_dtype))
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(dim=0).to(ctx.w_dtype) if ctx.has_bias else None
        return comm.wait(grad_x), grad_w, grad_b, None, None, None


class _RowSequenceParallelFP8(torch.autograd.Function):
    """y = reduce_scatter(x W^T); backward casts this rank's output-gradient shard to FP8 before the
    all-gather."""

    @staticmethod
    def forward(ctx, x, weight, group, grad_dtype, deferral=None):
        xq, xq_t, x_inv = cast_both_layouts(x, E4M3)
        wq, w_scale, w_inv = cast_weight(weight)
        partial = scaled_mm(xq.reshape(-1, xq.shape[-1]), x_inv, wq.t(), w_inv, output_dtype(x.dtype),
                            fast_accum=True).reshape(*x.shape[:-1], weight.shape[0])
        ctx.save_for_backward(xq_t, x_inv, weight, w_scale, w_inv)  # the weight's copy is cast again
        ctx.group, ctx.grad_dtype, ctx.x_dtype, ctx.w_dtype = group, grad_dtype, x.dtype, weight.dtype
        ctx.deferral = deferral
        return comm.reduce_scatter_dim0(partial, group)

    @staticmethod
    def backward(ctx, grad):
        xq_t, x_inv, weight, w_scale, w_inv = ctx.saved_tensors
        wq_t = recast_weight(weight, w_scale)
        scale, g_inv = _group_scale(grad, ctx.grad_dtype, ctx.group)
        gq, gq_t = cast_transpose(grad, scale, ctx.grad_dtype)
        parts = comm.all_gather_bytes_dim0_async(gq_t, ctx.group)
        total = comm.wait(comm.all_gather_bytes_dim0_async(gq, ctx.group))  # [s, b, M], all tokens
        grad_x = scaled_mm(total.reshape(-1, total.shape[-1]), g_inv, wq_t.t(), w_inv,
                           output_dtype(ctx.x_dtype)).reshape(*total.shape[:-1], wq_t.shape[0])
        total_t, w_dtype = _finish_transpose(parts, gq_t, ctx.group), output_dtype(ctx.w_dtype)
        grad_w = weight_grad_now_or_deferred(ctx.deferral, lambda: scaled_mm(total_t, g_inv, xq_t.t(), x_inv, w_dtype))
        return grad_x, grad_w, None, None, None


def column_sequence_parallel_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 group: Group, grad_dtype: torch.dtype, deferral: tuple | None = None) -> torch.Tensor:
    """Column-parallel FP8 linear of this rank's sequence shard ``x`` [s/tp, b, K] -> [s, b, M/tp]
    (``deferral``: see the module docstring; autograd then sees ``weight`` detached)."""
    if deferral is not None:
        weight = weight.detach()
    return _ColumnSequenceParallelFP8.apply(x, weight, bias, group, grad_dtype, deferral)


def row_sequence_parallel_fp8(x: torch.Tensor, weight: torch.Tensor, group: Group,
                              grad_dtype: torch.dtype, deferral: tuple | None = None) -> torch.Tensor:
    """Row-parallel FP8 linear without bias, reduce-scattered along the sequence: [s, b, K/tp] -> [s/tp, b, M]
    (``deferral``: see the module docstring; autograd then sees ``weight`` detached)."""
    if deferral is not None:
        weight = weight.detach()
    return _RowSequenceParallelFP8.apply(x, weight, group, grad_dtype, deferral)
