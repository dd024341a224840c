"""Qwen3.5's full attention: GQA with an output gate, zero-centred query/key RMSNorm and partial RoPE.

The query projection gives each head its query and a gate of the same width (rows per head: ``d``
query rows, then ``d`` gate rows, as Hugging Face's ``q_proj``); the attention output is multiplied by
``sigmoid(gate)`` before the output projection. Queries and keys are RMS-normalised per head with
weights ``1 + w`` (``w`` starts at 0), and RoPE turns only their first ``rotary_dim`` dimensions.
Attention itself is :func:`meshtron.layers.attention.core_attention` (causal, GQA, packed documents),
or context-parallel attention under CP, as in :class:`~meshtron.layers.attention.SelfAttention`.
Generation keeps the normed and rotated keys and values in a :class:`~meshtron.layers.attention.KVCache`.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.layers.attention import core_attention
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.rotary import apply_partial_rope
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.attention import context_parallel_attention
from meshtron.parallel.sharding import Piece, ShardSpec, new_param, whole


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in fp32, times ``1 + weight``, back to ``x``'s dtype."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm (its layer norms and the final norm): weight ``1 + w`` with ``w`` starting at 0,
    computed in fp32. Replicated over TP like :class:`~meshtron.layers.norm.Norm` (``sequence_parallel``:
    each rank sees part of the inputs, so the gradient is summed over TP)."""

    def __init__(self, name: str, hidden: int, eps: float = 1e-6, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = new_param(ShardSpec((whole(f"{name}.weight", (hidden,), "zeros"),), tp_replicated=True,
                                          grad_sync="tp" if sequence_parallel else None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Called as ``attn(x, rope, mask)`` on ``x`` [s, b, hidden]; ``rope`` the (cos, sin) tables of width
    ``rotary_dim`` (:func:`meshtron.layers.rotary.rope_tables`). Canonical tensors: ``q.weight``
    [heads * 2d, H] (query and gate rows of each head), ``k.weight``, ``v.weight``, ``o.weight`` (and
    biases with ``bias``), ``q_norm.weight`` / ``k_norm.weight`` [d]. Heads split over TP (key/value
    heads must divide by TP)."""

    supports_context_parallel: ClassVar[bool] = True  # as SelfAttention: context-parallel attention under CP

    def __init__(self, ctx: ParallelContext, prefix: str, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, norm_eps: float = 1e-6, bias: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, output_std: Optional[float] = None):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        if num_heads % num_kv_heads or num_kv_heads % tp:
            raise ValueError(f"gated attention: key/value heads ({num_kv_heads}) must divide the heads ({num_heads}) "
                             f"and divide by TP ({tp})")
        H, d = hidden_size, head_dim
        self.nq, self.ng, self.d = num_heads // tp, num_kv_heads // tp, d
        out_std = init_std if output_std is None else output_std

        def rows(name, heads, local, width, init="normal"):
            shape = (heads * width, H) if init == "normal" else (heads * width,)
            return Piece(f"{prefix}.{name}", shape, 0, r * local * width, local * width, init, init_std)

        names = (("q", num_heads, self.nq, 2 * d), ("k", num_kv_heads, self.ng, d), ("v", num_kv_heads, self.ng, d))
        self.qkv = ColumnParallelLinear(ctx, [rows(f"{n}.weight", h, l, w) for n, h, l, w in names],
                                        [rows(f"{n}.bias", h, l, w, "zeros") for n, h, l, w in names] if bias else None,
                                        sequence_parallel)
        self.o = RowParallelLinear(
            ctx, Piece(f"{prefix}.o.weight", (H, num_heads * d), 1, r * self.nq * d, self.nq * d, "normal", out_std),
            Piece(f"{prefix}.o.bias", (H,), 0, 0, H, "zeros") if bias else None, sequence_parallel)
        # Shared by all heads; with TP each rank normalises its own heads (a partial gradient over TP).
        self.q_norm, self.k_norm = (ZeroCentredRMSNorm(f"{prefix}.{n}", d, norm_eps, sequence_parallel=tp > 1)
                                    for n in ("q_norm", "k_norm"))
        self.attend = context_parallel_attention if ctx.cp > 1 else core_attention

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]], mask=None,
                cache=None) -> torch.Tensor:
        if cache is not None and mask is not None:
            raise NotImplementedError("gated attention: a key/value cache decodes one sequence on one device")
        nq, ng, d = self.nq, self.ng, self.d
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        qg, k, v = qkv.split([nq * 2 * d, ng * d, ng * d], dim=-1)
        q, gate = qg.view(s, b, nq, 2 * d).split([d, d], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.view(s, b, ng, d))
        v = v.reshape(s, b, ng, d)
        if rope is not None:
            q, k = apply_partial_rope(q, *rope), apply_partial_rope(k, *rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if cache is not None:  # the cached keys too, and the mask placing the queries after them
            k, v, mask = cache.update(k, v)
            out = core_attention(q, k, v, mask, 0.0).permute(2, 0, 1, 3)
        else:
            out = self.attend(q, k, v, mask, 0.0).permute(2, 0, 1, 3)  # [s, b, heads, d]
        return self.o((out * torch.sigmoid(gate)).reshape(s, b, nq * d))

