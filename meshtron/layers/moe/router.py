"""Top-k token routing: scores, expert selection, capacity dropping, router losses.

Selection (``--moe-router-score-function``, ``--moe-router-pre-softmax``; Megatron-LM's rules):

* softmax, default: the top-k logits are chosen and the combine weights are the softmax
  over those k logits (they sum to 1; Mixtral);
* softmax with ``--moe-router-pre-softmax``: softmax over all experts, then the top-k of
  those probabilities, kept unnormalised (DeepSeek-MoE);
* sigmoid: sigmoid scores, top-k of them, weights normalised to sum to 1 when k > 1
  (DeepSeek-V3).

``--moe-router-num-groups`` / ``--moe-router-group-topk`` limit each token's choice to the best
few groups of experts (DeepSeek-V3's group-limited routing, :func:`top_experts`), and
``--moe-router-topk-scaling-factor`` multiplies the chosen weights.

With ``--moe-router-enable-expert-bias`` the choice uses score + bias (the softmax over
all experts, or the sigmoid score), while the weights stay those of the unbiased
scores; the bias is a buffer updated after each step from the expert load
(:func:`~meshtron.layers.moe.aux_losses.update_expert_bias`), never by gradients.

Capacity (``--moe-expert-capacity-factor``, Megatron's definition): each expert takes
at most ``ceil(T * k / E * factor)`` of the T tokens of the micro-batch held by this
rank; an expert with more assignments keeps those of highest combine weight (ties: the
earlier token) and drops the rest. A dropped assignment contributes nothing to the
token's output (the residual connection still carries the token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.layers.moe.aux_losses import load_balancing_loss, sequence_load_balancing_loss, z_loss
from meshtron.layers.moe.buffers import Fp32BufferModule
from meshtron.parallel.sharding import SPEC_ATTR, Piece, ShardSpec, new_param, whole


@dataclass
class Routing:
    """The router's decision for T tokens.

    ``probs`` [T, k] combine weights (fp32, zero where dropped); ``indices`` [T, k] expert ids;
    ``keep`` [T, k] bool or None when nothing can be dropped; ``tokens_per_expert`` [E] routed
    assignments before dropping; ``capacity``: assignments each expert accepts from these tokens
    (None without a capacity factor); ``aux_loss``/``z_loss``: this rank's share of the losses
    (None when off or not training).
    """

    probs: torch.Tensor
    indices: torch.Tensor
    keep: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor
    capacity: Optional[int] = None
    aux_loss: Optional[torch.Tensor] = None
    z_loss: Optional[torch.Tensor] = None


def select_experts(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                   expert_bias: Optional[torch.Tensor] = None, groups: Optional[tuple[int, int]] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(combine weights [T, k], expert indices [T, k]) from fp32 ``logits`` [T, E]; see the module doc.

    ``groups`` = (number of groups, groups per token): group-limited routing (see :func:`top_experts`).
    """
    if score_function == "softmax":
        if pre_softmax or expert_bias is not None or groups is not None:
            scores = torch.softmax(logits, dim=-1)
            choice = scores if expert_bias is None else scores + expert_bias
            indices = top_experts(choice, topk, groups)
            if pre_softmax:
                return scores.gather(1, indices), indices
            return torch.softmax(logits.gather(1, indices), dim=-1), indices
        top, indices = torch.topk(logits, topk, dim=-1)
        return torch.softmax(top, dim=-1), indices
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        indices = top_experts(choice, topk, groups)
        probs = scores.gather(1, indices)
        if topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        return probs, indices
    raise ValueError(f"--moe-router-score-function must be softmax or sigmoid, got {score_function!r}")


def forced_balanced_logits(logits: torch.Tensor, skew: float = 0.0) -> torch.Tensor:
    """``--moe-router-force-load-balancing``: standard normal values in place of ``logits`` (every expert equally
    likely), with the gradient still flowing to the real logits as if they had been used: the router's cost and
    its backward stay those of a trained run, only the choice no longer depends on the tokens.
    ``skew`` (``--moe-router-force-skew`` S) shifts expert e's value by -S ln(e + 1): hot experts first."""
    noise = torch.randn_like(logits)
    if skew:
        ranks = torch.arange(1, logits.shape[-1] + 1, device=logits.device, dtype=logits.dtype)
        noise = noise - skew * torch.log(ranks)
    return logits + (noise - logits).detach()


