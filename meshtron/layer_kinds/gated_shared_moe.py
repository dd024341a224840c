"""The mixture of experts with a sigmoid-gated shared expert (Qwen3.5-MoE): ``GatedSharedExpertMoE``'s numbers."""

from __future__ import annotations

from typing import Optional

from meshtron.config import ModelConfig
from meshtron.layer_kinds.base import Counts, Matrix, RankParameters, StepInputs, StepWork
from meshtron.layer_kinds.moe import MixtureOfExperts


class GatedSharedMixture(MixtureOfExperts):
    """``moe_gated_shared``: ``moe`` with its shared expert (--moe-shared-expert-intermediate-size) scaled per
    token by ``sigmoid(x . w)``, ``w`` one row of --hidden-size (replicated over TP). Saved bytes and
    backward working set are ``moe``'s (the gate's [tokens, 1] output is left out)."""

    name = "moe_gated_shared"
    module = "meshtron.layers.moe.shared_gate:GatedSharedExpertMoE"

    def check(self, m: ModelConfig) -> Optional[str]:
        if not m.num_experts:
            return "moe_gated_shared layers need --num-experts"
        if not m.moe_shared_expert_intermediate_size:
            return "moe_gated_shared layers need --moe-shared-expert-intermediate-size"
        return None

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        return super().matrices(m) + [Matrix("shared_expert_gate.weight", 1, m.hidden_size)]

    def parameters(self, m: ModelConfig) -> Counts:
        moe = super().parameters(m)
        return Counts(total=moe.total + m.hidden_size, matmul=moe.matmul + m.hidden_size, inactive=moe.inactive)

    def rank_parameters(self, m: ModelConfig, tp: int, ep: int, expert_tp: int) -> RankParameters:
        moe = super().rank_parameters(m, tp, ep, expert_tp)
        return RankParameters(dense=moe.dense + m.hidden_size, expert=moe.expert)

    def step_work(self, m: ModelConfig, x: StepInputs) -> StepWork:
        work = super().step_work(m, x)
        gate = x.gemm(2 * x.tokens * m.hidden_size)  # the gate's [tokens, hidden] x [hidden, 1]
        return StepWork(fwd_gemm=work.fwd_gemm + gate, wgrad=work.wgrad + gate, elementwise=work.elementwise,
                        recompute_elementwise=work.recompute_elementwise, ep_bytes=work.ep_bytes,
                        fp8_cast_width=work.fp8_cast_width)


GATED_SHARED_MOE = GatedSharedMixture()
