"""Attention with per-head sinks, over the whole context or a sliding window (gpt-oss): ``SinkAttention``'s
numbers and Hugging Face names.

gpt-oss alternates the two: ``--layer-pattern sink_window+oss_moe,sink+oss_moe,...`` (its ``layer_types``
``sliding_attention`` / ``full_attention``), the window being --sliding-window-size keys.
"""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.layer_kinds.base import Counts, SavedBytes
from meshtron.layer_kinds.gqa import GroupedQueryAttention


class SinkAttentionKind(GroupedQueryAttention):
    """``sink``: grouped-query attention with biases on q, k, v and o (unless --disable-bias-linear) and one
    learned sink logit per query head, over every earlier key. Its projections are those of ``gqa``, and so is
    context parallelism, with every --cp-comm-type (the sink joins each row's merged log-sum-exp once; the
    window is checked at the split's sequence positions). Generation keeps a key/value cache (``gqa``'s), the
    sink joining each new query's softmax as in the full forward."""

    name = "sink"
    module = "meshtron.layers.sink_attention:SinkAttention"
    #: Hugging Face ``self_attn.<name>`` -> meshtron ``attention.<name>`` (gpt-oss).
    hf_names = {**{f"{p}_proj.{w}": f"{p}.{w}" for p in "qkvo" for w in ("weight", "bias")}, "sinks": "sinks"}
    #: Keys each query sees (None: all earlier ones).
    windowed = False

    def window(self, m: ModelConfig) -> Optional[int]:
        """The layer's window in keys, None for full attention."""
        return m.sliding_window_size if self.windowed else None

    def check(self, m: ModelConfig) -> Optional[str]:
        if m.multi_latent_attention:
            return f"{self.name} layers cannot be mixed with --multi-latent-attention (one rotary table per model)"
        if m.qk_layernorm:
            return f"{self.name} layers have no query/key head norms (--qk-layernorm)"
        if m.rotary_percent != 1:
            return f"{self.name} layers rotate the whole head (--rotary-percent {m.rotary_percent})"
        if num_kv_heads(m) > m.num_attention_heads or m.num_attention_heads % num_kv_heads(m):
            return f"{self.name} layers need --num-query-groups to divide --num-attention-heads"
        if m.add_qkv_bias and m.disable_bias_linear:
            return f"{self.name} layers have biases on all four projections or none (--add-qkv-bias)"
        return None

    def rope_dim(self, m: ModelConfig) -> int:
        return head_dim(m)  # the whole head rotates

    def build(self, cfg: ModelConfig, ctx, prefix: str, sequence_parallel: bool):
        from meshtron.parallel.sharding import scaled_std

        return self.module_class()(ctx, prefix, cfg.hidden_size, cfg.num_attention_heads, num_kv_heads(cfg),
                                   head_dim(cfg), self.window(cfg), not cfg.disable_bias_linear, sequence_parallel,
                                   cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers))

    def parameters(self, m: ModelConfig) -> Counts:
        plain = super().parameters(m)
        return Counts(total=plain.total + m.num_attention_heads, matmul=plain.matmul)  # + one sink per head

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        return super().rank_parameters(m, tp) + math.ceil(m.num_attention_heads / tp)

    def sequence_flops_per_token(self, m: ModelConfig, seq: int) -> int:
        # Scores and weighted values over the keys a query sees: the window, or the whole (causal counted
        # whole, the PaLM convention) sequence.
        window = self.window(m)
        keys = min(seq, window) if window else seq
        d = head_dim(m)
        return 2 * keys * m.num_attention_heads * 2 * d

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        super().add_saved_bytes(m, s)  # gqa's projections, rotated q/k, the attention output, the kernel's lse
        # The sink's factor sigmoid(lse - sink) scales the kernel's output: that output (before the factor) and
        # the fp32 factor per head stay for its backward.
        s.part += s.e * s.heads * head_dim(m) + 4 * s.heads


class SlidingSinkAttentionKind(SinkAttentionKind):
    """``sink_window``: ``sink`` within a sliding window of --sliding-window-size keys (the query's own and the
    N-1 before it). Generation keeps the whole key/value cache and masks it by the window."""

    name = "sink_window"
    windowed = True

    def check(self, m: ModelConfig) -> Optional[str]:
        if not m.sliding_window_size or m.sliding_window_size < 1:
            return "sink_window layers need --sliding-window-size (a positive number of keys)"
        return super().check(m)


SINK = SinkAttentionKind()
SINK_WINDOW = SlidingSinkAttentionKind()
