"""Multi-head attention with grouped (or single) key/value heads: ``SelfAttention``'s numbers."""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.layer_kinds.base import Counts, Matrix, MixerKind, SavedBytes, add_attention_kernel_saves


class GroupedQueryAttention(MixerKind):
    """``gqa``: fused-width q/k/v projections (optional biases and per-head q/k norms), RoPE over the whole head
    (or its first --rotary-percent), flash attention, an output projection."""

    name = "gqa"
    module = "meshtron.layers.attention:SelfAttention"
    #: Hugging Face ``self_attn.<name>`` -> meshtron ``attention.<name>`` (Llama, Mistral, Qwen2, Qwen3).
    hf_names = {
        "q_proj.weight": "q.weight",
        "k_proj.weight": "k.weight",
        "v_proj.weight": "v.weight",
        "q_proj.bias": "q.bias",  # Qwen2
        "k_proj.bias": "k.bias",
        "v_proj.bias": "v.bias",
        "q_norm.weight": "q_norm.weight",  # Qwen3
        "k_norm.weight": "k_norm.weight",
        "o_proj.weight": "o.weight",
    }

    def check(self, m: ModelConfig) -> Optional[str]:
        if m.multi_latent_attention:
            return "gqa layers cannot be mixed with --multi-latent-attention (one rotary table per model)"
        if not 0 < m.rotary_percent <= 1 or self.rope_dim(m) % 2 or not self.rope_dim(m):
            return (f"gqa layers need --rotary-percent in (0, 1] turning an even number of each head's "
                    f"{head_dim(m)} dimensions, got {m.rotary_percent}")
        return None

    def parameters(self, m: ModelConfig) -> Counts:
        H, d, nq, nkv = m.hidden_size, head_dim(m), m.num_attention_heads, num_kv_heads(m)
        bias = not m.disable_bias_linear
        weights = H * nq * d + 2 * H * nkv * d + nq * d * H
        biases = (nq * d + 2 * nkv * d if (bias or m.add_qkv_bias) else 0) + (H if bias else 0)
        norm = 1 if m.normalization == "RMSNorm" else 2  # parameters per normalised feature
        head_norms = 2 * norm * d if m.qk_layernorm else 0
        return Counts(total=weights + biases + head_norms, matmul=weights)

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        h, d = m.hidden_size, head_dim(m)
        heads, groups = math.ceil(m.num_attention_heads / tp), math.ceil(num_kv_heads(m) / tp)
        qkv_out = d * (heads + 2 * groups)
        dense = h * qkv_out + heads * d * h  # QKV and output projection shards
        if not m.disable_bias_linear or m.add_qkv_bias:
            dense += qkv_out
        if not m.disable_bias_linear:
            dense += h  # output-projection bias (row-parallel: replicated)
        if m.qk_layernorm:
            dense += 2 * (1 if m.normalization == "RMSNorm" else 2) * d  # the head norms (replicated)
        return dense

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        H, d = m.hidden_size, head_dim(m)
        q, kv = m.num_attention_heads * d, num_kv_heads(m) * d
        return [Matrix("q.weight", q, H), Matrix("k.weight", kv, H), Matrix("v.weight", kv, H),
                Matrix("o.weight", H, q)]

    def rope_dim(self, m: ModelConfig) -> int:
        return int(head_dim(m) * m.rotary_percent)  # the whole head by default

    def head_dims(self, m: ModelConfig) -> tuple[int, int]:
        return head_dim(m), head_dim(m)

    def projection_widths(self, m: ModelConfig, tp: int) -> tuple[int, int]:
        d = head_dim(m)
        return math.ceil(m.num_attention_heads / tp) * d, 2 * math.ceil(num_kv_heads(m) / tp) * d

    def cp_exchange_heads(self, m: ModelConfig, tp: int) -> int:
        return math.ceil(num_kv_heads(m) / tp)

    def cp_kv_replicas(self, m: ModelConfig, tp: int, degree: int) -> int:
        from meshtron.cp_comm_types import a2a_kv_replicas

        return a2a_kv_replicas(math.ceil(m.num_attention_heads / tp), math.ceil(num_kv_heads(m) / tp), degree)

    def forward_gemms(self, m: ModelConfig, tokens: float, tp: int) -> list[float]:
        q_out, kv_out = self.projection_widths(m, tp)
        return [2 * tokens * m.hidden_size * (q_out + kv_out), 2 * tokens * q_out * m.hidden_size]

    def fp8_weight_elements(self, m: ModelConfig, tp: int) -> float:
        h, d = m.hidden_size, head_dim(m)
        heads, groups = math.ceil(m.num_attention_heads / tp), math.ceil(num_kv_heads(m) / tp)
        return h * d * (heads + 2 * groups) + heads * d * h

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        e, lin, heads, groups, d = s.e, s.lin, s.heads, s.groups, head_dim(m)
        q_out, kv_out = heads * d, 2 * groups * d
        if "norm" not in s.selective and not s.rowwise_fp8:
            s.rep += lin * s.h  # the first norm's output (the QKV projection's input)
            s.part += s.gathered  # ... and the rest of its all-gathered sequence (compiled, SP, bf16)
        # RoPE (and the head norms) write new queries and keys, which the attention kernel keeps, and the
        # values are copied out of the fused QKV output, which then goes. Without either, q and k are
        # views of it; under selective recomputation it is a saved matmul output: all of it stays. And
        # the attention output.
        rotated = m.position_embedding_type == "rope" or m.qk_layernorm
        copied = rotated and s.recompute != "selective" and s.saves >= 1
        s.part += e * heads * d + e * (kv_out // 2 if copied else q_out + kv_out)
        if s.fp8:
            s.part += heads * d  # the output projection's FP8 copy of its input (the attention output)
        if rotated and "core_attn" not in s.selective:
            s.part += e * (q_out + kv_out // 2)
        # All-to-all CP (--cp-comm-type a2a) keeps the exchanged q, k, v in place of the local ones (the same
        # bytes per token), with key/value heads repeated until they split over the CP ranks.
        s.part += e * kv_out * (s.cp_kv_replicas - 1)
        if m.qk_layernorm and "norm" not in s.selective:
            s.part += s.stats * (heads + groups)  # per-head statistics
        add_attention_kernel_saves(m, s)


GQA = GroupedQueryAttention()
