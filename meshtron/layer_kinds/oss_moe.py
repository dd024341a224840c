"""gpt-oss's mixture of experts: a router with a bias, experts with biases and the clamped SwiGLU
(:class:`meshtron.layers.gpt_oss_mlp.ClampedSwiGLUMoE`)'s numbers."""

from __future__ import annotations

from typing import Optional

from meshtron.config import ModelConfig
from meshtron.layer_kinds.base import Counts, RankParameters
from meshtron.layer_kinds.moe import MixtureOfExperts


class ClampedSwiGLUMixture(MixtureOfExperts):
    """``oss_moe``: ``moe``'s experts and routing (top --moe-router-topk logits, softmax over them), the router
    with a bias, each expert's activation ``(up + 1) * gate * sigmoid(alpha * gate)`` on gate and up clamped at
    --swiglu-clamp-limit, expert biases unless --disable-bias-linear, no shared expert. Its saved bytes and
    step work are ``moe``'s (the experts' output biases keep it off the weighted-activation path)."""

    name = "oss_moe"
    module = "meshtron.layers.gpt_oss_mlp:ClampedSwiGLUMoE"

    def check(self, m: ModelConfig) -> Optional[str]:
        if not m.num_experts:
            return "oss_moe layers need --num-experts"
        if not m.swiglu:
            return "oss_moe layers need --swiglu (their experts are gated)"
        if m.moe_shared_expert_intermediate_size:
            return "oss_moe layers have no shared expert (--moe-shared-expert-intermediate-size)"
        if m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax or m.moe_router_enable_expert_bias \
                or m.moe_router_num_groups or m.moe_router_topk_scaling_factor or m.moe_expert_capacity_factor:
            return ("oss_moe layers route by softmax over the top-k biased logits, without --moe-router-pre-softmax, "
                    "an expert bias, groups, scaling or a capacity factor")
        if m.moe_router_load_balancing_type == "seq_aux_loss" or m.moe_z_loss_coeff \
                or m.moe_router_force_load_balancing:
            return ("oss_moe layers' router has the load-balancing loss only (not seq_aux_loss, --moe-z-loss-coeff "
                    "or --moe-router-force-load-balancing)")
        if not m.swiglu_clamp_limit > 0:
            return f"oss_moe layers need a positive --swiglu-clamp-limit, got {m.swiglu_clamp_limit}"
        return None

    def parameters(self, m: ModelConfig) -> Counts:
        moe = super().parameters(m)
        return Counts(total=moe.total + m.num_experts, matmul=moe.matmul, inactive=moe.inactive)  # router bias

    def rank_parameters(self, m: ModelConfig, tp: int, ep: int, expert_tp: int) -> RankParameters:
        moe = super().rank_parameters(m, tp, ep, expert_tp)
        return RankParameters(dense=moe.dense + m.num_experts, expert=moe.expert)


OSS_MOE = ClampedSwiGLUMixture()
