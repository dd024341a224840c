"""The output projection fused with a vocabulary-parallel cross-entropy.

``linear_cross_entropy`` never materialises the logits of a whole micro-batch: it
walks the tokens in chunks, and for each chunk computes the logits, the loss, and
(when training) the gradient with respect to the logits, which it turns at once
into gradients of the hidden states and of the output weight. Because the loss
weights (loss mask / token count of the global batch) are known in the forward
pass, the backward pass only scales these stored gradients.

Under tensor parallelism each rank holds a block of the vocabulary; the maximum,
the sum of exponentials and the target logit are reduced over TP, so the full
logits are never gathered. Vocabulary padding columns get no probability mass.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from meshtron.parallel.comm import Group, _size

# Chunk so that one chunk's fp32 logits stay near this many elements (1 GiB).
_CHUNK_ELEMENTS = 1 << 28


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_cols: int,
                group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss of one chunk; returns (loss, softmax, local target, target-outside-mask)."""
    logits = logits.float()
    cols = logits.shape[-1]
    if valid_cols < cols:  # vocabulary padding on this rank: no probability mass
        logits[..., valid_cols:] = float("-inf")
    tp = _size(group)
    row_max = logits.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(row_max.unsqueeze(-1))
    exp = logits.exp()
    sum_exp = exp.sum(dim=-1)
    outside = (target < vocab_start) | (target >= vocab_start + cols)
    local_t = (target - vocab_start).masked_fill(outside, 0)
    target_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    if tp > 1:
        both = torch.stack([sum_exp, target_logit])
        dist.all_reduce(both, group=group)
        sum_exp, target_logit = both[0], both[1]
    loss = sum_exp.log() - target_logit
    softmax = exp.div_(sum_exp.unsqueeze(-1))
    return loss, softmax, local_t, outside


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, loss_weight, vocab_start, valid_cols, group, chunk):
        n = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            loss, softmax, local_t, outside = _chunk_loss(h @ weight.t(), target[start:start + chunk],
                                                          vocab_start, valid_cols, group)
            losses[start:start + chunk] = loss
            if need_grad:
                # d(sum w_i * loss_i)/d logits = w_i * (softmax - onehot(target))
                grad_logits = softmax
                grad_logits.scatter_add_(-1, local_t.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
                grad_logits.mul_(loss_weight[start:start + chunk].unsqueeze(-1))
                grad_logits = grad_logits.to(hidden.dtype)
                grad_hidden[start:start + chunk] = grad_logits @ weight
                if h.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t() @ h)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        weighted = (losses * loss_weight).sum()
        ctx.mark_non_differentiable(losses)
        return weighted, losses

    @staticmethod
    def backward(ctx, grad_weighted, _grad_losses):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_weighted.to(grad_hidden.dtype),
                (grad_weight * grad_weighted).to(ctx.weight_dtype), None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         loss_weight: Optional[torch.Tensor], vocab_start: int, valid_cols: int,
                         group: Group = None, chunk_tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T`` against ``target``, chunked over tokens.

    hidden [N, H], weight [V_local, H] (this rank's vocabulary block starting at
    ``vocab_start``, of which the first ``valid_cols`` columns are real tokens),
    target [N] global ids, loss_weight [N] (e.g. loss_mask / tokens in the global batch).
    Returns (sum of loss_weight * loss, per-token losses [N] without gradient).
    """
    if loss_weight is None:
        loss_weight = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    chunk = chunk_tokens or max(256, _CHUNK_ELEMENTS // max(1, weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, target, loss_weight.float(), vocab_start, valid_cols, group,
                                     chunk)


def vocab_parallel_logits_loss(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_cols: int,
                               group: Group = None) -> torch.Tensor:
    """Per-token loss from already computed logits (no gradient; used by evaluation tools and tests)."""
    loss, _, _, _ = _chunk_loss(logits.detach().clone(), target, vocab_start, valid_cols, group)
    return loss
