"""The SwiGLU feed-forward block in FP8 (tensorwise) as one autograd function, fc1's input to fc2's output.

Run as two FP8 linears, the block's backward writes the gradient of fc1's output (gate and up, ``2f`` per token)
in bf16, reads it again for its absolute maximum and once more to cast it into the two FP8 layouts fc1's
gradient matmuls take: on llama3-3b about 1.2 ms per layer, twice what its traffic needs. Here the gradient of
gate and up never exists in high precision. Two passes over gate, up and the product's gradient do the work:

1. :func:`swiglu_grad_amax` takes the largest absolute value of the gradient of gate and up without writing it,
   and in the same pass recomputes the product ``silu(gate) * up`` and casts it, transposed, with the forward's
   scale: the operand of fc2's weight gradient, which is not kept between forward and backward;
2. :func:`swiglu_grad_cast` computes the gradient again and writes it straight into both FP8 layouts.

What the block keeps for backward is what the two linears kept: the one-byte transposed copy of fc1's input and
fc1's output (gate and up); neither weight's FP8 copy (each is cast again in backward with its forward scale).
The forward's product is ``silu(gate) * up`` computed in fp32 and rounded once to the activations' dtype
(:func:`swiglu_product`), which is also what the backward's recomputation rounds; each gradient element is
rounded to the activations' dtype before its cast, as a gradient handed from one linear to the next would be.

On CUDA both passes are Triton kernels (``torch.library.triton_op``: compiled layers launch them directly); on
other devices the same values come from torch operations. Used by :class:`meshtron.layers.mlp.MLP` where both
linears run FP8 tensorwise without biases, outside the sequence-parallel FP8 path and zero-bubble deferral.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.layers.fp8.cast import scaled_cast
from meshtron.layers.fp8.recipes import (E4M3, cast_both_layouts, cast_weight, forward_product, output_dtype,
                                         recast_weight, scale_from_amax, scaled_mm, tensor_scale)

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None


def swiglu_product(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = [gate, up] along the last dimension, in fp32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _swiglu_grads_torch(gate_up: torch.Tensor, grad_product: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient of ``gate_up`` rounded to its dtype, the recomputed product) from torch operations."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gp = grad_product.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_gate = gp * up * sig * (1 + gate * (1 - sig))
    grad = torch.cat([grad_gate, gp * silu], dim=-1).to(gate_up.dtype)
    return grad, (silu * up).to(gate_up.dtype)


def _check(gate_up: torch.Tensor, grad_product: torch.Tensor) -> tuple[int, int]:
    rows, width = grad_product.shape
    if gate_up.shape != (rows, 2 * width):
        raise ValueError(f"gate_up must be [rows, 2 * width] = {(rows, 2 * width)}, got {tuple(gate_up.shape)}")
    return rows, width


def _amax_torch(gate_up, grad_product, product_scale, product_dtype):
    grad, product = _swiglu_grads_torch(gate_up, grad_product)
    product_t = scaled_cast(product, product_scale, product_dtype).t().contiguous()
    amax = grad.abs().amax().float() if grad.numel() else grad.new_zeros((), dtype=torch.float32)
    return product_t, amax


def _cast_torch(gate_up, grad_product, scale, dtype):
    grad, _ = _swiglu_grads_torch(gate_up, grad_product)
    q = scaled_cast(grad, scale, dtype)
    return q, q.t().contiguous()


_AMAX_DOC = """(the product ``silu(gate) * up`` cast with ``product_scale`` to ``product_dtype`` and transposed
    [width, rows], the largest absolute value of the gradient of ``gate_up`` as a 0-dim fp32 tensor).

    ``gate_up`` [rows, 2 * width] is fc1's output, ``grad_product`` [rows, width] the gradient of the product.
    """

_CAST_DOC = """(the gradient of ``gate_up`` cast with ``scale`` to ``dtype`` [rows, 2 * width], the same
    transposed and contiguous [2 * width, rows]); arguments as :func:`swiglu_grad_amax`."""

if triton is None:

    @torch.library.custom_op("meshtron::fp8_swiglu_grad_amax", mutates_args=())
    def swiglu_grad_amax(gate_up: torch.Tensor, grad_product: torch.Tensor, product_scale: torch.Tensor,
                         product_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        _check(gate_up, grad_product)
        return _amax_torch(gate_up, grad_product, product_scale, product_dtype)

    @swiglu_grad_amax.register_fake
    def _amax_fake(gate_up, grad_product, product_scale, product_dtype):
        rows, width = grad_product.shape
        return (gate_up.new_empty((width, rows), dtype=product_dtype),
                gate_up.new_empty((), dtype=torch.float32))

    @torch.library.custom_op("meshtron::fp8_swiglu_grad_cast", mutates_args=())
    def swiglu_grad_cast(gate_up: torch.Tensor, grad_product: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        _check(gate_up, grad_product)
        return _cast_torch(gate_up, grad_product, scale, dtype)

    @swiglu_grad_cast.register_fake
    def _cast_fake(gate_up, grad_product, scale, dtype):
        rows, width = grad_product.shape
        return (gate_up.new_empty((rows, 2 * width), dtype=dtype),
                gate_up.new_empty((2 * width, rows), dtype=dtype))

else:

    _CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                for r, c, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8))]

    @triton.jit
    def _swiglu_grad_tile(gate_up_ptr, grad_ptr, r, c, rows, width, gu_stride, g_stride,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """One tile of (gradient of gate, gradient of up, product, mask): every value as fp32, rounded
        to the activations' dtype like the torch path."""
        mask = (r[:, None] < rows) & (c[None, :] < width)
        row = r[:, None].to(tl.int64)
        gate = tl.load(gate_up_ptr + row * gu_stride + c[None, :], mask=mask, other=0.0)
        act_dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = tl.load(gate_up_ptr + row * gu_stride + width + c[None, :], mask=mask, other=0.0).to(tl.float32)
        gp = tl.load(grad_ptr + row * g_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        grad_gate = (gp * up * sig * (1.0 + gate * (1.0 - sig))).to(act_dtype).to(tl.float32)
        grad_up = (gp * silu).to(act_dtype).to(tl.float32)
        product = (silu * up).to(act_dtype).to(tl.float32)
        return grad_gate, grad_up, product, mask

    @triton.autotune(configs=_CONFIGS, key=["rows", "width"])
    @triton.jit
    def _swiglu_grad_amax_kernel(gate_up_ptr, grad_ptr, product_scale_ptr, product_t_ptr, amax_ptr, rows, width,
                                 gu_stride, g_stride, PRODUCT_MAX: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        grad_gate, grad_up, product, mask = _swiglu_grad_tile(gate_up_ptr, grad_ptr, r, c, rows, width, gu_stride,
                                                              g_stride, BLOCK_R, BLOCK_C)
        # Masked elements are zeros (gate = up = gradient = 0), so they cannot raise the maximum.
        tile_max = tl.max(tl.max(tl.maximum(tl.abs(grad_gate), tl.abs(grad_up)), axis=1), axis=0)
        tl.atomic_max(amax_ptr, tile_max)  # non-negative floats: the order of the updates does not matter
        scaled = product * tl.load(product_scale_ptr)
        q = tl.minimum(tl.maximum(scaled, -PRODUCT_MAX), PRODUCT_MAX).to(product_t_ptr.dtype.element_ty)
        tl.store(product_t_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(q), mask=tl.trans(mask))

    @triton.autotune(configs=_CONFIGS, key=["rows", "width"])
    @triton.jit
    def _swiglu_grad_cast_kernel(gate_up_ptr, grad_ptr, scale_ptr, q_ptr, q_t_ptr, rows, width, gu_stride, g_stride,
                                 FMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        grad_gate, grad_up, _, mask = _swiglu_grad_tile(gate_up_ptr, grad_ptr, r, c, rows, width, gu_stride,
                                                        g_stride, BLOCK_R, BLOCK_C)
        scale = tl.load(scale_ptr)
        out = q_t_ptr.dtype.element_ty
        q_gate = tl.minimum(tl.maximum(grad_gate * scale, -FMAX), FMAX).to(out)
        q_up = tl.minimum(tl.maximum(grad_up * scale, -FMAX), FMAX).to(out)
        row = r[:, None].to(tl.int64) * (2 * width)
        tl.store(q_ptr + row + c[None, :], q_gate, mask=mask)
        tl.store(q_ptr + row + width + c[None, :], q_up, mask=mask)
        # The transposed tiles: Triton moves them through shared memory so that these stores are coalesced too.
        col = c[:, None].to(tl.int64) * rows + r[None, :]
        tl.store(q_t_ptr + col, tl.trans(q_gate), mask=tl.trans(mask))
        tl.store(q_t_ptr + width * rows + col, tl.trans(q_up), mask=tl.trans(mask))

    def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    def _grid(rows: int, width: int):
        return lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(width, meta["BLOCK_C"]))

    @torch.library.triton_op("meshtron::fp8_swiglu_grad_amax", mutates_args=())
    def swiglu_grad_amax(gate_up: torch.Tensor, grad_product: torch.Tensor, product_scale: torch.Tensor,
                         product_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = _check(gate_up, grad_product)
        if gate_up.device.type != "cuda":
            return _amax_torch(gate_up, grad_product, product_scale, product_dtype)
        gate_up, grad_product = _contiguous_rows(gate_up), _contiguous_rows(grad_product)
        product_t = torch.empty((width, rows), dtype=product_dtype, device=gate_up.device)
        # 0-dim, like the other operands' scales (the compiler's scaled-matmul templates want equal ranks).
        amax = torch.zeros((), dtype=torch.float32, device=gate_up.device)
        if product_t.numel():
            torch.library.wrap_triton(_swiglu_grad_amax_kernel)[_grid(rows, width)](
                gate_up, grad_product, product_scale, product_t, amax, rows, width, gate_up.stride(0),
                grad_product.stride(0), PRODUCT_MAX=torch.finfo(product_dtype).max)
        return product_t, amax

    @torch.library.triton_op("meshtron::fp8_swiglu_grad_cast", mutates_args=())
    def swiglu_grad_cast(gate_up: torch.Tensor, grad_product: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = _check(gate_up, grad_product)
        if gate_up.device.type != "cuda":
            return _cast_torch(gate_up, grad_product, scale, dtype)
        gate_up, grad_product = _contiguous_rows(gate_up), _contiguous_rows(grad_product)
        q = torch.empty((rows, 2 * width), dtype=dtype, device=gate_up.device)
        q_t = torch.empty((2 * width, rows), dtype=dtype, device=gate_up.device)
        if q.numel():
            torch.library.wrap_triton(_swiglu_grad_cast_kernel)[_grid(rows, width)](
                gate_up, grad_product, scale, q, q_t, rows, width, gate_up.stride(0), grad_product.stride(0),
                FMAX=torch.finfo(dtype).max)
        return q, q_t

swiglu_grad_amax.__doc__ = _AMAX_DOC
swiglu_grad_cast.__doc__ = _CAST_DOC


class _FP8SwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, grad_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = output_dtype(x.dtype)
        gate_up, xq_t, x_inv, w1_scale, w1_inv = forward_product(x2, w1, out_dtype)  # [N, 2f]
        product = swiglu_product(gate_up)
        p_scale, p_inv = tensor_scale(product, E4M3)
        w2q, w2_scale, w2_inv = cast_weight(w2)
        y = scaled_mm(scaled_cast(product, p_scale, E4M3), p_inv, w2q.t(), w2_inv, out_dtype, fast_accum=True)
        ctx.save_for_backward(xq_t, x_inv, w1, w1_scale, w1_inv, gate_up, p_scale, p_inv, w2, w2_scale, w2_inv)
        ctx.shape, ctx.grad_dtype = shape, grad_dtype
        return y.view(*shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq_t, x_inv, w1, w1_scale, w1_inv, gate_up, p_scale, p_inv, w2, w2_scale, w2_inv = ctx.saved_tensors
        out_dtype = output_dtype(gate_up.dtype)
        g = grad.reshape(-1, grad.shape[-1])
        gq, gq_t, g_inv = cast_both_layouts(g, ctx.grad_dtype)
        grad_product = scaled_mm(gq, g_inv, recast_weight(w2, w2_scale).t(), w2_inv, out_dtype)  # [N, f]
        product_t, amax = swiglu_grad_amax(gate_up, grad_product, p_scale, E4M3)
        grad_w2 = (scaled_mm(gq_t, g_inv, product_t.t(), p_inv, output_dtype(w2.dtype))
                   if ctx.needs_input_grad[2] else None)  # [M, N] @ [N, f]
        scale, inv = scale_from_amax(amax, ctx.grad_dtype)
        g1q, g1q_t = swiglu_grad_cast(gate_up, grad_product, scale, ctx.grad_dtype)
        grad_x = scaled_mm(g1q, inv, recast_weight(w1, w1_scale).t(), w1_inv, out_dtype).view(ctx.shape)
        grad_w1 = (scaled_mm(g1q_t, inv, xq_t.t(), x_inv, output_dtype(w1.dtype))
                   if ctx.needs_input_grad[1] else None)  # [2f, N] @ [N, K]
        return grad_x, grad_w1, grad_w2, None


def fp8_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(swiglu_product(F.linear(x, w1)), w2)`` with FP8 (tensorwise) operands: ``w1`` [2f, h] holds
    gate's rows then up's, ``w2`` is [h', f]; output gradients are cast to ``grad_dtype`` (see the module
    docstring)."""
    return _FP8SwiGLUMLP.apply(x, w1, w2, grad_dtype)
