"""Router losses that balance expert load, and how they join the backward pass.

Definitions (E experts, top-k routing, T tokens of a micro-batch, ``s`` the router's
normalised scores over all experts: softmax of the logits, or the sigmoid scores
divided by their sum over experts; ``c_i`` the number of tokens routed to expert i
before any capacity dropping):

* load-balancing loss (``aux_loss``, Switch Transformer / GShard / Megatron-LM):
  ``coeff * E * sum_i f_i * P_i`` with ``f_i = c_i / (k T)`` and ``P_i = sum_t s_ti / T``.
  A perfectly uniform router scores ``coeff``.
* per-sequence variant (``seq_aux_loss``, DeepSeek-V2/V3): the same computed over each
  sequence (its S tokens) and averaged over the sequences of the micro-batch.
* z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``.

With context parallelism each rank holds part of every sequence: token counts are
summed over the context-parallel group and each rank returns its *share* of the loss
(the sum of the shares over the group is the loss of the whole micro-batch); the
gradients of non-expert weights are summed over that group anyway.

The losses enter the backward pass through :func:`attach_aux_loss` on the MoE
layer's output (Megatron's "aux loss auto-scaler"): the output passes unchanged and
the loss receives the gradient ``scale``. This works with every pipeline schedule
and with activation recomputation, since no schedule needs to know about it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from meshtron.parallel import comm

Group = Optional[dist.ProcessGroup]


def _sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) a tensor that carries no gradient (token counts)."""
    return comm.all_reduce(x, group)  # a functional collective: traced faithfully inside compiled layers


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int, coeff: float,
                        cp_group: Group = None) -> torch.Tensor:
    """This rank's share of ``coeff * E * sum_i f_i P_i`` over the micro-batch.

    ``scores`` [T, E] (fp32, normalised over experts), ``tokens_per_expert`` [E] routed counts
    of this rank's T tokens. With ``cp_group`` the counts and T are summed over it.
    """
    num_tokens, num_experts = scores.shape
    counts = _sum_over(tokens_per_expert.to(scores.dtype), cp_group)
    total = num_tokens * comm.group_size(cp_group)
    return (scores.sum(0) * counts).sum() * (coeff * num_experts / (topk * total * total))


def sequence_load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, topk: int, coeff: float,
                                 cp_group: Group = None) -> torch.Tensor:
    """This rank's share of the load-balancing loss per sequence, averaged over the ``batch`` sequences.

    ``scores`` [T, E] and ``indices`` [T, k] in token order ``t = position * batch + sequence``
    (the [seq, batch] layout flattened).
    """
    num_tokens, num_experts = scores.shape
    seq = num_tokens // batch
    per_seq = scores.view(seq, batch, num_experts).sum(0)  # [b, E]
    onehot = torch.zeros(batch, num_experts, dtype=scores.dtype, device=scores.device)
    sequence_of = torch.arange(batch, device=scores.device).repeat(seq).repeat_interleave(topk)
    onehot.index_put_((sequence_of, indices.reshape(-1)), torch.ones((), dtype=scores.dtype, device=scores.device),
                      accumulate=True)
    counts = _sum_over(onehot, cp_group)
    total = seq * comm.group_size(cp_group)
    per_sequence = (per_seq * counts).sum(1) * (num_experts / (topk * total * total))
    return per_sequence.mean() * coeff


def z_loss(logits: torch.Tensor, coeff: float, cp_group: Group = None) -> torch.Tensor:
    """This rank's share of ``coeff * mean_t logsumexp(logits_t)^2`` (logits [T, E], fp32)."""
    total = logits.shape[0] * comm.group_size(cp_group)
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total)


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: the output unchanged. Backward: the output's gradient, and ``scale`` for the loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """Make the backward pass through ``output`` also backpropagate ``scale * aux``.

    ``scale`` turns a per-micro-batch loss into its share of the iteration's objective
    (1 / (micro-batches x data-parallel size): the mean over micro-batches and ranks).
    """
    return _AttachAuxLoss.apply(output, aux, scale)


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): ``b_i += rate * sign(mean_j c_j - c_i)`` in place.

    Under-loaded experts gain bias (more tokens next step), over-loaded ones lose it; an
    expert exactly at the mean keeps its bias. ``tokens_per_expert`` are the counts of the
    whole step (all micro-batches, all data-parallel ranks).
    """
    counts = tokens_per_expert.float()
    bias.add_(torch.sign(counts.mean() - counts) * rate)
