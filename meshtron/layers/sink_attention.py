"""Attention with learned sinks and an optional sliding window (gpt-oss).

Each query head ``h`` has a learned logit ``sink_h`` that joins the softmax's denominator but has no
value: ``out_i = sum_j exp(l_ij) v_j / (sum_j exp(l_ij) + exp(sink_h))``. With ``Z_i = sum_j exp(l_ij)``
and plain attention ``o_i = sum_j exp(l_ij) v_j / Z_i`` whose log-sum-exp is ``lse_i = log Z_i``,

    out_i = o_i * Z_i / (Z_i + exp(sink_h)) = o_i / (1 + exp(sink_h - lse_i)) = o_i * sigmoid(lse_i - sink_h),

so the sink costs one sigmoid per query and head on top of any attention kernel that returns the
log-sum-exp (gradients flow through ``lse`` too). A sliding window of ``W`` lets query ``i`` see keys
``i - W < j <= i``.

The kernel call, :func:`~meshtron.layers.sink_kernel.sink_attention` (flex attention on CUDA, SDPA with one
extra key per head on the CPU), is in :mod:`meshtron.layers.sink_kernel`.

Context parallelism (:func:`meshtron.parallel.context_parallel.attention.context_parallel_attention` with
``sinks`` and ``window``): under ``p2p`` and ``allgather`` the key blocks are merged through their
log-sum-exp as for plain attention, the window checked at the sequence positions of the load-balanced split,
and the sink then joins each row's log-sum-exp once, as a key with a zero value (``out * exp(lse -
logaddexp(lse, sink))``, the same factor as above); under ``a2a`` each rank runs that kernel on the whole
sequence of its share of the heads, whose sinks it keeps; ``a2a+p2p`` rings across its groups on those heads.

Generation keeps earlier (rotated) keys and values in a :class:`~meshtron.layers.attention.KVCache`: all of
them for full attention, the latest ``W - 1`` for a sliding window of ``W`` (so a long generation's cache stays
the window's size); each new query attends to them with its sink, the SDPA path's mask offset by the cached
length.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn as nn

from meshtron.layers.documents import DocumentMask
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.rotary import apply_rope
from meshtron.layers.sink_kernel import (dense_sink_mask, sink_attention, sink_block_mask,  # noqa: F401 (re-exported)
                                         window_block_tables)
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.attention import ContextParallelInputs, context_parallel_attention
from meshtron.parallel.sharding import Piece, ShardSpec, new_param


class SinkAttention(nn.Module):
    """gpt-oss's self-attention: GQA with biases on q, k, v and o, per-head sinks, optional sliding window.

    Called as ``attn(x, rope, mask)`` on ``x`` [s, b, hidden] with ``rope`` meshtron's (cos, sin) tables
    (:func:`meshtron.layers.rotary.rope_tables`, YaRN's scale folded in) and ``mask`` None (causal),
    a one-device :class:`~meshtron.layers.documents.DocumentMask`, or under context parallelism the model's
    :class:`~meshtron.parallel.context_parallel.attention.ContextParallelInputs` (``x`` this rank's tokens).
    Canonical tensors: ``q``, ``k``, ``v``, ``o`` ``.weight``/``.bias`` (as
    :class:`~meshtron.layers.attention.SelfAttention`) and ``sinks`` [heads]. Query and key/value heads are
    split over TP (key/value heads must divide by TP); the sinks follow their heads.
    """

    supports_context_parallel: ClassVar[bool] = True

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
        cp = isinstance(mask, ContextParallelInputs)
        if not (mask is None or cp or isinstance(mask, DocumentMask)):
            raise NotImplementedError("sink attention: no boolean masks")
        if cache is not None and mask is not None:
            raise NotImplementedError("sink attention: a key/value cache decodes one sequence on one device")
        nq, ng, d = self.nq, self.ng, self.d
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([nq * d, ng * d, ng * d], dim=-1)
        q, k, v = q.view(s, b, nq, d), k.view(s, b, ng, d), v.reshape(s, b, ng, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if cache is not None:
            # The cache's keys and values; the kernel places the queries at its end (its mask: window and causal).
            k, v, _ = cache.update(k, v)
            out = sink_attention(q, k, v, self.sinks, self.window)
            if self.window is not None:
                # the next query (one position on) sees the window's latest W - 1 keys and itself
                cache.keep_last(self.window - 1)
        elif cp:
            out = context_parallel_attention(q, k, v, mask, sinks=self.sinks, window=self.window)
        else:
            out = sink_attention(q, k, v, self.sinks, self.window, mask)
        return self.o(out.permute(2, 0, 1, 3).reshape(s, b, nq * d))

