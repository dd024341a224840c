"""Attention on one block of keys that also returns the log-sum-exp, with a matching backward.

Context-parallel attention computes a rank's queries against several blocks of keys
and merges the partial results exactly through their log-sum-exp. Each kernel here
computes one block: ``forward`` returns (out, lse, state) and ``backward`` takes the
*merged* output and log-sum-exp of the whole row (the flash-attention recipe: with
the final lse, ``exp(scores - lse)`` are the block's entries of the full softmax),
so the per-block gradients sum to the gradients of the full attention.

Shapes: q [b, heads, sq, d], k [b, groups, sk, d] and v [b, groups, sk, dv] (grouped-query
attention: query head h uses key/value head h // (heads / groups); dv may differ from d, as in
multi-latent attention); lse [b, heads, sq] in fp32.
``mask`` is None or a boolean [b, 1, sq, sk] (True: attend); ``causal`` is the
square top-left causal mask (only used on square diagonal blocks).

Kernels: :class:`MathKernel` (explicit fp32 matmuls and softmax; CPU and fallback),
:class:`CudnnKernel` and :class:`FlashKernel` (PyTorch's fused CUDA kernels through
their ATen operators, which return the log-sum-exp and take it back in backward), and
:class:`FlexKernel` (packed documents on CUDA: flex attention with the block's
``BlockMask``, no mask tensor). A document mask reaches a kernel as
:class:`~meshtron.layers.documents.DocumentMask` for flex and as a boolean tensor for the
others (:func:`kernel_mask`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from meshtron.layers.documents import DocumentMask, document_path, flex

_NEG_INF = float("-inf")


class BlockKernel(Protocol):
    """Attention on one block of keys with its log-sum-exp (see the module docstring)."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor],
                dropout_p: float, scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, mask: Optional[torch.Tensor], dropout_p: float, scale: float,
                 state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ...


