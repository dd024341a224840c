"""What the training loop does for mixture-of-experts layers around each step.

* the router losses of a micro-batch are weighted ``1 / (micro-batches x DP)``, so that
  their gradient is that of their mean over the iteration (like the LM loss);
* after each applied step, the aux-loss-free expert bias moves by the step's expert
  load, summed over every micro-batch and data-parallel (x context-parallel) rank;
* at logging time, the router losses and the expert load are reduced over ranks.

Metrics (added to the train record of the metrics file):

* ``aux_loss``: the load-balancing loss as it enters the objective (coefficient
  included), summed over MoE layers, averaged over the micro-batches of the logging
  interval and over data-parallel ranks; 0 when load balancing is off;
* ``z_loss``: the same for the router z-loss (only when ``--moe-z-loss-coeff`` is set);
* ``expert_load_min`` / ``expert_load_max``: over every MoE layer and expert, the
  tokens routed to the expert in the interval divided by the mean over that layer's
  experts (1.0 everywhere is perfect balance; max = E/k when one expert takes all).

Every rank must call :meth:`MoETrainingHooks.metrics` at the same iterations (it
reduces over the data-parallel and pipeline groups).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.config import ModelConfig
from meshtron.layers.moe.aux_losses import update_expert_bias
from meshtron.layers.moe.layer import MoELayer
from meshtron.parallel.context import ParallelContext

_NONE = -1e30  # identity of the max-reduction for stages without MoE layers


def moe_layers(model_chunks: Sequence[nn.Module]) -> list[MoELayer]:
    """Every MoE layer of this rank's model chunks, in chunk then layer order."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(model_chunks: Sequence[nn.Module], scale: float) -> None:
    """Weight of each micro-batch's router losses in the backward pass."""
    for layer in moe_layers(model_chunks):
        layer.aux_loss_scale = scale


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class MoETrainingHooks:
    """Loss scaling, expert-bias updates and metrics for the MoE layers of ``model_chunks``."""

    def __init__(self, model_chunks: Sequence[nn.Module], ctx: ParallelContext, num_micro_batches: int,
                 model_cfg: ModelConfig):
        self.ctx = ctx
        self.layers = moe_layers(model_chunks)
        self.report_z_loss = bool(model_cfg.moe_z_loss_coeff)
        set_aux_loss_scale(model_chunks, 1.0 / (num_micro_batches * ctx.dp))
        self.bias_layers = [m for m in self.layers if m.router.expert_bias is not None]

    @torch.no_grad()
    def after_step(self, applied: bool = True) -> None:
        """Update the expert biases from this step's load (when the optimizer step was applied)."""
        if not self.bias_layers:
            return
        if applied:
            counts = _all_reduce(torch.stack([m.step_tokens for m in self.bias_layers]), self.ctx.dp_cp_group)
            for m, c in zip(self.bias_layers, counts):
                update_expert_bias(m.router.expert_bias, c, m.router.bias_update_rate)
        for m in self.bias_layers:
            m.step_tokens.zero_()

    @torch.no_grad()
    def metrics(self) -> dict:
        """The MoE entries of a train record since the last call (see the module doc); resets the statistics."""
        ctx = self.ctx
        losses = torch.zeros(2, device=ctx.device)
        extremes = torch.full((2,), _NONE, device=ctx.device)  # [max ratio, -min ratio]
        if self.layers:
            calls = torch.stack([m.calls for m in self.layers]).clamp(min=1)
            per_layer = torch.stack([torch.stack([m.aux_sum for m in self.layers]),
                                     torch.stack([m.z_sum for m in self.layers])]) / calls
            counts = torch.stack([m.load_tokens for m in self.layers])
            packed = _all_reduce(torch.cat([per_layer.sum(1), counts.flatten()]), ctx.dp_cp_group)
            losses = packed[:2] / ctx.dp
            counts = packed[2:].view_as(counts)
            mean = counts.mean(1, keepdim=True)
            used = mean.squeeze(1) > 0
            if bool(used.any()):
                ratio = counts[used] / mean[used]
                extremes = torch.stack([ratio.max(), -ratio.min()])
            for m in self.layers:
                for buf in (m.load_tokens, m.aux_sum, m.z_sum, m.calls):
                    buf.zero_()
        losses = _all_reduce(losses, ctx.pp_group)
        extremes = _all_reduce(extremes, ctx.pp_group, dist.ReduceOp.MAX)
        values = torch.cat([losses, extremes]).tolist()
        out = {"aux_loss": values[0]}
        if self.report_z_loss:
            out["z_loss"] = values[1]
        if values[2] > _NONE / 2:
            out["expert_load_min"] = -values[3]
            out["expert_load_max"] = values[2]
        return out
