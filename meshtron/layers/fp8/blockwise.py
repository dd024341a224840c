"""FP8 with fine-grained (blockwise) current scaling, ``--fp8-recipe blockwise``: DeepSeek-V3's recipe.

Scales. Activations and output gradients are quantised in 1 x 128 tiles (one fp32 scale per row for every
128 consecutive elements along the contraction dimension), weights in 128 x 128 blocks. Each scale maps
its tile's absolute maximum onto e4m3's largest value (scale = 448 / amax; the matmul multiplies back
amax / 448). An outlier then costs precision only inside its own tile, not across a row (rowwise) or the
whole tensor (tensorwise). All operands are e4m3, gradients too, as in DeepSeek-V3: the per-tile scales
give gradients the dynamic range that e5m2 would buy with a coarse scale, and Hopper's blockwise scaled
matmul takes e4m3 operands only; hence ``--fp8-format e4m3`` (``hybrid`` is refused, as for rowwise).

Which operand is quantised along which axis, for ``y = x W^T`` with ``x`` [N tokens, K] and ``W`` [M, K]:

- forward ``y [N, M] = x [N, K] @ W^T``, contracts K: ``x`` in 1 x 128 tiles along K (per token),
  ``W`` in 128 x 128 blocks;
- input gradient ``dx [N, K] = g [N, M] @ W``, contracts M: ``g`` in 1 x 128 tiles along M (per token),
  ``W`` in the same 128 x 128 blocks (a block is a 128-tile along both of its axes, so the forward's
  quantised weight serves transposed, with the same values);
- weight gradient ``dW [M, K] = g^T [M, N] @ x [N, K]``, contracts N, the tokens: ``g`` and ``x`` are both
  quantised again along the tokens (1 x 128 tiles of ``g^T`` and ``x^T``: one scale per feature for every
  128 tokens), since their forward tiles run along the other axis.

So backward quantises the output gradient twice and the input once more; it keeps the input in bf16 (as
the rowwise recipe does) and quantises the weight again (the same values as the forward's; the weight
does not change in between). A tile or block at the end of a dimension that is not a multiple of 128 is
shorter and takes the scale of its own elements, so no dimension needs to be a multiple of 128.

Two paths compute the same products. On Hopper GPUs the scaled matmul of torch >= 2.10
(``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` scales; cuBLASLt
>= 12.9), over operands zero-padded to multiples of 128 where needed (zeros change no tile's maximum
and add nothing to a sum). Elsewhere (CPU) an emulation: the same e4m3 values (real casts), dequantised and
multiplied in fp32; it equals the GPU kernel up to the order of accumulation, and is what the CPU tests run.
No product asks for the tensor cores' fast accumulation: the kernel applies the scales to each 128-wide
partial sum along K and accumulates those in fp32 (DeepSeek-V3's promotion to fp32 every 128 elements).
``tests/training/test_fp8_blockwise_gpu.py`` checks the installed torch and GPU against the emulation.

With the rest of the framework:

- Tensor parallelism with sequence parallelism: the column-parallel layer all-gathers its bf16 input and
  quantises after the gather (the plain path, as rowwise does; the cast-before-gather path of
  :mod:`meshtron.layers.fp8.sequence_parallel` is tensorwise only). The forward's tiles are per token, so
  casting before the gather would give the same values, but the weight gradient's tiles run along the
  tokens across the ranks' shards: quantised after the gather, every tile is the one-process tile. A
  tensor-parallel shard of a weight (or of a row-parallel input's features) whose size is a multiple of
  128 has exactly the one-process blocks; otherwise a rank's last block is shorter (still correct, with
  slightly different scales).
- ZeRO-3 / FSDP-style weight gathering: the weight arrives gathered in its own dtype and is quantised in
  each forward and again in backward (no FP8 weight copy is cached across micro-batches, as with tensorwise).
- Recomputation and checkpoints: the function saves bf16 tensors only and keeps no state; master weights,
  gradients and optimizer state stay in their own precision, so nothing FP8 reaches a checkpoint.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from meshtron.layers.fp8.cast import scaled_cast
from meshtron.layers.fp8.operands import output_dtype, weight_grad_now_or_deferred

E4M3 = torch.float8_e4m3fn
TILE = 128
_EPS = 1e-12


def _pad_to_tiles(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` zero-padded at the end of each of ``dims`` to a multiple of TILE (``x`` itself if none needs it)."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = -x.shape[d] % TILE  # F.pad lists the last dimension first
    return F.pad(x, pad) if any(pad) else x


def _scale_of(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) that map ``amax`` onto e4m3's largest value."""
    scale = torch.finfo(E4M3).max / amax.float().clamp(min=_EPS)
    return scale, scale.reciprocal()


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [R, C] as e4m3, 1/scale [R, ceil(C / 128)]): one scale per row for each 128 columns."""
    rows, cols = x.shape
    padded = _pad_to_tiles(x, (1,))
    tiles = padded.view(rows, padded.shape[1] // TILE, TILE)  # splitting one dimension: a view at any strides
    scale, inv = _scale_of(tiles.detach().abs().amax(dim=-1, keepdim=True))
    q = scaled_cast(tiles, scale, E4M3).view(padded.shape)[:, :cols]
    return q, inv.squeeze(-1)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``w`` [R, C] as e4m3, 1/scale [ceil(R / 128), ceil(C / 128)]): one scale per 128 x 128 block."""
    rows, cols = w.shape
    padded = _pad_to_tiles(w, (0, 1))
    blocks = padded.view(padded.shape[0] // TILE, TILE, padded.shape[1] // TILE, TILE)
    scale, inv = _scale_of(blocks.detach().abs().amax(dim=(1, 3), keepdim=True))
    q = scaled_cast(blocks, scale, E4M3).view(padded.shape)[:rows, :cols]
    return q, inv[:, 0, :, 0]


def _expand(inv: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    """The inverse scales broadcast to one per element of a [rows, cols] matrix (``block_rows``: 1 for tiles,
    128 for blocks)."""
    return inv.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(TILE, 1)[:, :cols]


def dequantize(q: torch.Tensor, inv: torch.Tensor, blocks: bool) -> torch.Tensor:
    """The fp32 values that ``q`` with inverse scales ``inv`` stands for (``blocks``: 128 x 128, else 1 x 128)."""
    rows, cols = q.shape
    return q.float() * _expand(inv, rows, cols, TILE if blocks else 1)


def blockwise_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, b_blocks: bool,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``a [P, K] @ b [Q, K]^T`` from e4m3 operands quantised along K: ``a`` in 1 x 128 tiles, ``b`` in 128 x 128
    blocks (``b_blocks``, a weight) or 1 x 128 tiles. Accumulates in fp32, returns ``out_dtype``."""
    return torch.ops.meshtron.fp8_blockwise_mm(a, a_inv, b, b_inv, b_blocks, out_dtype)


# One operator, so that torch.compile traces the blockwise linear whole: dynamo cannot trace the scaled matmul
# with block scales (torch 2.11: ``_scaled_mm_v2`` is skipped, which broke a fullgraph compile on the GPU).
@torch.library.custom_op("meshtron::fp8_blockwise_mm", mutates_args=())
def _blockwise_mm_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, b_blocks: bool,
                     out_dtype: torch.dtype) -> torch.Tensor:
    if a.is_cuda:
        return _cuda_mm(a, a_inv, b, b_inv, b_blocks, out_dtype)
    return (dequantize(a, a_inv, False) @ dequantize(b, b_inv, b_blocks).t()).to(out_dtype)


@_blockwise_mm_op.register_fake
def _(a, a_inv, b, b_inv, b_blocks, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def gpu_support_error() -> Optional[str]:
    """Why this machine cannot run the blockwise scaled matmul on its GPU, or None where it can (or where it has no
    GPU to ask: a configuration checked away from the GPUs it will run on)."""
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise1x128"):
        return (f"--fp8-recipe blockwise on GPU needs torch.nn.functional.scaled_mm with blockwise scales (torch "
                f"2.10 or later); this is torch {torch.__version__}")
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"--fp8-recipe blockwise on GPU needs a Hopper GPU (compute capability 9.x, cuBLASLt's "
                f"1x128 / 128x128 scaling); this one is {major}.{minor}")
    return None


def _bytes_padded(q: torch.Tensor) -> torch.Tensor:
    """``q`` (e4m3) zero-padded to multiples of 128 in both dimensions (through bytes: 0x00 is +0.0)."""
    return _pad_to_tiles(q.view(torch.uint8), (0, 1)).view(E4M3)


def _cuda_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, b_blocks: bool,
             out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`blockwise_mm` through cuBLASLt's blockwise scaled matmul (Hopper). Operand and scale layouts are the
    kernel's: ``a`` row-major, ``b`` column-major ([K, Q] as the transpose of a row-major [Q, K]); the 1 x 128 scales
    of an operand [R, K] as [R, K/128] with strides (1, R); the block scales of ``b`` as [L4, Q/128] with strides
    (1, L4), where L4 is K/128 rounded up to a multiple of 4 (the scale rows padded)."""
    p, q = a.shape[0], b.shape[0]
    a, b = _bytes_padded(a.contiguous()), _bytes_padded(b.contiguous())
    pp, kk, qq = a.shape[0], a.shape[1], b.shape[0]
    # Padded tiles hold zeros, so their scales are arbitrary: 1.
    sa = a_inv.new_ones(pp, kk // TILE)
    sa[:a_inv.shape[0], :a_inv.shape[1]] = a_inv
    sa = sa.t().contiguous().t()  # [P, K/128] column-major: strides (1, P)
    kinds = F.ScalingType
    if b_blocks:
        l4 = math.ceil(kk // TILE / 4) * 4
        sb = b_inv.new_ones(qq // TILE, l4)
        sb[:b_inv.shape[0], :b_inv.shape[1]] = b_inv
        sb, kind_b = sb.t(), kinds.BlockWise128x128  # [L4, Q/128] with strides (1, L4)
    else:
        sb = b_inv.new_ones(qq, kk // TILE)
        sb[:b_inv.shape[0], :b_inv.shape[1]] = b_inv
        sb, kind_b = sb.t().contiguous().t(), kinds.BlockWise1x128
    out = F.scaled_mm(a, b.t(), sa, kinds.BlockWise1x128, sb, kind_b, output_dtype=out_dtype)
    # Contiguous, as the operator's fake kernel says (a copy only where Q is no multiple of 128).
    return out[:p, :q] if q == qq else out[:p, :q].contiguous()


class _FP8LinearBlockwise(torch.autograd.Function):
    """``x W^T + b`` with the three matmuls in blockwise-scaled e4m3 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferral=None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = output_dtype(x.dtype)
        xq, x_inv = quantize_tiles(x2)                # per token, along K
        wq, w_inv = quantize_blocks(weight)
        y = blockwise_mm(xq, x_inv, wq, w_inv, True, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x2, weight)
        ctx.shape, ctx.has_bias, ctx.deferral = shape, bias is not None, deferral
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, g_inv = quantize_tiles(g2)                # per token, along M
        wq, w_inv = quantize_blocks(weight)           # the forward's values; its blocks serve transposed
        grad_x = blockwise_mm(gq, g_inv, wq.t(), w_inv.t(), True, output_dtype(x2.dtype)).view(ctx.shape)
        grad_w = weight_grad_now_or_deferred(ctx.deferral, lambda: blockwise_weight_grad(g2, x2, weight.dtype))
        grad_b = g2.float().sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def blockwise_weight_grad(g2: torch.Tensor, x2: torch.Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """dW [M, K] = g^T [M, N] @ x [N, K], both operands tiled along the tokens N (their contraction)."""
    gtq, gt_inv = quantize_tiles(g2.t())
    xtq, xt_inv = quantize_tiles(x2.t())
    return blockwise_mm(gtq, gt_inv, xtq, xt_inv, False, output_dtype(x2.dtype)).to(w_dtype)


def fp8_linear_blockwise(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         deferral: Optional[tuple] = None) -> torch.Tensor:
    """``F.linear`` with blockwise-scaled e4m3 operands (``deferral``: as in :func:`meshtron.layers.fp8.fp8_linear`;
    the weight then enters detached)."""
    if deferral is not None:
        weight = weight.detach()
    return _FP8LinearBlockwise.apply(x, weight, bias, deferral)