def top_experts(choice: torch.Tensor, topk: int, groups: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Indices [T, k] of the ``topk`` largest ``choice`` [T, E] values.

    With ``groups`` = (G, g) (``--moe-router-num-groups``, ``--moe-router-group-topk``; DeepSeek-V3's
    group-limited routing) the E experts form G groups of E/G consecutive experts, each group scores
    the sum of its best ``topk // g`` choice values, and a token picks its k experts only among the g
    best groups (with G = the expert-parallel size, a token's experts then live on at most g ranks).
    """
    if groups is not None:
        num_groups, group_topk = groups
        T, E = choice.shape
        group_score = choice.view(T, num_groups, E // num_groups).topk(topk // group_topk, dim=-1).values.sum(-1)
        best = group_score.topk(group_topk, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    return torch.topk(choice, topk, dim=-1).indices


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Scores over all experts that sum to 1 per token (softmax, or sigmoid normalised)."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments an expert accepts: ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def capacity_mask(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: which assignments fit their expert's ``capacity`` (highest weight first, ties by token)."""
    flat_e = indices.reshape(-1)
    n = flat_e.numel()
    by_weight = torch.argsort(-probs.reshape(-1), stable=True)  # descending weight; equal weights keep token order
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # grouped by expert, weight order inside
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=flat_e.device) - starts[flat_e[order]]
    keep = torch.empty(n, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(indices)


class TopKRouter(Fp32BufferModule):
    """Linear gate [E, H] (replicated over TP), scores, top-k choice, capacity and losses.

    ``expert_bias`` (with --moe-router-enable-expert-bias) is a persistent fp32 buffer
    carrying a :class:`ShardSpec` (canonical name ``<prefix>.expert_bias``) like a parameter.
    """

    def __init__(self, cfg: ModelConfig, prefix: str, cp_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        E, H = cfg.num_experts, cfg.hidden_size
        self.num_experts, self.topk = E, cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.balancing = cfg.moe_router_load_balancing_type
        self.aux_coeff = cfg.moe_aux_loss_coeff or 0.0
        self.z_coeff = cfg.moe_z_loss_coeff or 0.0
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.topk_scaling_factor = cfg.moe_router_topk_scaling_factor
        self.groups = ((cfg.moe_router_num_groups, cfg.moe_router_group_topk)
                       if cfg.moe_router_num_groups is not None else None)
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.cp_group = cp_group
        self.force_balance = cfg.moe_router_force_load_balancing
        self.force_skew = cfg.moe_router_force_skew
        self.weight = new_param(ShardSpec((whole(f"{prefix}.weight", (E, H), std=cfg.init_method_std),),
                                          tp_replicated=True))
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
            setattr(self.expert_bias, SPEC_ATTR,
                    ShardSpec((Piece(f"{prefix}.expert_bias", (E,), 0, 0, E, "zeros"),), tp_replicated=True))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor, batch: int) -> Routing:
        """Route ``tokens`` [T, H] (T = seq x ``batch`` in [seq, batch] order)."""
        logits = F.linear(tokens.float(), self.weight.float())  # routing in fp32 whatever the compute dtype
        if self.force_balance:
            logits = forced_balanced_logits(logits, self.force_skew)
        probs, indices = select_experts(logits, self.topk, self.score_function, self.pre_softmax, self.expert_bias,
                                        self.groups)
        if self.topk_scaling_factor is not None:
            probs = probs * self.topk_scaling_factor
        tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        keep, cap = None, None
        if self.capacity_factor is not None:
            cap = expert_capacity(tokens.shape[0], self.topk, self.num_experts, self.capacity_factor)
            keep = capacity_mask(indices, probs, self.num_experts, cap)
            probs = probs * keep
        routing = Routing(probs, indices, keep, tokens_per_expert, cap)
        if self.training and torch.is_grad_enabled():
            if self.balancing != "none" and self.aux_coeff > 0:
                scores = scores_for_aux_loss(logits, self.score_function)
                if self.balancing == "seq_aux_loss":
                    routing.aux_loss = sequence_load_balancing_loss(
                        scores, indices, batch, self.topk, self.aux_coeff, self.cp_group)
                else:
                    routing.aux_loss = load_balancing_loss(
                        scores, tokens_per_expert, self.topk, self.aux_coeff, self.cp_group)
            if self.z_coeff > 0:
                routing.z_loss = z_loss(logits, self.z_coeff, self.cp_group)
        return routing
