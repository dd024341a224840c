"""Qwen3.5's full attention: GQA with an output gate, zero-centred query/key norms and partial RoPE:
``GatedAttention``'s numbers and Hugging Face names."""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.layer_kinds.base import Counts, Matrix, SavedBytes
from meshtron.layer_kinds.gqa import GroupedQueryAttention


class GatedAttentionKind(GroupedQueryAttention):
    """``gated_attn``: the query projection gives each head its query and a gate of the same width (the
    attention output is multiplied by ``sigmoid(gate)``), queries and keys are RMS-normalised per head with
    scale ``1 + w``, and RoPE turns the first --rotary-percent of each head. Biases on q, k, v and o unless
    --disable-bias-linear. Generation keeps a key/value cache (``gqa``'s)."""

    name = "gated_attn"
    module = "meshtron.layers.gated_attention:GatedAttention"
    # Hugging Face's names are gqa's (q_proj holds each head's query and gate rows, as meshtron's q).

    def check(self, m: ModelConfig) -> Optional[str]:
        if m.multi_latent_attention:
            return "gated_attn layers cannot be mixed with --multi-latent-attention (one rotary table per model)"
        if m.num_attention_heads % num_kv_heads(m):
            return "gated_attn layers need --num-query-groups to divide --num-attention-heads"
        if not 0 < m.rotary_percent <= 1 or self.rope_dim(m) % 2:
            return (f"gated_attn layers need --rotary-percent in (0, 1] turning an even number of each head's "
                    f"{head_dim(m)} dimensions, got {m.rotary_percent}")
        if m.add_qkv_bias and m.disable_bias_linear:
            return "gated_attn layers have biases on all four projections or none (--add-qkv-bias)"
        return None

    def build(self, cfg: ModelConfig, ctx, prefix: str, sequence_parallel: bool):
        from meshtron.parallel.sharding import scaled_std

        return self.module_class()(ctx, prefix, cfg.hidden_size, cfg.num_attention_heads, num_kv_heads(cfg),
                                   head_dim(cfg), cfg.norm_epsilon, not cfg.disable_bias_linear, sequence_parallel,
                                   cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers))

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        H, d, nq, nkv = m.hidden_size, head_dim(m), m.num_attention_heads, num_kv_heads(m)
        return [Matrix("q.weight", 2 * nq * d, H), Matrix("k.weight", nkv * d, H), Matrix("v.weight", nkv * d, H),
                Matrix("o.weight", H, nq * d)]  # q: each head's query and gate rows

    def parameters(self, m: ModelConfig) -> Counts:
        H, d, nq, nkv = m.hidden_size, head_dim(m), m.num_attention_heads, num_kv_heads(m)
        weights = H * 2 * nq * d + 2 * H * nkv * d + nq * d * H
        biases = 0 if m.disable_bias_linear else 2 * nq * d + 2 * nkv * d + H
        return Counts(total=weights + biases + 2 * d, matmul=weights)  # + the two head norms

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        h, d = m.hidden_size, head_dim(m)
        heads, groups = math.ceil(m.num_attention_heads / tp), math.ceil(num_kv_heads(m) / tp)
        qkv_out = d * (2 * heads + 2 * groups)
        dense = h * qkv_out + heads * d * h + 2 * d  # projections' shards, head norms (replicated)
        if not m.disable_bias_linear:
            dense += qkv_out + h
        return dense

    def rope_dim(self, m: ModelConfig) -> int:
        return int(head_dim(m) * m.rotary_percent)

    def projection_widths(self, m: ModelConfig, tp: int) -> tuple[int, int]:
        d = head_dim(m)
        return 2 * math.ceil(m.num_attention_heads / tp) * d, 2 * math.ceil(num_kv_heads(m) / tp) * d

    def fp8_weight_elements(self, m: ModelConfig, tp: int) -> float:
        h, d = m.hidden_size, head_dim(m)
        heads, groups = math.ceil(m.num_attention_heads / tp), math.ceil(num_kv_heads(m) / tp)
        return h * d * (2 * heads + 2 * groups) + heads * d * h

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        super().add_saved_bytes(m, s)  # gqa's: the projections, normed and rotated q/k, the kernel's saves
        # The gate (a view of the query projection's output, kept), sigmoid(gate) and the gated output (the
        # output projection's input); the head norms' fp32 statistics.
        s.part += 3 * s.e * s.heads * head_dim(m) + s.stats * (s.heads + s.groups)


GATED_ATTN = GatedAttentionKind()
