"""FP8 linear layers with current scaling, through ``torch._scaled_mm``.

Recipe ``tensorwise`` (default, the fastest): the input and the weight are cast to float8 e4m3, each with one
scale computed from its current absolute maximum (448 / amax), and multiplied by the scaled-matmul kernel into
bf16. Under sequence parallelism the tensor-parallel layers cast before their all-gathers instead
(meshtron.layers.fp8.sequence_parallel), with the same values.
Backward: the output gradient is cast to e5m2 (``--fp8-format hybrid``: more range for gradients)
or e4m3 (``e4m3``), and both gradient matmuls run in FP8 with the saved FP8 input and the weight cast
again with the forward's scale (the same values: the weight does not change between the two). Keeping
the forward's transposed weight copy instead would hold one byte per weight element per micro-batch
in flight (about 2 GB for llama3-3b) for the cost of one read of the weights.
Master weights, gradients and the optimizer stay in higher precision: only the matmul operands are
FP8. The saved activations are the FP8 copies (half the bytes of bf16). Each activation is cast once and
written in both layouts the matmuls need (``meshtron.layers.fp8.cast.cast_transpose``); the weight in
its own layout for the forward, transposed in backward (:func:`cast_weight`, :func:`recast_weight`). The forward
product accumulates in the tensor cores' fast mode, the gradients in full fp32 (see ``_mm``).

Recipe ``rowwise`` (more accurate with outliers): one scale per row of each operand along the
dimension that is not contracted, so an outlier token or channel costs precision only in its own
row. Each matmul needs its operands scaled along different dimensions, so backward re-quantizes
the saved bf16 input and the weight (e4m3 throughout; it saves bf16, not FP8, activations).

Operand layouts follow the kernel's requirement on Hopper GPUs: the first operand row-major, the
second column-major. Matrix dimensions must be multiples of 16.

Zero-bubble schedules: with ``deferral`` = (weight-gradient store, parameter) and the weight detached
(see meshtron.layers.linear), backward computes the input gradient and hands the weight-gradient
scaled matmul, over the operands it would have used (tensorwise: the FP8 output gradient and input,
transposed; rowwise: the saved input and the output gradient, quantized in the W pass), to the store.
"""

from __future__ import annotations

from typing import Optional

import torch

from meshtron.layers.fp8.blockwise import fp8_linear_blockwise
from meshtron.layers.fp8.cast import cast_transpose, cast_transposed, scaled_cast
from meshtron.layers.fp8.operands import output_dtype, weight_grad_now_or_deferred

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def tensor_scale(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) with one scale for the whole tensor: the format's largest value over ``x``'s amax."""
    return scale_from_amax(tensor_amax(x), dtype)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``x`` (a one-element tensor, no gradient)."""
    # Row maxima first, then their maximum: compiled, this per-row reduction ran twice as fast as one
    # reduction of the whole tensor to a scalar (H200: 168 against 357 us for the SwiGLU output of llama3-3b).
    return x.detach().abs().amax(dim=-1).amax()


def quantize_rows(x: torch.Tensor, dim: int, dtype: torch.dtype = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x scaled and cast to ``dtype``, 1/scale) with one scale per slice along ``dim`` (the amax is
    taken over ``dim``: ``dim=1`` gives one scale per row, shape [rows, 1]; ``dim=0`` one per column)."""
    dtype = E4M3 if dtype is None else dtype
    scale, inv = scale_from_amax(x.detach().abs().amax(dim=dim, keepdim=True), dtype)
    return scaled_cast(x, scale, dtype), inv


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale that maps ``amax`` onto the format's largest value, and its inverse (which the scaled
    matmul multiplies back)."""
    scale = torch.finfo(dtype).max / amax.float().clamp(min=_EPS)
    return scale, scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a @ b from FP8 operands and their inverse scales. ``fast_accum`` lets Hopper's FP8 tensor cores
    accumulate without promoting partial sums to full fp32, which is faster: the forward product takes
    it, the gradients do not (the split that Transformer Engine and torchao make by default)."""
    # Row/column scales made from a transposed vector keep its strides; the kernel wants unit strides.
    a_inv, b_inv = a_inv.flatten().view(a_inv.shape), b_inv.flatten().view(b_inv.shape)
    return torch._scaled_mm(a.contiguous(), _col_major(b), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def cast_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``weight`` [M, K] as e4m3 in its own layout, its scale, 1/scale): the forward's operand
    (``wq.t()`` is the column-major [K, M] the scaled matmul takes second)."""
    scale, inv = tensor_scale(weight, E4M3)
    return scaled_cast(weight, scale, E4M3), scale, inv


