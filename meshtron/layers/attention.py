"""Self-attention with tensor-parallel heads, GQA/MQA and rotary embeddings.

Query heads are split over TP ranks. Key/value heads (query groups) are split too
when their number is a multiple of TP; when TP exceeds the number of groups, each
rank holds the one group its query heads use, and the ranks that share a group sum
that projection's gradients (``grad_sync="kv"``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.norm import Norm
from meshtron.layers.rotary import apply_partial_rope
from meshtron.layers.sdpa import core_attention
from meshtron.parallel.context_parallel.attention import context_parallel_attention
from meshtron.parallel.context import ParallelContext, tp_subgroup
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import Piece, scaled_std


def attention_mask_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask [batch, 1, seq, seq]: causal and within the same document (the dense reference;
    the model passes a :class:`~meshtron.layers.documents.DocumentMask` instead)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


class KVCache:
    """Keys and values of earlier positions for incremental decoding (one device)."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Append new [b, n, s, d] keys/values; return all of them and the mask for the new queries."""
        past = 0 if self.k is None else self.k.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        new, total = k.shape[2], self.k.shape[2]
        if past == 0:
            return self.k, self.v, None  # plain causal prefill
        # query i (absolute position past + i) sees keys 0..past+i
        mask = torch.arange(total, device=k.device)[None, :] <= (past + torch.arange(new, device=k.device))[:, None]
        return self.k, self.v, mask[None, None]

    def keep_last(self, n: int) -> None:
        """Forget all but the ``n`` latest positions (a sliding window's later queries never see the others).
        Attention masks only by the distance between positions, so the kept keys need no offset."""
        if self.k is not None and self.k.shape[2] > n:
            # A copy, so that the forgotten positions' memory is freed rather than kept under a view.
            start = self.k.shape[2] - n  # not ``-n:``, which keeps everything when n is 0
            self.k, self.v = self.k[:, :, start:].clone(), self.v[:, :, start:].clone()


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention of one layer (``prefix`` is its canonical name)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, sequence_parallel: bool):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        H, d = cfg.hidden_size, head_dim(cfg)
        nq, ng = cfg.num_attention_heads, num_kv_heads(cfg)
        self.d, self.nq_local = d, nq // tp
        std, out_std = cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers)
        qkv_bias = (not cfg.disable_bias_linear) or cfg.add_qkv_bias

        def rows(name: str, heads: int, first: int, count: int, init="normal") -> Piece:
            shape = (heads * d, H) if init == "normal" else (heads * d,)
            return Piece(f"{prefix}.{name}", shape, 0, first * d, count * d, init, std)

        q_w = rows("q.weight", nq, r * self.nq_local, self.nq_local)
        q_b = rows("q.bias", nq, r * self.nq_local, self.nq_local, "zeros")
        self.replicated_kv = ng % tp != 0
        if not self.replicated_kv:
            self.ng_local = ng // tp
            g0 = r * self.ng_local
            kv_w = [rows("k.weight", ng, g0, self.ng_local), rows("v.weight", ng, g0, self.ng_local)]
            kv_b = [rows("k.bias", ng, g0, self.ng_local, "zeros"), rows("v.bias", ng, g0, self.ng_local, "zeros")]
            self.qkv = ColumnParallelLinear(ctx, [q_w] + kv_w, [q_b] + kv_b if qkv_bias else None, sequence_parallel)
        else:
            # TP > query groups: this rank's query heads all use group g, replicated over tp/ng ranks.
            replicas = tp // ng
            self.ng_local = 1
            g = r // replicas
            self.q = ColumnParallelLinear(ctx, [q_w], [q_b] if qkv_bias else None, sequence_parallel)
            self.kv = ColumnParallelLinear(
                ctx, [rows("k.weight", ng, g, 1), rows("v.weight", ng, g, 1)],
                [rows("k.bias", ng, g, 1, "zeros"), rows("v.bias", ng, g, 1, "zeros")] if qkv_bias else None,
                sequence_parallel, gather_input=False, grad_sync="kv")
            self.kv_group = tp_subgroup(ctx, replicas)
        bias = not cfg.disable_bias_linear
        self.o = RowParallelLinear(
            ctx, Piece(f"{prefix}.o.weight", (H, nq * d), 1, r * self.nq_local * d, self.nq_local * d, "normal", out_std),
            Piece(f"{prefix}.o.bias", (H,), 0, 0, H, "zeros") if bias else None, sequence_parallel)
        # --qk-layernorm: one norm weight over the head dimension, shared by all heads. Each TP rank
        # applies it to its own heads, so its gradient is a partial sum over TP.
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            sync = tp > 1
            self.q_norm = Norm(f"{prefix}.q_norm", d, cfg.normalization, cfg.norm_epsilon, sync)
            self.k_norm = Norm(f"{prefix}.k_norm", d, cfg.normalization, cfg.norm_epsilon, sync)
        self.dropout = cfg.attention_dropout
        self.tracker: Optional[RNGTracker] = None
        # With context parallelism ``mask`` is the model's ContextParallelInputs (keys of every CP rank).
        self.attend = context_parallel_attention if ctx.cp > 1 else core_attention

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """Width of the rotary tables: the first --rotary-percent of each head (by default the whole head)."""
        return int(head_dim(cfg) * cfg.rotary_percent)

    @staticmethod
    def head_dims(cfg: ModelConfig) -> tuple[int, int]:
        """(query/key, value) head dims."""
        return head_dim(cfg), head_dim(cfg)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[torch.Tensor], cache: Optional["KVCache"] = None) -> torch.Tensor:
        nq, ng, d = self.nq_local, self.ng_local, self.d
        if not self.replicated_kv:
            qkv = self.qkv(x)
            s, b = qkv.shape[0], qkv.shape[1]
            q, k, v = torch.split(qkv, [nq * d, ng * d, ng * d], dim=-1)
        else:
            xin = self.q.prepare_input(x)
            q = self.q(xin, prepared=True)
            k, v = torch.split(self.kv(xin, prepared=True), [d, d], dim=-1)
            s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, nq, d)
        k = k.view(s, b, ng, d)
        v = v.reshape(s, b, ng, d)
        if self.training and torch.is_grad_enabled() and (rope is not None or self.q_norm is not None):
            # RoPE and the head norms write new queries and keys; a copy of the values lets the fused
            # projection's output go after the forward (as a view, the values would keep all of it).
            v = v.contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # the first rope-width dimensions of each head (--rotary-percent)
            q = apply_partial_rope(q, *rope)
            k = apply_partial_rope(k, *rope)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if cache is not None:
            k, v, mask = cache.update(k, v)
        p = self.dropout if self.training else 0.0
        if p > 0 and self.tracker is not None:
            with self.tracker.fork():
                out = self.attend(q, k, v, mask, p)
        else:
            out = self.attend(q, k, v, mask, p)
        out = out.permute(2, 0, 1, 3).reshape(s, b, nq * d)
        return self.o(out)
