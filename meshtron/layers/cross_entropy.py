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

# Chunk so that one chunk's logits stay near this many elements (2^30: 2 GiB of bf16 logits).
_CHUNK_ELEMENTS = 1 << 30
CHUNK_ELEMENTS = _CHUNK_ELEMENTS


# The element-wise work of a chunk is split in three pure functions around the two TP reductions,
# each reading the logits once; on CUDA they are compiled into single fused kernels.
def _row_max(logits: torch.Tensor, valid_cols: int) -> torch.Tensor:
    x = logits.float()
    if valid_cols < x.shape[-1]:  # vocabulary padding: no probability mass
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= valid_cols, float("-inf"))
    return x.amax(dim=-1)


def _sum_exp_and_target(logits: torch.Tensor, row_max: torch.Tensor, local_t: torch.Tensor, outside: torch.Tensor,
                        valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float() - row_max.unsqueeze(-1)
    if valid_cols < x.shape[-1]:
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= valid_cols, float("-inf"))
    sum_exp = x.exp().sum(dim=-1)
    target = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return sum_exp, target


def _loss_and_grad(logits: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor,
                   local_t: torch.Tensor, outside: torch.Tensor, weight: torch.Tensor,
                   valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and d(sum w * loss)/d logits = w * (softmax - onehot(target)) in the logits' dtype."""
    x = logits.float() - row_max.unsqueeze(-1)
    cols = torch.arange(x.shape[-1], device=x.device)
    if valid_cols < x.shape[-1]:
        x = x.masked_fill(cols >= valid_cols, float("-inf"))
    loss = sum_exp.log() - target_logit
    softmax = x.exp() / sum_exp.unsqueeze(-1)
    onehot = (cols == local_t.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    grad = (softmax - onehot.float()) * weight.unsqueeze(-1)
    return loss, grad.to(logits.dtype)


def _compiled(fn):
    """torch.compile'd ``fn`` where it pays (CUDA); the plain function elsewhere."""
    cache = {}

    def call(*args):
        if not args[0].is_cuda:
            return fn(*args)
        if "fn" not in cache:
            cache["fn"] = torch.compile(fn, dynamic=True)
        return cache["fn"](*args)

    return call


_row_max_fast = _compiled(_row_max)
_sum_exp_and_target_fast = _compiled(_sum_exp_and_target)
_loss_and_grad_fast = _compiled(_loss_and_grad)


def _chunk_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_cols: int, group: Group):
    """Row max, sum of exponentials and target logit of a chunk, reduced over TP."""
    cols = logits.shape[-1]
    outside = (target < vocab_start) | (target >= vocab_start + cols)
    local_t = (target - vocab_start).masked_fill(outside, 0)
    row_max = _row_max_fast(logits, valid_cols)
    if _size(group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp, target_logit = _sum_exp_and_target_fast(logits, row_max, local_t, outside, valid_cols)
    if _size(group) > 1:
        both = torch.stack([sum_exp, target_logit])
        dist.all_reduce(both, group=group)
        sum_exp, target_logit = both[0], both[1]
    return row_max, sum_exp, target_logit, local_t, outside


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
            logits = h @ weight.t()
            row_max, sum_exp, target_logit, local_t, outside = _chunk_stats(
                logits, target[start:start + chunk], vocab_start, valid_cols, group)
            if need_grad:
                loss, grad_logits = _loss_and_grad_fast(logits, row_max, sum_exp, target_logit, local_t, outside,
                                                        loss_weight[start:start + chunk], valid_cols)
                del logits
                grad_hidden[start:start + chunk] = grad_logits @ weight
                if h.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t() @ h)
            else:
                loss = sum_exp.log() - target_logit
            losses[start:start + chunk] = loss
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
    with torch.no_grad():
        _, sum_exp, target_logit, _, _ = _chunk_stats(logits, target, vocab_start, valid_cols, group)
    return sum_exp.log() - target_logit