def recast_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The transposed e4m3 copy [K, M] of ``weight`` with the forward's ``scale``, for backward's
    input-gradient matmul (``wq_t.t()`` is the column-major [M, K] operand): the values the forward
    would have kept, cast again instead of held between forward and backward."""
    return cast_transposed(weight.detach(), scale, E4M3)


def forward_product(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensorwise forward ``x2 [N, K] @ weight [M, K]^T`` in e4m3: (the product [N, M], the input's transposed
    FP8 copy and 1/scale, which the weight gradient takes, the weight's scale and 1/scale, with which backward
    casts it again)."""
    xq, xq_t, x_inv = cast_both_layouts(x2, E4M3)
    wq, w_scale, w_inv = cast_weight(weight)
    y = scaled_mm(xq, x_inv, wq.t(), w_inv, out_dtype, fast_accum=True)  # [N, K] @ [K, M]
    return y, xq_t, x_inv, w_scale, w_inv


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, deferral=None):
        shape = x.shape
        out_dtype = output_dtype(x.dtype)
        y, xq_t, x_inv, w_scale, w_inv = forward_product(x.reshape(-1, shape[-1]), weight, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # The input's transposed copy is what the weight gradient takes (as column-major second operand);
        # the weight's is cast again in backward.
        ctx.save_for_backward(xq_t, x_inv, weight, w_scale, w_inv)
        ctx.shape, ctx.grad_dtype, ctx.has_bias = shape, grad_dtype, bias is not None
        ctx.x_dtype, ctx.w_dtype, ctx.deferral = x.dtype, weight.dtype, deferral
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq_t, x_inv, weight, w_scale, w_inv = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, gq_t, g_inv = cast_both_layouts(g2, ctx.grad_dtype)
        wq_t = recast_weight(weight, w_scale)
        grad_x = scaled_mm(gq, g_inv, wq_t.t(), w_inv, output_dtype(ctx.x_dtype)).view(ctx.shape)  # [N, M] @ [M, K]
        # Straight into the weight's dtype: the matmul accumulates in fp32 and rounds once either way.
        w_dtype = output_dtype(ctx.w_dtype)
        grad_w = weight_grad_now_or_deferred(
            ctx.deferral, lambda: scaled_mm(gq_t, g_inv, xq_t.t(), x_inv, w_dtype))  # [M, N] @ [N, K]
        grad_b = g2.sum(dim=0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def cast_both_layouts(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as FP8 in its own shape, the same as a matrix [R, C] transposed to [C, R], 1/scale) with one
    scale for the whole tensor."""
    scale, inv = tensor_scale(x, dtype)
    q, q_t = cast_transpose(x, scale, dtype)
    return q, q_t, inv


class _FP8LinearRowwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, deferral=None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = output_dtype(x.dtype)
        xq, x_inv = quantize_rows(x2, 1)           # [N, 1]: one scale per token
        wq, w_inv = quantize_rows(weight, 1)       # [M, 1]: one scale per output feature
        y = scaled_mm(xq, x_inv, wq.t(), w_inv.t(), out_dtype, fast_accum=True)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x2, weight)
        ctx.shape, ctx.has_bias, ctx.deferral = shape, bias is not None, deferral
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        out_dtype = output_dtype(x2.dtype)
        # grad_x [N, K] = g [N, M] @ W [M, K]: g per token, W per input feature (over M).
        gq, g_inv = quantize_rows(g2, 1)
        wq, w_inv = quantize_rows(weight, 0)
        grad_x = scaled_mm(gq, g_inv, wq, w_inv, out_dtype).view(ctx.shape)
        grad_w = weight_grad_now_or_deferred(ctx.deferral, lambda: _rowwise_weight_grad(g2, x2, weight.dtype))
        grad_b = g2.float().sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def _rowwise_weight_grad(g2: torch.Tensor, x2: torch.Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """grad_W [M, K] = g^T [M, N] @ x [N, K]: g per output feature, x per input feature (over N)."""
    gtq, gt_inv = quantize_rows(g2, 0)
    xq, x_inv = quantize_rows(x2, 0)
    return scaled_mm(gtq.t(), gt_inv.t(), xq, x_inv, output_dtype(x2.dtype)).to(w_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fmt: str,
               recipe: str = "tensorwise", deferral: Optional[tuple] = None) -> torch.Tensor:
    """``F.linear`` with FP8 operands (``fmt``: "e4m3" or "hybrid"; ``recipe``: "tensorwise", or "rowwise" or
    "blockwise" (:mod:`meshtron.layers.fp8.blockwise`), which take e4m3 only; see the module docstring).
    ``deferral``: (zero-bubble store, ``weight``): the weight gradient goes to the store, and autograd sees
    ``weight`` detached."""
    if deferral is not None:
        weight = weight.detach()
    if recipe == "rowwise":
        return _FP8LinearRowwise.apply(x, weight, bias, deferral)
    if recipe == "blockwise":
        return fp8_linear_blockwise(x, weight, bias, deferral)
    return _FP8Linear.apply(x, weight, bias, gradient_dtype(fmt), deferral)


def gradient_dtype(fmt: str) -> torch.dtype:
    """The FP8 dtype of output gradients: e5m2 (more range) for "hybrid", else e4m3."""
    return E5M2 if fmt == "hybrid" else E4M3
