"""Attention with learned sinks and an optional sliding window (gpt-oss).

Each query head ``h`` has a learned logit ``sink_h`` that joins the softmax's denominator but has no
value: ``out_i = sum_j exp(l_ij) v_j / (sum_j exp(l_ij) + exp(sink_h))``. With ``Z_i = sum_j exp(l_ij)``
and plain attention ``o_i = sum_j exp(l_ij) v_j / Z_i`` whose log-sum-exp is ``lse_i = log Z_i``,

    out_i = o_i * Z_i / (Z_i + exp(sink_h)) = o_i / (1 + exp(sink_h - lse_i)) = o_i * sigmoid(lse_i - sink_h),

so the sink costs one sigmoid per query and head on top of any attention kernel that returns the
log-sum-exp (gradients flow through ``lse`` too). A sliding window of ``W`` lets query ``i`` see keys
``i - W < j <= i``.

Paths (:func:`sink_attention`):

* CUDA: flex attention (compiled, :func:`meshtron.layers.documents.flex`) with a ``BlockMask`` built
  from a block table of O((S / 128)^2) entries (causal, window, and packed documents when a
  :class:`~meshtron.layers.documents.DocumentMask` is given), never an S x S mask; the sink folded
  through the returned log-sum-exp as above.
* CPU (flex attention has no CPU backward): SDPA on queries and keys widened by one dimension and one
  extra key per head whose score is exactly ``sink_h`` and whose value is zero, under a boolean mask
  (dense, as meshtron's other CPU attention paths).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.layers.documents import CPU_BLOCK, CUDA_BLOCK, DocumentMask, _ordered, _pad, flex
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.rotary import apply_rope
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import Piece, ShardSpec, new_param


# ---------------------------------------------------------------------------------------------- masks
def window_block_tables(seq: int, window: Optional[int], block: int, device: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) boolean block tables [nb, nb] of causal attention within a window of ``window``
    keys (None: no window) over tiles of ``block`` tokens."""
    nb = -(-seq // block)
    lo = torch.arange(nb, device=device) * block
    hi = (lo + block - 1).clamp(max=seq - 1)
    q_lo, q_hi, k_lo, k_hi = lo[:, None], hi[:, None], lo[None, :], hi[None, :]
    visible = k_lo <= q_hi  # some key at or before some query
    full = k_hi <= q_lo  # every key at or before every query
    if window is not None:
        visible = visible & (k_hi > q_lo - window)  # the union of the queries' windows reaches the tile
        full = full & (q_hi - k_lo < window)  # the farthest pair is inside the window
    if seq % block:  # a ragged last tile is never called full
        full[-1] = False
        full[:, -1] = False
    return visible & ~full, full


def sink_block_mask(seq: int, batch: int, window: Optional[int], device: torch.device,
                    documents: Optional[DocumentMask] = None):
    """flex attention's ``BlockMask``: causal, within ``window``, and within documents when given."""
    from torch.nn.attention.flex_attention import BlockMask

    if documents is not None:
        B = documents.block
    else:  # small tiles on the CPU, so that test-sized sequences have empty, full and partial tiles
        B = CUDA_BLOCK if device.type == "cuda" else CPU_BLOCK
    partial, full = (t[None] for t in window_block_tables(seq, window, B, device))
    if documents is not None:
        d_partial, d_full = documents.tables()
        visible = (partial | full) & (d_partial | d_full)
        full = full & d_full
        partial = visible & ~full
        docs = _pad(documents.q_docs, partial.shape[-1] * B)
    else:
        partial, full = partial.expand(batch, -1, -1), full.expand(batch, -1, -1)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if documents is not None:
            keep = keep & (docs[b, q_idx] == docs[b, kv_idx])
        return keep

    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(seq, seq))


def dense_sink_mask(seq: int, window: Optional[int], device: torch.device,
                    documents: Optional[DocumentMask] = None) -> torch.Tensor:
    """Boolean [b or 1, 1, seq, seq]: causal, within ``window``, within documents (the CPU path's mask)."""
    i = torch.arange(seq, device=device)
    keep = i[None, :] <= i[:, None]
    if window is not None:
        keep = keep & (i[:, None] - i[None, :] < window)
    keep = keep[None, None]
    return keep if documents is None else keep & documents.dense()


