"""Attention over packed documents without a dense S x S mask.

With ``--reset-attention-mask`` a token sees the earlier tokens of its own document only. The
micro-batch's document ids become one :class:`DocumentMask`, built once per model forward and used
by every layer (and, under context parallelism, one per ring block). It describes the visible
pairs by token: query ``i`` sees key ``j`` when ``docs_q[i] == docs_k[j]`` and ``pos_k[j] <= pos_q[i]``
(sequence positions: ``arange`` on one device, the global indices of the load-balanced chunks
under CP), and by blocks of ``block_size`` x ``block_size`` tokens: every block is *empty*
(skipped), *full* (every pair visible: no mask is evaluated) or *partial* (the pair rule is
evaluated per score). The block table comes from each block's min/max document id and
position, O((S / block)^2) integers, with no S x S tensor; it is exact for any document ids
(an interval test can only call a block partial where it is empty, and partial blocks evaluate
the rule per pair).

A mask may also hold a sliding window (``window``: a query sees only the latest ``window`` positions, its own
included), with or without documents; context-parallel attention with sinks builds its windowed blocks so.

Paths (``MESHTRON_DOCUMENT_ATTENTION``, an internal switch read once per mask):

* ``blocks`` (default): on CUDA, ``torch.nn.attention.flex_attention`` with the block table as a
  ``BlockMask``, compiled with ``torch.compile`` (flex attention generates one fused kernel;
  grouped-query attention through ``enable_gqa``, value head dims other than the query's as in
  multi-latent attention). Memory is O(S) beside the O((S / 128)^2) table, and the work is that of
  the visible blocks. On the CPU, torch (2.11-2.13) refuses flex attention's backward
  ("FlexAttention does not support backward on CPU"), so the same block table is expanded to a
  boolean mask (full blocks, and partial blocks by the pair rule) for SDPA; the result equals the
  dense path exactly when the table is right, which is what the CPU tests check, and the flex
  kernel itself is checked against the dense path on the CPU by the tests with torch's device
  check lifted (its eager implementation is math, like the dense path).
* ``dense``: the reference, a boolean [b, 1, S, S] mask for SDPA (which then runs its math or
  memory-efficient kernel, not flash or cuDNN).

Attention dropout has no flex implementation: with ``--attention-dropout`` > 0 documents take the
dense path.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from meshtron.emulation.trace import outside_recorder

PATH_ENV = "MESHTRON_DOCUMENT_ATTENTION"
PATHS = ("blocks", "dense")
CUDA_BLOCK = 128  # flex attention's default tile (BlockMask's BLOCK_SIZE)
CPU_BLOCK = 16  # small tiles on the CPU, so that test-sized sequences have empty, full and partial blocks


def document_path() -> str:
    path = os.environ.get(PATH_ENV, "blocks")
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Pad the last dim to ``length`` by repeating its last entry (keeps block min/max unchanged)."""
    extra = length - t.shape[-1]
    if extra == 0:
        return t
    return torch.cat([t, t[..., -1:].expand(*t.shape[:-1], extra)], dim=-1)


