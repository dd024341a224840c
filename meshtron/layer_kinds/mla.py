"""Multi-latent attention (DeepSeek-V2/V3): ``MultiLatentAttention``'s numbers and Hugging Face names.

:class:`meshtron.layers.mla.MultiLatentAttention` builds exactly the tensors counted here
(tests/layers/test_mla.py and tests/layers/test_layer_kinds.py check it).
"""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.layer_kinds.base import Counts, Matrix, MixerKind, SavedBytes, add_attention_kernel_saves


class MultiLatentAttention(MixerKind):
    """``mla``: queries and keys/values through low-rank latents (each with its norm), RoPE on a separate part
    of each head (the key part one head shared by all), an output projection."""

    name = "mla"
    module = "meshtron.layers.mla:MultiLatentAttention"
    #: Hugging Face ``self_attn.<name>`` -> meshtron ``attention.<name>`` (DeepSeek-V2/V3; the rotary rows are
    #: reordered too, :mod:`meshtron.layers.mla_hf`).
    hf_names = {
        "q_a_proj.weight": "q_down.weight",
        "q_a_proj.bias": "q_down.bias",
        "q_a_layernorm.weight": "q_latent_norm.weight",
        "q_b_proj.weight": "q_up.weight",
        "q_proj.weight": "q.weight",  # no --q-lora-rank
        "kv_a_proj_with_mqa.weight": "kv_down.weight",
        "kv_a_proj_with_mqa.bias": "kv_down.bias",
        "kv_a_layernorm.weight": "kv_latent_norm.weight",
        "kv_b_proj.weight": "kv_up.weight",
        "o_proj.weight": "o.weight",
        "o_proj.bias": "o.bias",
    }
    hf_values = "meshtron.layers.mla_hf"  # DeepSeek's interleaved rotary rows

    def check(self, m: ModelConfig) -> Optional[str]:
        if not m.multi_latent_attention:
            return "mla layers need --multi-latent-attention (their shapes and YaRN come from the MLA flags)"
        return None

    def parameters(self, m: ModelConfig) -> Counts:
        H, n = m.hidden_size, m.num_attention_heads
        dq, dr, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        rq, rkv = m.q_lora_rank, m.kv_lora_rank
        norm = 1 if m.normalization == "RMSNorm" else 2  # parameters per normalised feature
        q = rq * H + n * dq * rq if rq else n * dq * H
        matmul = q + (rkv + dr) * H + n * (m.qk_head_dim + dv) * rkv + H * n * dv
        others = norm * (rkv + (rq or 0))
        if not m.disable_bias_linear:
            others += (rq or 0) + rkv + dr + H  # down projections and output
        return Counts(total=matmul + others, matmul=matmul)

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        """The down projections and the latent norms are replicated over TP; the per-head parts split."""
        total = self.parameters(m).total
        n, H, rq = m.num_attention_heads, m.hidden_size, m.q_lora_rank
        dq, dkv, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_head_dim + m.v_head_dim, m.v_head_dim
        per_head = n * (dq * rq if rq else dq * H) + n * dkv * m.kv_lora_rank + H * n * dv  # split over TP
        return total - per_head + per_head / tp

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        """With --q-lora-rank the queries go through a latent (q_down, q_up), else one projection (q)."""
        H, n, rq, rkv = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
        dq = m.qk_head_dim + m.qk_pos_emb_head_dim
        queries = ([Matrix("q_down.weight", rq, H), Matrix("q_up.weight", n * dq, rq)] if rq
                   else [Matrix("q.weight", n * dq, H)])
        return queries + [Matrix("kv_down.weight", rkv + m.qk_pos_emb_head_dim, H),
                          Matrix("kv_up.weight", n * (m.qk_head_dim + m.v_head_dim), rkv),
                          Matrix("o.weight", H, n * m.v_head_dim)]

    def rope_dim(self, m: ModelConfig) -> int:
        return m.qk_pos_emb_head_dim  # the positional part of each head

    def head_dims(self, m: ModelConfig) -> tuple[int, int]:
        return m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim

    def projection_widths(self, m: ModelConfig, tp: int) -> tuple[int, int]:
        # The step-time model's elementwise and ring terms use attention-shaped widths for MLA too (kept so that
        # recorded predictions stay the same).
        d = head_dim(m)
        return math.ceil(m.num_attention_heads / tp) * d, 2 * math.ceil(num_kv_heads(m) / tp) * d

    def cp_exchange_heads(self, m: ModelConfig, tp: int) -> int:
        return math.ceil(m.num_attention_heads / tp)  # every head has its own key and value

    def forward_gemms(self, m: ModelConfig, tokens: float, tp: int) -> list[float]:
        # Four projections' worth of the rank's weights, each GEMM a quarter (down, q/kv up, output).
        return [2 * tokens * self.rank_parameters(m, tp) / 4] * 4

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        e, lin, n = s.e, s.lin, s.heads
        dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        latent = (m.q_lora_rank or 0) + m.kv_lora_rank + dr
        # The down projection's output (the latent norms' input, replicated like the down projection).
        s.rep += e * latent
        if "norm" not in s.selective:
            # the norms' statistics and the normed latents (the up projections' input; gathered over the
            # sequence under SP: whole on every TP rank); selective recomputation runs the norms again
            s.rep += s.stats * (2 if m.q_lora_rank else 1)
            s.part += lin * latent
            s.rep += lin * s.h  # the first norm's output (the input of the down and query projections)
        qk = n * (dn + dr)
        if "core_attn" in s.selective:
            # Selective recomputation keeps the matmul outputs: the query projection's and the key/value
            # projection's (whole), and the attention kernel's output; the rotated, concatenated queries and
            # keys and the output projection's [s, b, n*dv] input are made again from them (counted on the CPU,
            # tests/layers/test_saved_activations.py).
            s.part += e * (qk + n * (dn + dv) + n * dv)
        else:
            # The concatenated queries and keys, the values (copied out of the key/value projection's output,
            # which then goes), the attention output, and its [s, b, n*dv] copy, the output projection's input.
            kv_kept = n * dv if s.saves >= 1 else n * (dn + dv)
            s.part += e * (2 * qk + kv_kept + n * dv) + lin * n * dv
        add_attention_kernel_saves(m, s)


MLA = MultiLatentAttention()
