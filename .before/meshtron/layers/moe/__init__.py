"""Mixture of experts: router, token dispatch (expert parallelism), grouped experts, MoE layer.

See docs/moe.md for the definitions (routing, losses, capacity) and the parallel layout.
"""

from meshtron.layers.moe.layer import MoELayer, make_moe_mlp, moe_mlp_factory
from meshtron.layers.moe.router import Routing, TopKRouter, capacity_mask, expert_capacity, select_experts
from meshtron.layers.moe.training import MoETrainingHooks, moe_layers, set_aux_loss_scale

__all__ = ["MoELayer", "MoETrainingHooks", "Routing", "TopKRouter", "capacity_mask", "expert_capacity",
           "make_moe_mlp", "moe_layers", "moe_mlp_factory", "select_experts", "set_aux_loss_scale"]