def _block_range(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each block of ``block`` entries along the last dim (padded already)."""
    v = t.unflatten(-1, (-1, block))
    return v.amin(-1), v.amax(-1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks [b, 1, nq], indices [b, 1, nq, nk]) of a boolean block table [b, nq, nk]."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


class DocumentMask:
    """Which keys each query sees, by document; see the module docstring.

    ``q_docs`` [b, sq] and ``k_docs`` [b, sk] are document ids (any integers); ``q_pos`` [sq] and
    ``k_pos`` [sk] the sequence positions of the queries and keys (None: ``arange``, the keys
    being the queries). ``window``: a query also sees only the ``window`` latest positions, its own
    included (``pos_q - pos_k < window``; sliding-window attention, one document of zeros where there
    are no documents).
    """

    def __init__(self, q_docs: torch.Tensor, k_docs: Optional[torch.Tensor] = None,
                 q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                 block_size: Optional[int] = None, path: Optional[str] = None, window: Optional[int] = None):
        self.q_docs = q_docs
        self.window = window
        self.k_docs = q_docs if k_docs is None else k_docs
        self.q_pos, self.k_pos = q_pos, k_pos
        self.device = q_docs.device
        self.block = block_size or (CUDA_BLOCK if self.device.type == "cuda" else CPU_BLOCK)
        self.path = path or document_path()
        self._block_mask = None
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def causal(cls, document_ids: torch.Tensor, **kw) -> "DocumentMask":
        """One device: every token against the whole (local) sequence, causal by index."""
        return cls(document_ids, **kw)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q_docs.shape[0], self.q_docs.shape[1], self.k_docs.shape[1]

    # ------------------------------------------------------------------ the pair rule
    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        _, sq, sk = self.shape
        qp = self.q_pos if self.q_pos is not None else torch.arange(sq, device=self.device)
        kp = self.k_pos if self.k_pos is not None else torch.arange(sk, device=self.device)
        return qp, kp

    def dense(self) -> torch.Tensor:
        """The reference: boolean [b, 1, sq, sk] (True: attend)."""
        qp, kp = self._positions()
        same = self.q_docs[:, :, None] == self.k_docs[:, None, :]
        keep = kp[None, :] <= qp[:, None]
        if self.window is not None:
            keep = keep & (qp[:, None] - kp[None, :] < self.window)
        return (same & keep[None])[:, None]

    # ------------------------------------------------------------------ the block table
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) boolean block tables [b, nq, nk]; no S x S tensor."""
        if self._tables is None:
            b, sq, sk = self.shape
            B = self.block
            nq, nk = -(-sq // B), -(-sk // B)
            qp, kp = self._positions()
            qd_lo, qd_hi = _block_range(_pad(self.q_docs, nq * B), B)
            kd_lo, kd_hi = _block_range(_pad(self.k_docs, nk * B), B)
            qp_lo, qp_hi = _block_range(_pad(qp, nq * B), B)
            kp_lo, kp_hi = _block_range(_pad(kp, nk * B), B)
            qd_lo, qd_hi = qd_lo[:, :, None], qd_hi[:, :, None]
            kd_lo, kd_hi = kd_lo[:, None, :], kd_hi[:, None, :]
            any_pair = (qd_lo <= kd_hi) & (kd_lo <= qd_hi) & (kp_lo[None, None, :] <= qp_hi[None, :, None])
            one_doc = (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
            whole = torch.ones(nq, nk, dtype=torch.bool, device=self.device)
            if sq % B:
                whole[-1] = False  # a ragged last tile is never called full
            if sk % B:
                whole[:, -1] = False
            full = one_doc & (kp_hi[None, None, :] <= qp_lo[None, :, None]) & whole[None]
            if self.window is not None:  # some pair inside the window; every pair inside it
                any_pair = any_pair & (qp_lo[None, :, None] - kp_hi[None, None, :] < self.window)
                full = full & (qp_hi[None, :, None] - kp_lo[None, None, :] < self.window)
            self._tables = (any_pair & ~full, full)
        return self._tables

    def allowed(self) -> torch.Tensor:
        """The pairs the block table lets through: boolean [b, 1, sq, sk] (the CPU's path).

        Full blocks entirely, partial blocks by the pair rule, empty blocks not at all: what the
        fused kernel computes. Equals :meth:`dense` when the table is right.
        """
        partial, full = self.tables()
        _, sq, sk = self.shape
        B = self.block

        def expand(t):
            return t.repeat_interleave(B, 1)[:, :sq].repeat_interleave(B, 2)[:, :, :sk][:, None]

        return expand(full) | (expand(partial) & self.dense())

    def block_mask(self):
        """flex attention's ``BlockMask`` (built once, reused by every layer)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            partial, full = self.tables()
            b, sq, sk = self.shape
            B = self.block
            nq, nk = partial.shape[1:]
            # The rule reads per-token tensors at padded indices: pad them to whole tiles.
            qd, kd = _pad(self.q_docs, nq * B), _pad(self.k_docs, nk * B)
            window = self.window
            if self.q_pos is None and self.k_pos is None:
                def mask_mod(b_, h, q_idx, kv_idx):
                    keep = (q_idx >= kv_idx) & (qd[b_, q_idx] == kd[b_, kv_idx])
                    return keep if window is None else keep & (q_idx - kv_idx < window)
            else:
                qp, kp = self._positions()
                qp, kp = _pad(qp, nq * B), _pad(kp, nk * B)

                def mask_mod(b_, h, q_idx, kv_idx):
                    keep = (kp[kv_idx] <= qp[q_idx]) & (qd[b_, q_idx] == kd[b_, kv_idx])
                    return keep if window is None else keep & (qp[q_idx] - kp[kv_idx] < window)
            kv_num, kv_idx = _ordered(partial)
            full_num, full_idx = _ordered(full)
            self._block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B,
                                                        mask_mod=mask_mod, seq_lengths=(sq, sk))
        return self._block_mask


_compiled_flex = None


#: The smallest query/key and value head dim of flex attention's compiled kernel (Inductor's lowering refuses less).
FLEX_MIN_HEAD_DIM = 16


def flex_kernel_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flex attention's compiled kernel takes these head dims (else: the SDPA paths, as on the CPU)."""
    return min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_DIM


def flex(q, k, v, block_mask, scale: Optional[float], return_lse: bool = False):
    """flex attention, compiled on CUDA (a fused kernel; head dims of 16 or more) and eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    # The compiled kernel needs head dims of 16 or more; below that (tiny test models) the eager reference runs.
    if q.is_cuda and flex_kernel_fits(q, v):
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    gqa = k.shape[1] != q.shape[1]
    # flex attention holds no collective, and neither its compiled kernel nor its eager path (which compiles too)
    # runs under a collective recorder's dispatch mode (--record-collectives, meshtron emulate)
    with outside_recorder():
        if not return_lse:
            return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        try:  # torch >= 2.9: return_aux (return_lse is deprecated)
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:
            return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
        out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                      return_aux=AuxRequest(lse=True))
    return out, aux.lse


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask, dropout_p: float,
                       scale: Optional[float], sdpa) -> torch.Tensor:
    """Attention of [b, heads, s, d] tensors over packed documents (``sdpa(q, k, v, mask, p, gqa, scale)``
    serves the dense and CPU paths)."""
    gqa = k.shape[1] != q.shape[1]
    if mask.path == "dense" or dropout_p > 0:
        return sdpa(q, k, v, mask.dense(), dropout_p, gqa, scale)
    if q.is_cuda and flex_kernel_fits(q, v):
        return flex(q, k, v, mask.block_mask(), scale)
    return sdpa(q, k, v, mask.allowed(), dropout_p, gqa, scale)