def _causal(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    if sq != sk:
        raise ValueError(f"a causal block must be square, got {sq} queries x {sk} keys")
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _allowed(causal: bool, mask: Optional[torch.Tensor], sq: int, sk: int, device) -> Optional[torch.Tensor]:
    """Boolean [b or 1, 1, sq, sk] of visible pairs, or None when every pair is visible."""
    if not causal:
        return mask
    tri = _causal(sq, sk, device)[None, None]
    return tri if mask is None else mask & tri


class MathKernel:
    """Explicit attention in fp32: scores, masked softmax with its log-sum-exp, weighted values.

    Attention dropout draws a seed per block in forward (from the current device's
    generator, so it follows the tensor-parallel RNG tracker) and regenerates the same
    mask in backward.
    """

    name = "math"

    @staticmethod
    def _scores(q, k, causal, mask, scale):
        b, hq, sq, d = q.shape
        g, sk = k.shape[1], k.shape[2]
        qf = q.float().reshape(b, g, hq // g, sq, d)
        s = torch.einsum("bgrqd,bgkd->bgrqk", qf, k.float()) * scale
        allowed = _allowed(causal, mask, sq, sk, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed[:, :, None], _NEG_INF)  # [b|1, 1, 1, sq, sk] over (groups, rep)
        return qf, s

    @staticmethod
    def _keep(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed)
        return (torch.rand(shape, generator=gen, device=device) >= dropout_p).float() / (1.0 - dropout_p)

    def forward(self, q, k, v, causal, mask, dropout_p, scale):
        b, hq, sq, _ = q.shape
        _, s = self._scores(q, k, causal, mask, scale)
        lse = torch.logsumexp(s, dim=-1)
        safe = lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no visible key: p = 0, out = 0
        p = torch.exp(s - safe.unsqueeze(-1))
        seed = None
        if dropout_p > 0:
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item())
            p = p * self._keep(p.shape, dropout_p, seed, q.device)
        out = torch.einsum("bgrqk,bgkd->bgrqd", p, v.float())
        return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq), seed

    def backward(self, dout, q, k, v, out, lse, causal, mask, dropout_p, scale, state):
        b, hq, sq, d = q.shape
        g = k.shape[1]
        qf, s = self._scores(q, k, causal, mask, scale)
        p = torch.exp(s - lse.float().reshape(b, g, hq // g, sq, 1))
        dv_dim = v.shape[-1]
        do = dout.float().reshape(b, g, hq // g, sq, dv_dim)
        o = out.float().reshape(b, g, hq // g, sq, dv_dim)
        dp = torch.einsum("bgrqd,bgkd->bgrqk", do, v.float())
        if dropout_p > 0:
            keep = self._keep(p.shape, dropout_p, state, q.device)
            dv = torch.einsum("bgrqk,bgrqd->bgkd", p * keep, do)
            dp = dp * keep
        else:
            dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do)
        # d(softmax): rowsum(dO * O) over the whole row, from the merged output.
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k.float()) * scale
        dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, qf) * scale
        return dq.reshape(b, hq, sq, d), dk, dv


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] with [b, s, h, d] memory (the fused kernels' native layout; free for micro-batch 1)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _bias(causal: bool, mask: Optional[torch.Tensor], heads: int, sq: int, sk: int, dtype, device):
    """Additive bias (0 or -inf) [b, heads, sq, sk] for a boolean mask; causal folded in."""
    allowed = _allowed(causal, mask, sq, sk, device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, _NEG_INF)
    return bias.expand(bias.shape[0], heads, sq, sk)


class CudnnKernel:
    """cuDNN fused attention (``aten::_scaled_dot_product_cudnn_attention`` and its backward).

    Grouped-query attention is native. A document mask goes in as an additive bias (a
    row with no visible key gets lse = -inf and a zero output).
    """

    name = "cudnn"

    def forward(self, q, k, v, causal, mask, dropout_p, scale):
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        bias = None if mask is None else _bias(causal, mask, hq, sq, sk, q.dtype, q.device)
        is_causal = causal and mask is None
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bshd(q), _bshd(k), _bshd(v), bias, True, dropout_p, is_causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = r[:8]
        return out, lse.reshape(b, hq, sq), (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, mask, dropout_p, scale, state):
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        cum_q, cum_k, max_q, max_k, seed, offset = state
        bias = None if mask is None else _bias(causal, mask, hq, sq, sk, q.dtype, q.device)
        is_causal = causal and mask is None
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bshd(dout.to(q.dtype)), _bshd(q), _bshd(k), _bshd(v), _bshd(out.to(q.dtype)),
            lse.float().reshape(b, hq, sq, 1).contiguous(), seed, offset, bias, cum_q, cum_k, max_q, max_k,
            dropout_p, is_causal, scale=scale)
        return dq, dk, dv


class FlashKernel:
    """FlashAttention-2 (``aten::_scaled_dot_product_flash_attention`` and its backward); no masks."""

    name = "flash"

    def forward(self, q, k, v, causal, mask, dropout_p, scale):
        if mask is not None:
            raise ValueError("the flash kernel takes no attention mask; use the cudnn or math kernel")
        if causal:
            _causal(q.shape[2], k.shape[2], q.device)  # flash aligns the causal mask bottom-right: square only
        r = torch.ops.aten._scaled_dot_product_flash_attention(_bshd(q), _bshd(k), _bshd(v), dropout_p, causal,
                                                               False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused = r[:8]
        return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, causal, mask, dropout_p, scale, state):
        cum_q, cum_k, max_q, max_k, rng_state, unused = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bshd(dout.to(q.dtype)), _bshd(q), _bshd(k), _bshd(v), _bshd(out.to(q.dtype)),
            lse.float().contiguous(), cum_q, cum_k, max_q, max_k, dropout_p, causal, rng_state, unused, scale=scale)
        return dq, dk, dv


