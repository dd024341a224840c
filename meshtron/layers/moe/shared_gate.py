"""A mixture of experts whose shared expert's output is scaled per token by a learned sigmoid gate (Qwen3.5-MoE,
the ``moe_gated_shared`` layer kind): ``y = experts(x) + sigmoid(x . w) * shared_expert(x)``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from meshtron.config import ConfigError, ModelConfig
from meshtron.layers.moe.layer import MoELayer
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import ShardSpec, new_param, whole


class GatedSharedExpertMoE(MoELayer):
    """:class:`~meshtron.layers.moe.layer.MoELayer` (router, experts, dispatch, expert parallelism) with a gate
    on its shared expert: canonical tensor ``<prefix>.shared_expert_gate.weight`` [1, hidden], replicated over
    TP. Each TP rank scales its partial sum of the shared expert by the (whole) gate, so the gate's gradient
    is a partial sum over TP (``grad_sync="tp"``)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_index: int, sequence_parallel: bool,
                 grouped_gemm: Optional[bool] = None, prefix: Optional[str] = None):
        if not cfg.moe_shared_expert_intermediate_size:
            raise ConfigError("moe_gated_shared layers need --moe-shared-expert-intermediate-size")
        super().__init__(cfg, ctx, layer_index, sequence_parallel, grouped_gemm, prefix)
        prefix = prefix or f"layers.{layer_index}.mlp"
        self.shared_expert_gate = new_param(ShardSpec(
            (whole(f"{prefix}.shared_expert_gate.weight", (1, cfg.hidden_size), std=cfg.init_method_std),),
            tp_replicated=True, grad_sync="tp" if ctx.tp > 1 else None))

    def _shared_partial(self, tokens: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(F.linear(tokens, self.shared_expert_gate))  # [T, 1]
        return gate * super()._shared_partial(tokens)
