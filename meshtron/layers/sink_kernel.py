"""The sink attention kernel call, below both the sink attention layer and context-parallel attention (which
calls it after its all-to-all exchange of heads); the math is in :mod:`meshtron.layers.sink_attention`.

Paths (:func:`sink_attention`):

* CUDA: flex attention (compiled, :func:`meshtron.layers.documents.flex`) with a ``BlockMask`` built
  from a block table of O((S / 128)^2) entries (causal, window, and packed documents when a
  :class:`~meshtron.layers.documents.DocumentMask` is given), never an S x S mask; the sink folded
  through the returned log-sum-exp.
* CPU (flex attention has no CPU backward): SDPA on queries and keys widened by one dimension and one
  extra key per head whose score is exactly ``sink_h`` and whose value is zero, under a boolean mask
  (dense, as meshtron's other CPU attention paths).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from meshtron.layers.documents import CPU_BLOCK, CUDA_BLOCK, DocumentMask, _ordered, _pad, flex, flex_kernel_fits


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
                    documents: Optional[DocumentMask] = None, past: int = 0) -> torch.Tensor:
    """Boolean [b or 1, 1, seq, past + seq]: causal, within ``window``, within documents (the CPU path's
    mask). ``past``: keys before the first query (decoding with a key/value cache), query ``i`` being at
    position ``past + i``."""
    i = past + torch.arange(seq, device=device)
    j = torch.arange(past + seq, device=device)
    keep = j[None, :] <= i[:, None]
    if window is not None:
        keep = keep & (i[:, None] - j[None, :] < window)
    keep = keep[None, None]
    return keep if documents is None else keep & documents.dense()


# ---------------------------------------------------------------------------------------------- attention
def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   window: Optional[int] = None, documents: Optional[DocumentMask] = None,
                   scale: Optional[float] = None, path: Optional[str] = None) -> torch.Tensor:
    """Causal attention of [b, heads, s, d] tensors (keys/values may have fewer heads: GQA) with one sink
    logit per query head (``sinks`` [heads]), optionally within a sliding window and packed documents.

    Keys and values may be longer than the queries (decoding with a key/value cache): the queries are then
    the last positions of the keys' sequence, and the ``sdpa`` path runs (no documents there).

    ``path``: ``flex`` or ``sdpa`` (None: flex on CUDA, sdpa elsewhere; see the module docstring).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, nq, s, _ = q.shape
    past = k.shape[2] - s  # cached keys before the first query
    if past and documents is not None:
        raise ValueError("sink attention: packed documents with cached keys")
    # flex's block mask is square; a decoding step is one query row, cheap on SDPA
    path = path or ("flex" if q.is_cuda and not past and flex_kernel_fits(q, v) else "sdpa")
    if path == "flex" and past:
        raise ValueError("sink attention: the flex path needs as many keys as queries")
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
    k = torch.cat([k, k.new_zeros(b, nq, past + s, 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(nq, q.shape[-1] - 1), (sinks / scale).to(k.dtype)[:, None]], dim=-1)
    k = torch.cat([k, sink_key[None, :, None].expand(b, nq, 1, -1)], dim=2)
    v = torch.cat([v, v.new_zeros(b, nq, 1, v.shape[-1])], dim=2)
    mask = dense_sink_mask(s, window, q.device, documents, past)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
