"""The gated DeltaNet token mixer (Qwen3.5's linear attention): ``GatedDeltaNet``'s numbers and Hugging Face
names.

No key/value heads and no attention scores: each value head keeps a [dk, dv] state that every token decays
and corrects (:mod:`meshtron.layers.gated_deltanet`). Its sequence work is linear in the sequence, so its
FLOPs per token do not grow with it.
"""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ModelConfig
from meshtron.layer_kinds.base import Counts, Matrix, MixerKind, SavedBytes


#: Tokens per chunk of meshtron's chunked rule (meshtron.layers.gated_deltanet.CHUNK; this module stays torch-free).
CHUNK = 64


def _widths(m: ModelConfig) -> tuple[int, int, int]:
    """(q + k + v width, the output gate z's width, value heads) of the input projection."""
    kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    return 2 * kd + vd, vd, m.linear_num_value_heads


class GatedDeltaNetKind(MixerKind):
    """``gdn``: one input projection (q, k, v, the gate z, and the per-head beta and decay logits), a causal
    depthwise convolution of --linear-conv-kernel-dim over q, k and v, the gated delta rule over
    --linear-num-value-heads heads of --linear-value-head-dim (keys: --linear-num-key-heads of
    --linear-key-head-dim), a gated RMSNorm and the output projection. Context parallelism (any --cp-comm-type)
    all-gathers each sequence chunk's affine map of its start state and its convolution halo over the CP group
    (:mod:`meshtron.parallel.context_parallel.recurrence`). Generation keeps a recurrent decode state per layer
    (the convolution's last K - 1 inputs and the rule's state)."""

    name = "gdn"
    module = "meshtron.layers.gated_deltanet:GatedDeltaNet"
    supports_context_parallel = True
    decode_state = "meshtron.layers.gated_deltanet:DecodeState"
    #: Hugging Face ``linear_attn.<name>`` -> meshtron ``attention.<name>`` (Qwen3.5; ``conv1d.weight`` loses
    #: its middle dimension of 1, :mod:`meshtron.checkpoint.hf_qwen3_5`).
    hf_names = {n: n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                               "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")}
    hf_part = "linear_attn"

    def check(self, m: ModelConfig) -> Optional[str]:
        sizes = (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
                 m.linear_conv_kernel_dim)
        if min(sizes) < 1:
            return ("gdn layers need positive --linear-num-key-heads, --linear-num-value-heads, "
                    "--linear-key-head-dim, --linear-value-head-dim and --linear-conv-kernel-dim")
        if m.linear_num_value_heads % m.linear_num_key_heads:
            return (f"gdn layers need --linear-num-value-heads ({m.linear_num_value_heads}) to be a multiple of "
                    f"--linear-num-key-heads ({m.linear_num_key_heads})")
        return None

    def build(self, cfg: ModelConfig, ctx, prefix: str, sequence_parallel: bool):
        from meshtron.parallel.sharding import scaled_std

        return self.module_class()(ctx, prefix, cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                                   cfg.norm_epsilon, sequence_parallel, cfg.init_method_std,
                                   scaled_std(cfg.init_method_std, cfg.num_layers))

    def _weights(self, m: ModelConfig) -> tuple[int, int]:
        """(input projection, output projection) weights."""
        qkv, z, nv = _widths(m)
        return m.hidden_size * (qkv + z + 2 * nv), z * m.hidden_size

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        qkv, z, nv = _widths(m)
        H = m.hidden_size
        return [Matrix("in_proj_qkv.weight", qkv, H), Matrix("in_proj_z.weight", z, H),
                Matrix("in_proj_b.weight", nv, H), Matrix("in_proj_a.weight", nv, H),
                Matrix("conv1d.weight", qkv, m.linear_conv_kernel_dim), Matrix("out_proj.weight", H, z)]

    def parameters(self, m: ModelConfig) -> Counts:
        qkv, _, nv = _widths(m)
        w_in, w_out = self._weights(m)
        others = qkv * m.linear_conv_kernel_dim + 2 * nv + m.linear_value_head_dim  # conv, A_log, dt_bias, norm
        return Counts(total=w_in + w_out + others, matmul=w_in + w_out)

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        qkv, _, nv = _widths(m)
        split = sum(self._weights(m)) + qkv * m.linear_conv_kernel_dim + 2 * nv  # by heads over TP
        return split / tp + m.linear_value_head_dim  # the gated norm's weight: replicated

    def fp8_weight_elements(self, m: ModelConfig, tp: int) -> float:
        return sum(self._weights(m)) / tp

    def sequence_flops_per_token(self, m: ModelConfig, seq: int) -> int:
        # Not growing with the sequence: per value head the state's read-out, correction and rank-1 update
        # (2 dk dv each) and its decay, and the convolution.
        qkv, _, nv = _widths(m)
        return 7 * nv * m.linear_key_head_dim * m.linear_value_head_dim + 2 * m.linear_conv_kernel_dim * qkv

    def projection_widths(self, m: ModelConfig, tp: int) -> tuple[int, int]:
        kd = m.linear_num_key_heads * m.linear_key_head_dim
        return kd // tp, (kd + m.linear_num_value_heads * m.linear_value_head_dim) // tp

    def cp_exchange_heads(self, m: ModelConfig, tp: int) -> int:
        return 0  # no key/value heads: its CP exchange is the states of cp_state_bytes, for every comm type

    def cp_state_bytes(self, m: ModelConfig, tp: int, micro_batch: int) -> float:
        # Per value head a [dk, dk] transition and a [dk, dv] end state in fp32, and the last K - 1 inputs of
        # the convolution (2 bytes: bf16).
        qkv, _, nv = (w / tp for w in _widths(m))
        dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
        return micro_batch * (4 * nv * dk * (dk + dv) + 2 * (m.linear_conv_kernel_dim - 1) * qkv)

    def recurrence_work(self, m: ModelConfig, tp: int, micro_batch: int, seq: float, cp: int
                        ) -> Optional[tuple[float, float]]:
        # meshtron's chunked rule (64 tokens a chunk, a loop over the chunks), run three times: forward, again
        # in backward (it keeps only its inputs), and its backward (about two forwards); per value head and
        # token its forward does q k^T and k k^T within the chunk (4 C dk), the triangular solve (C (dk + dv)),
        # the intra-chunk product (2 C dv) and the state's three products (6 dk dv). Under CP the values are
        # dk columns wider, and each rank's sequence is two chunks of the load-balanced split.
        nv = m.linear_num_value_heads / tp
        dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
        if cp > 1:
            dv += dk
        per_token = 4 * CHUNK * dk + CHUNK * (dk + dv) + 2 * CHUNK * dv + 6 * dk * dv
        steps = 4 * (math.ceil(seq / 2 / CHUNK) * 2 if cp > 1 else math.ceil(seq / CHUNK))
        return steps, 4 * nv * per_token * micro_batch * seq

    def forward_gemms(self, m: ModelConfig, tokens: float, tp: int) -> list[float]:
        w_in, w_out = self._weights(m)
        return [2 * tokens * w_in / tp, 2 * tokens * w_out / tp]

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        # What the compiled layer keeps (counted on the CPU, tests/layers/test_saved_activations.py) on the
        # default path: the chunked rule keeping only its inputs (meshtron.layers.gated_deltanet.
        # chunk_rule_keeping_inputs), whose backward normalises q and k again from the convolution's output.
        qkv, z, nv = (w / s.tp for w in _widths(m))
        nk, dv, K = m.linear_num_key_heads / s.tp, m.linear_value_head_dim, m.linear_conv_kernel_dim
        if "norm" not in s.selective:
            s.rep += s.lin * s.h  # the first norm's output (the input projection's input)
            s.part += s.gathered
        # The projection's output (q, k, v, z and the logits are views of it), the convolution's input padded by
        # K - 1 earlier positions, its output after SiLU; the L2 norms' fp32 statistics of q and k per key
        # head, the fp32 decay, beta (the logits' dtype); the gated norm's statistics and output (the output
        # projection's input).
        s.part += s.e * (qkv + z + 2 * nv) + s.e * qkv
        s.part += 4 * 2 * nk + 4 * nv + s.e * nv
        s.part += s.stats * nv + s.lin * nv * dv
        if s.cp == 1:
            s.part += s.e * qkv * (1 + (K - 1) / s.seq)  # the convolution's padded input
            return
        # Context parallelism (meshtron.parallel.context_parallel.recurrence; counted on the CPU, tests/
        # context_parallel/test_cp_gated_deltanet.py): each of the two chunks' convolution keeps its input after
        # the halo (K - 1 more positions) and that input padded again; the rule runs on the values widened by dk
        # columns (fp32) and its output is kept in fp32; the all-gathered (transition, end state) pairs of the
        # 2 CP chunks and this rank's start states, [dk, dk + dv] per head each, and the 2 CP - 1 states
        # [dk, dv] the composition passes along (a [64, 64] mask and an index, per micro-batch, left out).
        n = s.seq / 2
        dk = m.linear_key_head_dim
        s.part += s.e * qkv * (2 + 3 * (K - 1) / n)
        s.part += 4 * nv * (dk + dv) + 4 * nv * dv
        s.part += 4 * nv * dk * ((2 * s.cp + 1) * (dk + dv) + (2 * s.cp - 1) * dv) / s.seq

GDN = GatedDeltaNetKind()
