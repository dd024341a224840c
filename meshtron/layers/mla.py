"""Multi-latent attention (DeepSeek-V2/V3), tensor-parallel over heads.

Per token, with ``n`` heads, ``dn`` = --qk-head-dim, ``dr`` = --qk-pos-emb-head-dim and
``dv`` = --v-head-dim:

* queries: ``q_down`` [q_lora_rank, H] -> ``q_latent_norm`` -> ``q_up`` [n (dn + dr), q_lora_rank];
  without --q-lora-rank one projection ``q`` [n (dn + dr), H];
* keys and values: ``kv_down`` [kv_lora_rank + dr, H] gives the joint latent and one rotary key
  head shared by every head; ``kv_latent_norm`` normalises the latent and ``kv_up``
  [n (dn + dv), kv_lora_rank] expands it into each head's non-rotary key and its value;
* RoPE rotates the last ``dr`` dimensions of each query head and the shared key head only;
* attention over query/key heads of dn + dr and value heads of dv, scaled by
  1/sqrt(dn + dr) (times YaRN's mscale^2), then ``o`` [H, n dv].

Tensor parallelism: the down projections and latent norms are replicated, the up projections
are column-parallel over heads and ``o`` is row-parallel. The latents enter the TP region once:
with sequence parallelism each rank projects only its sequence shard and all-gathers the
latents (kv_lora_rank + dr + q_lora_rank wide, narrower than the hidden state), so the
replicated weights' gradients are partial over TP (``grad_sync="tp"``, as for the norms);
without it, the latents' gradient is all-reduced before the down projections, whose gradients
then agree on every rank.

Keys and values are kept per head (n (dn + dr) and n dv wide), which is what the KV cache of
:func:`meshtron.generate` and context parallelism exchange; caching the compressed latents is
a decoding optimisation left out here. Parameter names map to Hugging Face's DeepSeek names
in :mod:`meshtron.layers.mla_hf`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from meshtron.config import ModelConfig
from meshtron.layers.attention import KVCache
from meshtron.layers.sdpa import core_attention
from meshtron.parallel.context_parallel.attention import context_parallel_attention
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.norm import Norm
from meshtron.layers.rotary import apply_rope, rope_kind, yarn_mscale
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import Piece, scaled_std, whole


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(query/key head dim), times YaRN's mscale(factor, --mscale-all-dim)^2 when YaRN is on."""
    scale = 1.0 / math.sqrt(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
    if rope_kind(cfg) == "yarn":
        scale *= yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2
    return scale


class MultiLatentAttention(nn.Module):
    """Multi-latent self-attention of one layer (``prefix`` is its canonical name)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, sequence_parallel: bool):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        H, n = cfg.hidden_size, cfg.num_attention_heads
        self.n_local = n // tp
        self.dn, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        dq, dkv = self.dn + self.dr, self.dn + self.dv
        self.q_rank, self.kv_rank = cfg.q_lora_rank or 0, cfg.kv_lora_rank
        std, out_std = cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers)
        bias = not cfg.disable_bias_linear
        self.group = ctx.tp_group
        self.sequence_parallel = sequence_parallel

        def heads(name: str, width: int, fan_in: int) -> Piece:
            """This rank's heads (rows) of a per-head projection [n * width, fan_in]."""
            return Piece(f"{prefix}.{name}", (n * width, fan_in), 0, r * self.n_local * width,
                         self.n_local * width, "normal", std)

        # One matmul for both down projections (replicated; see the module docstring).
        down_w, down_b = [], []
        if self.q_rank:
            down_w.append(whole(f"{prefix}.q_down.weight", (self.q_rank, H), std=std))
            down_b.append(whole(f"{prefix}.q_down.bias", (self.q_rank,), "zeros"))
        down_w.append(whole(f"{prefix}.kv_down.weight", (self.kv_rank + self.dr, H), std=std))
        down_b.append(whole(f"{prefix}.kv_down.bias", (self.kv_rank + self.dr,), "zeros"))
        self.down = ColumnParallelLinear(ctx, down_w, down_b if bias else None, sequence_parallel,
                                         gather_input=False, grad_sync="tp" if sequence_parallel else None,
                                         tp_replicated=True)
        self.q_latent_norm = (Norm(f"{prefix}.q_latent_norm", self.q_rank, cfg.normalization, cfg.norm_epsilon,
                                   sequence_parallel) if self.q_rank else None)
        self.kv_latent_norm = Norm(f"{prefix}.kv_latent_norm", self.kv_rank, cfg.normalization, cfg.norm_epsilon,
                                   sequence_parallel)
        if self.q_rank:
            self.q_up = ColumnParallelLinear(ctx, [heads("q_up.weight", dq, self.q_rank)], None, sequence_parallel,
                                             gather_input=False)
        else:
            self.q = ColumnParallelLinear(ctx, [heads("q.weight", dq, H)], None, sequence_parallel)
        self.kv_up = ColumnParallelLinear(ctx, [heads("kv_up.weight", dkv, self.kv_rank)], None, sequence_parallel,
                                          gather_input=False)
        self.o = RowParallelLinear(
            ctx, Piece(f"{prefix}.o.weight", (H, n * self.dv), 1, r * self.n_local * self.dv, self.n_local * self.dv,
                       "normal", out_std),
            Piece(f"{prefix}.o.bias", (H,), 0, 0, H, "zeros") if bias else None, sequence_parallel)
        self.softmax_scale = mla_softmax_scale(cfg)
        self.dropout = cfg.attention_dropout
        self.tracker: Optional[RNGTracker] = None
        # With context parallelism ``mask`` is the model's ContextParallelInputs (keys of every CP rank).
        self.attend = context_parallel_attention if ctx.cp > 1 else core_attention

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """Width of the rotary tables: the positional part of each head."""
        return cfg.qk_pos_emb_head_dim

    @staticmethod
    def head_dims(cfg: ModelConfig) -> tuple[int, int]:
        """(query/key, value) head dims."""
        return cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim

    def _latents(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(query latent or None, key/value latent, shared rotary key) of the whole sequence, in the TP region."""
        q_lat, kv_lat, k_pe = torch.split(self.down(x), [self.q_rank, self.kv_rank, self.dr], dim=-1)
        parts = [self.q_latent_norm(q_lat)] if self.q_rank else []
        latents = torch.cat(parts + [self.kv_latent_norm(kv_lat), k_pe], dim=-1)
        # Every rank's heads read the latents: sum their gradients over TP on the way back.
        latents = (comm.gather_from_sequence(latents, self.group, grad_is_partial=True) if self.sequence_parallel
                   else comm.copy_to_tp(latents, self.group))
        q_lat, kv_lat, k_pe = torch.split(latents, [self.q_rank, self.kv_rank, self.dr], dim=-1)
        return (q_lat if self.q_rank else None), kv_lat, k_pe

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[torch.Tensor], cache: Optional[KVCache] = None) -> torch.Tensor:
        n, dn, dr, dv = self.n_local, self.dn, self.dr, self.dv
        q_lat, kv_lat, k_pe = self._latents(x)
        q = self.q_up(q_lat) if q_lat is not None else self.q(x)
        s, b = q.shape[0], q.shape[1]
        q_nope, q_pe = torch.split(q.view(s, b, n, dn + dr), [dn, dr], dim=-1)
        k_nope, v = torch.split(self.kv_up(kv_lat).view(s, b, n, dn + dv), [dn, dv], dim=-1)
        if self.training and torch.is_grad_enabled():
            # The keys are concatenated anew below; a copy of the values lets the up projection's output
            # go after the forward (as a view, the values would keep all of it).
            v = v.contiguous()
        k_pe = k_pe.view(s, b, 1, dr)
        if rope is not None:
            q_pe, k_pe = apply_rope(q_pe, *rope), apply_rope(k_pe, *rope)
        # [s, b, n, d] -> [b, n, s, d], concatenated in that order: inductor's attention-pattern
        # rewrite (torch 2.13) fails to compile permuted views of the concatenations.
        bnsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
        q = torch.cat([bnsd(q_nope), bnsd(q_pe)], dim=-1)
        k = torch.cat([bnsd(k_nope), bnsd(k_pe).expand(b, n, s, dr)], dim=-1)
        v = bnsd(v)
        if cache is not None:
            k, v, mask = cache.update(k, v)
        p = self.dropout if self.training else 0.0
        if p > 0 and self.tracker is not None:
            with self.tracker.fork():
                out = self.attend(q, k, v, mask, p, self.softmax_scale)
        else:
            out = self.attend(q, k, v, mask, p, self.softmax_scale)
        return self.o(out.permute(2, 0, 1, 3).reshape(s, b, n * dv))