# ---------------------------------------------------------------------------------------------- attention
def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   window: Optional[int] = None, documents: Optional[DocumentMask] = None,
                   scale: Optional[float] = None, path: Optional[str] = None) -> torch.Tensor:
    """Causal attention of [b, heads, s, d] tensors (keys/values may have fewer heads: GQA) with one sink
    logit per query head (``sinks`` [heads]), optionally within a sliding window and packed documents.

    ``path``: ``flex`` or ``sdpa`` (None: flex on CUDA, sdpa elsewhere; see the module docstring).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    path = path or ("flex" if q.is_cuda else "sdpa")
    b, nq, s, _ = q.shape
    if path == "flex":
        block_mask = sink_block_mask(s, b, window, q.device, documents)
        out, lse = flex(q, k, v, block_mask, scale, return_lse=True)
        return out * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None].to(out.dtype)
    if path != "sdpa":
        raise ValueError(f"sink attention path must be flex or sdpa, got {path!r}")
    # One extra key per head: widened queries [q, 1], keys [k, 0], and the sink key [0, sink/scale] so
    # that its score (scale * q' . k') is exactly the sink; its value is zero.
    rep = nq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q = torch.cat([q, q.new_ones(b, nq, s, 1)], dim=-1)
    k = torch.cat([k, k.new_zeros(b, nq, s, 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(nq, q.shape[-1] - 1), (sinks / scale).to(k.dtype)[:, None]], dim=-1)
    k = torch.cat([k, sink_key[None, :, None].expand(b, nq, 1, -1)], dim=2)
    v = torch.cat([v, v.new_zeros(b, nq, 1, v.shape[-1])], dim=2)
    mask = dense_sink_mask(s, window, q.device, documents)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class SinkAttention(nn.Module):
    """gpt-oss's self-attention: GQA with biases on q, k, v and o, per-head sinks, optional sliding window.

    Called as ``attn(x, rope, mask)`` on ``x`` [s, b, hidden] with ``rope`` meshtron's (cos, sin) tables
    (:func:`meshtron.layers.rotary.rope_tables`, YaRN's scale folded in) and ``mask`` None (causal) or
    a one-device :class:`~meshtron.layers.documents.DocumentMask`. Canonical tensors: ``q``, ``k``,
    ``v``, ``o`` ``.weight``/``.bias`` (as :class:`~meshtron.layers.attention.SelfAttention`) and ``sinks``
    [heads]. Query and key/value heads are split over TP (key/value heads must divide by TP); the
    sinks follow their heads.
    """

    supports_context_parallel: ClassVar[bool] = False

    def __init__(self, ctx: ParallelContext, prefix: str, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, sliding_window: Optional[int] = None, bias: bool = True,
                 sequence_parallel: bool = False, init_std: float = 0.02, output_std: Optional[float] = None):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        if num_heads % num_kv_heads or num_kv_heads % tp:
            raise ValueError(f"sink attention: key/value heads ({num_kv_heads}) must divide the heads ({num_heads}) "
                             f"and divide by TP ({tp})")
        H, d = hidden_size, head_dim
        self.nq, self.ng, self.d, self.window = num_heads // tp, num_kv_heads // tp, d, sliding_window
        out_std = init_std if output_std is None else output_std

        def rows(name, heads, local, init="normal", width=d):
            shape = (heads * width, H) if init == "normal" else (heads * width,)
            return Piece(f"{prefix}.{name}", shape, 0, r * local * width, local * width, init, init_std)

        names = (("q", num_heads, self.nq), ("k", num_kv_heads, self.ng), ("v", num_kv_heads, self.ng))
        self.qkv = ColumnParallelLinear(ctx, [rows(f"{n}.weight", h, l) for n, h, l in names],
                                        [rows(f"{n}.bias", h, l, "zeros") for n, h, l in names] if bias else None,
                                        sequence_parallel)
        self.o = RowParallelLinear(
            ctx, Piece(f"{prefix}.o.weight", (H, num_heads * d), 1, r * self.nq * d, self.nq * d, "normal", out_std),
            Piece(f"{prefix}.o.bias", (H,), 0, 0, H, "zeros") if bias else None, sequence_parallel)
        self.sinks = new_param(ShardSpec((rows("sinks", num_heads, self.nq, "zeros", 1),), 0))

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[DocumentMask] = None, cache=None) -> torch.Tensor:
        if cache is not None or not (mask is None or isinstance(mask, DocumentMask)):
            raise NotImplementedError("sink attention: no KV cache, context parallelism or boolean masks")
        nq, ng, d = self.nq, self.ng, self.d
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([nq * d, ng * d, ng * d], dim=-1)
        q, k, v = q.view(s, b, nq, d), k.view(s, b, ng, d), v.reshape(s, b, ng, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        out = sink_attention(q, k, v, self.sinks, self.window, mask)
        return self.o(out.permute(2, 0, 1, 3).reshape(s, b, nq * d))


class NoDecodeState:
    """The decode state of a sink attention layer: none yet (generation refuses it in one line)."""

    def __init__(self) -> None:
        raise NotImplementedError("generation with sink/sink_window layers (--layer-pattern) is not implemented: "
                                  "sink attention has no key/value cache")
