"""Rows of the MoE experts' buffers and tokens, moved with gathers both ways.

The experts compute on a buffer of rows grouped by expert (the grouped GEMM's aligned buffer, or the
dispatcher's capacity slots); routing choice ``t * k + j`` (token t's j-th expert) owns row ``slot[t * k + j]``.
Filling the buffer from the tokens, summing each token's k rows back, and picking rows out are autograd
functions whose backward is a gather too: ``index_select``'s own backward scatters with an atomic
``index_add_`` (in bf16, with each token read k times, that one kernel took 14% of a fine-grained MoE step
on an H200), while these accumulate each token's k gradients in fp32 and are deterministic.

Each token's sum over its k rows (the combine) is a Triton kernel on CUDA that reads each row once and
writes the sum: at the Qwen3-30B-A3B layer shape (16,384 tokens, k = 8, H = 2048) the compiled
gather-and-sum took 0.64 ms per call on an H200 (about 0.9 TB/s) against 0.146 ms. Elsewhere the same
sum comes from a gather and a reduction in torch.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None


def slots_to_tokens_torch(rows: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
    """The sum over each token's k slots with torch operations (a gather, then a reduction in fp32)."""
    return rows.index_select(0, slot).view(-1, k, rows.shape[-1]).sum(1, dtype=torch.float32).to(rows.dtype)


if triton is not None:

    @triton.jit
    def _slot_sum_kernel(rows_ptr, slot_ptr, out_ptr, width, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(slot_ptr + token * K + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * width + cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def slots_to_tokens(rows: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
    """``out[t] = sum_j rows[slot[t * k + j]]`` -> [len(slot) / k, H], summed in fp32, in ``rows``' dtype."""
    if triton is None or not rows.is_cuda:
        return slots_to_tokens_torch(rows, slot, k)
    rows = rows.contiguous()
    tokens, width = slot.numel() // k, rows.shape[-1]
    out = rows.new_empty((tokens, width))
    block = min(1024, triton.next_power_of_2(width))
    _slot_sum_kernel[(tokens, triton.cdiv(width, block))](rows, slot, out, width, K=k, BLOCK=block)
    return out


def tokens_to_slots(tokens: torch.Tensor, slot: torch.Tensor, total: int, k: int) -> torch.Tensor:
    """The [total, H] buffer whose row ``slot[t * k + j]`` is ``tokens[t]`` (padding rows zero): one gather."""
    source = torch.full((total,), tokens.shape[0], dtype=torch.long, device=tokens.device)  # padding: the zero row
    source.index_copy_(0, slot, torch.arange(slot.numel(), device=tokens.device) // k)
    return torch.cat([tokens, tokens.new_zeros((1, tokens.shape[1]))]).index_select(0, source)


class GatherToSlots(torch.autograd.Function):
    """The [total, H] buffer filled from the tokens, row ``slot[t * k + j]`` holding token t (rows that no
    choice owns are zero; dropped choices may share a spare row that the caller cuts off): one gather.
    Backward: each token's gradient is the sum over its k slots (gathered, summed in fp32)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, slot: torch.Tensor, total: int, k: int) -> torch.Tensor:
        ctx.save_for_backward(slot)
        ctx.k = k
        return tokens_to_slots(tokens, slot, total, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot,) = ctx.saved_tensors
        return slots_to_tokens(grad, slot, ctx.k), None, None, None


class SumFromSlots(torch.autograd.Function):
    """Each token's sum over its k rows of the buffer (the adjoint of :class:`GatherToSlots`):
    keeps only the slots for backward, which hands every slot its token's gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slot)
        ctx.k, ctx.total = k, rows.shape[0]
        return slots_to_tokens(rows, slot, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot,) = ctx.saved_tensors
        return tokens_to_slots(grad, slot, ctx.total, ctx.k), None, None


class RowsAt(torch.autograd.Function):
    """The rows ``dest`` of ``padded`` (the aligned groups' output, the capacity slots). ``index_select``'s own
    backward would scatter the gradient with an atomic ``index_add_`` (slow in bf16); every row is read at
    most once (several may read a spare zero row whose gradient nobody uses), so a plain ``index_copy`` into
    zeros is the same gradient."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dest)
        ctx.rows = padded.shape[0]
        return padded.index_select(0, dest)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dest,) = ctx.saved_tensors
        return grad.new_zeros((ctx.rows, grad.shape[-1])).index_copy_(0, dest, grad), None