class FlexKernel:
    """flex attention with the block's ``BlockMask`` (packed documents; compiled on CUDA).

    ``mask`` is the block's :class:`~meshtron.layers.documents.DocumentMask` (its pair rule already
    holds causality, by sequence position). flex attention's backward is reachable only through
    autograd of its own forward, with that block's own output and log-sum-exp, not the merged ones
    of the row: backward therefore runs the block's forward again and feeds autograd the gradients
    that make the two agree. With ``w = exp(lse_b - lse)`` (the block's share of the row), the
    gradients of the full softmax are those of the block's outputs for ``dout_b = w dout`` and
    ``dlse_b = w (rowsum(dout o_b) - rowsum(dout o))``. Cost: one more forward of each block in
    backward; memory: one block's, as for the other kernels. No attention dropout.
    """

    name = "flex"

    def forward(self, q, k, v, causal, mask, dropout_p, scale):
        if dropout_p > 0:
            raise ValueError("flex attention has no attention dropout; use the cudnn or math kernel")
        out, lse = flex(q, k, v, mask.block_mask(), scale, return_lse=True)
        return out, lse.float(), None

    def backward(self, dout, q, k, v, out, lse, causal, mask, dropout_p, scale, state):
        with torch.enable_grad():
            qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
            o_b, lse_b = flex(qb, kb, vb, mask.block_mask(), scale, return_lse=True)
            row = lse.float().masked_fill(torch.isinf(lse), 0.0)  # rows with no visible key anywhere: w = 0
            w = torch.where(torch.isinf(lse_b), 0.0, torch.exp(lse_b.float() - row))
            do = dout.float()
            c = (do * o_b.detach().float()).sum(-1) - (do * out.float()).sum(-1)
            grads = torch.autograd.grad((o_b, lse_b), (qb, kb, vb),
                                        ((do * w.unsqueeze(-1)).to(o_b.dtype), (w * c).to(lse_b.dtype)))
        return grads


def kernel_mask(kernel: BlockKernel, mask: Optional[DocumentMask]):
    """What ``kernel`` takes for a block's document mask: the mask itself (flex) or a boolean
    [b, 1, sq, sk] (the block table's on the ``blocks`` path, the reference's on ``dense``)."""
    if mask is None or kernel is FLEX:
        return mask
    return mask.dense() if mask.path == "dense" else mask.allowed()


MATH, CUDNN, FLASH, FLEX = MathKernel(), CudnnKernel(), FlashKernel(), FlexKernel()

# On H200 (bf16, causal, GQA 32/8 heads, head dim 128, 8K tokens, forward + backward) cuDNN ran at
# 532 TFLOP/s and flash at 295, so cuDNN comes first; flash serves when cuDNN attention is disabled.
_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def select_kernel(q: torch.Tensor, has_mask: bool, v_head_dim: Optional[int] = None,
                  dropout_p: float = 0.0) -> BlockKernel:
    """The fastest kernel usable for these queries: flex for document masks on CUDA (without attention
    dropout, unless ``MESHTRON_DOCUMENT_ATTENTION=dense``), else cuDNN, then flash (no mask), then the
    fp32 math one.

    The fused kernels follow ``torch.backends.cuda.enable_cudnn_sdp`` / ``enable_flash_sdp``. Flash
    needs the value head dim equal to the query's; cuDNN is taken when both are at most 128.
    """
    if q.device.type != "cuda":
        return MATH
    if has_mask and dropout_p == 0 and document_path() == "blocks":
        return FLEX
    if q.dtype not in _FUSED_DTYPES:
        return MATH
    head_dim = q.shape[-1]
    dv = head_dim if v_head_dim is None else v_head_dim
    if torch.backends.cuda.cudnn_sdp_enabled() and all(d % 8 == 0 and d <= 128 for d in (head_dim, dv)):
        return CUDNN
    if (torch.backends.cuda.flash_sdp_enabled() and not has_mask and dv == head_dim and head_dim % 8 == 0
            and head_dim <= 256):
        return FLASH
    return MATH
