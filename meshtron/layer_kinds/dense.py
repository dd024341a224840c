"""The dense MLP (gated SwiGLU, or GeLU): ``MLP``'s numbers and Hugging Face names."""

from __future__ import annotations

from meshtron.config import ModelConfig, ffn_size
from meshtron.layer_kinds.base import (Counts, Matrix, MLPKind, RankParameters, SavedBytes, StepInputs, StepWork,
                                        mlp_matrices, mlp_saves, mlp_rank_parameters, mlp_weights)


class DenseMLP(MLPKind):
    """``dense``: fc1 (gate and up with SwiGLU) column-parallel, fc2 row-parallel, of width --ffn-hidden-size."""

    name = "dense"
    module = "meshtron.layers.mlp:MLP"
    #: Hugging Face ``mlp.<name>`` -> meshtron ``mlp.<name>`` (Llama-style gated MLPs).
    hf_names = {"gate_proj.weight": "gate.weight", "up_proj.weight": "up.weight", "down_proj.weight": "down.weight"}

    def build(self, cfg, ctx, index: int, prefix: str, sequence_parallel: bool):
        return self.module_class()(cfg, ctx, prefix, sequence_parallel)

    def parameters(self, m: ModelConfig) -> Counts:
        F = ffn_size(m)
        weights = mlp_weights(m, F)
        biases = ((2 * F if m.swiglu else F) + m.hidden_size) if not m.disable_bias_linear else 0
        return Counts(total=weights + biases, matmul=weights)

    def rank_parameters(self, m: ModelConfig, tp: int, ep: int, expert_tp: int) -> RankParameters:
        return RankParameters(dense=mlp_rank_parameters(m, ffn_size(m), tp))

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        return mlp_matrices(m, ffn_size(m))

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        if "norm" not in s.selective and not s.rowwise_fp8:
            s.rep += s.lin * s.h  # the second norm's output (fc1's input)
            s.part += s.gathered  # ... and the rest of its all-gathered sequence
        s.part += mlp_saves(m, s, ffn_size(m), s.tp, s.fp8)

    def backward_working_bytes(self, m: ModelConfig, e: int, tp: int, expert_tp: int) -> float:
        return (3 if m.swiglu else 2) * e * ffn_size(m) / tp

    def fp8_weight_elements(self, m: ModelConfig, tp: int, fc2_recast: bool) -> float:
        f = ffn_size(m)
        return m.hidden_size * ((2 if fc2_recast else 3) * f if m.swiglu else 2 * f) / tp

    def step_work(self, m: ModelConfig, x: StepInputs) -> StepWork:
        h, f, tp, tokens, e = m.hidden_size, ffn_size(m), x.tp, x.tokens, x.e
        fan_in = 2 * f if m.swiglu else f
        mlp = x.gemm(2 * tokens * h * fan_in / tp, x.fp8) + x.gemm(2 * tokens * f / tp * h, x.fp8)
        recompute = 0.0
        if x.fc2_recomputes:
            # fc2's backward recomputes SwiGLU's product from gate and up; in FP8 also the product's casts
            # (read bf16, write two FP8 layouts), and before revision 2 the weight's (since, every FP8
            # linear's weight recast is counted with the others' by the layer).
            weight_recast = 4 * h * f / tp if x.fp8 and x.saves < 2 else 0.0
            recompute = tokens * (e * 3 + (4 if x.fp8 else 0)) * f / tp + weight_recast
        return StepWork(fwd_gemm=mlp, wgrad=mlp, elementwise=tokens * e * 3 * f / tp,
                        recompute_elementwise=recompute, fp8_cast_width=f if x.fp8 else 0)


DENSE = DenseMLP()
