"""FP8 cast with a transposed copy in the same pass (the operand layouts FP8 matmuls need).

The FP8 matmul kernels of Hopper GPUs take their first operand row-major and their second
column-major, so each operand of the three matmuls of a linear layer is needed both as stored and
transposed: the input ``x`` row-major for the forward product and transposed for the weight gradient,
the output gradient likewise, the weight once each way. ``cast_transpose`` writes both copies from one
read of the high-precision tensor; ``cast_transposed`` writes only the transposed one (a weight's copy
for the input-gradient matmul, cast again in backward instead of kept). On CUDA a Triton kernel does it tile by tile, so that both stores
are coalesced; left to the compiler, the transposed FP8 store of a fused cast ran at about a tenth of
memory bandwidth (H200, llama3-3b: 527 us for one 16384 x 3072 activation).

Elsewhere (CPU) the same values come from torch operations. To the compiler's graph partitioning the
operator is one opaque node (the absolute maximum that sets ``scale`` stays in compiled code, fused with
whatever produces ``x``). With Triton it is a ``torch.library.triton_op``: compiled code launches the
kernel directly, without the Python dispatch of a custom operator on every call (the host time that
a step of many small FP8 casts can be bound by).
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to the range of ``dtype`` and cast to it (``scale`` broadcasts over ``x``)."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def _cast_transpose_torch(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    q = scaled_cast(x, scale, dtype)
    q2 = q.reshape(-1, q.shape[-1])
    # A fresh tensor even where .contiguous() would return the view itself (an empty matrix).
    return q, q2.new_empty((q2.shape[1], q2.shape[0])).copy_(q2.t())


_DOC = """(``x`` scaled and cast to ``dtype``, in ``x``'s shape; the same values as a matrix [R, C] transposed
    and contiguous [C, R], where C is ``x``'s last dimension and R the product of the others).

    ``scale`` is a one-element fp32 tensor (one scale for the whole tensor).
    """

if triton is None:

    @torch.library.custom_op("meshtron::fp8_cast_transpose", mutates_args=())
    def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return _cast_transpose_torch(x, scale, dtype)

    @cast_transpose.register_fake
    def _cast_transpose_fake(x, scale, dtype):
        rows = math.prod(x.shape[:-1])
        return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[-1], rows), dtype=dtype)

    @torch.library.custom_op("meshtron::fp8_cast_transposed", mutates_args=())
    def cast_transposed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _cast_transpose_torch(x, scale, dtype)[1]

    @cast_transposed.register_fake
    def _cast_transposed_fake(x, scale, dtype):
        return x.new_empty((x.shape[-1], math.prod(x.shape[:-1])), dtype=dtype)

else:

    @triton.autotune(
        configs=[triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                 for r, c, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8))],
        key=["rows", "cols"])
    @triton.jit
    def _cast_transpose_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, rows, cols, x_row_stride,
                               FMAX: tl.constexpr, WRITE_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * x_row_stride + c[None, :], mask=mask, other=0.0)
        scaled = x.to(tl.float32) * tl.load(scale_ptr)
        q = tl.minimum(tl.maximum(scaled, -FMAX), FMAX).to(qt_ptr.dtype.element_ty)
        if WRITE_Q:
            tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], q, mask=mask)
        # The transposed tile: Triton moves it through shared memory so that this store is coalesced too.
        tl.store(qt_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(q), mask=tl.trans(mask))

    def _launch(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, write_q: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, cols = x.shape
        qt = torch.empty((cols, rows), dtype=dtype, device=x.device)
        q = torch.empty(shape, dtype=dtype, device=x.device) if write_q else qt
        if qt.numel() == 0:  # no kernel for an empty grid
            return q, qt

        def grid(meta):
            return triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(cols, meta["BLOCK_C"])

        torch.library.wrap_triton(_cast_transpose_kernel)[grid](
            x, scale, q, qt, rows, cols, x.stride(0), FMAX=torch.finfo(dtype).max, WRITE_Q=write_q)
        return q, qt

    @torch.library.triton_op("meshtron::fp8_cast_transpose", mutates_args=())
    def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.device.type != "cuda":
            return _cast_transpose_torch(x, scale, dtype)
        return _launch(x, scale, dtype, write_q=True)

    @torch.library.triton_op("meshtron::fp8_cast_transposed", mutates_args=())
    def cast_transposed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.device.type != "cuda":
            return _cast_transpose_torch(x, scale, dtype)[1]
        return _launch(x, scale, dtype, write_q=False)[1]

cast_transpose.__doc__ = _DOC
cast_transposed.__doc__ = """Only the transposed copy of :func:`cast_transpose` ([C, R], contiguous): a weight's
    FP8 copy for the input-gradient matmul, cast again in backward rather than kept from the forward."""
