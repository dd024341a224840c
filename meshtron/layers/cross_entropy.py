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

import functools
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.layers.fused import compiled_on_cuda
from meshtron.parallel.comm import Group, group_size

# Chunk so that one chunk's logits stay near this many elements (2^30: 2 GiB of bf16 logits).
CHUNK_ELEMENTS = 1 << 30


def chunk_size(tokens: int, vocab_local: int) -> int:
    """Tokens per chunk: as many equal chunks as keep each chunk's logits near ``CHUNK_ELEMENTS``
    (equal chunks compile to one kernel shape)."""
    largest = max(256, CHUNK_ELEMENTS // max(1, vocab_local))
    count = -(-tokens // largest)
    return max(1, -(-tokens // count))


# The element-wise work of a chunk is split in two pure functions around the TP reductions, each
# reading the logits once; on CUDA they are compiled into fused kernels.
def _masked(logits: torch.Tensor, valid_cols: int) -> torch.Tensor:
    x = logits.float()
    if valid_cols < x.shape[-1]:  # vocabulary padding: no probability mass
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= valid_cols, float("-inf"))
    return x


def _local_stats(logits: torch.Tensor, local_t: torch.Tensor, outside: torch.Tensor,
                 valid_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of this rank's vocabulary block: each row's maximum, the sum of exp(logit - maximum), and the
    target's logit (0 where another rank holds the target). A block of padding columns only (tiny
    vocabularies under TP) has maximum -inf and sum 0."""
    x = _masked(logits, valid_cols)
    row_max = x.amax(dim=-1)
    finite_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # -inf - -inf would be nan
    sum_exp = (x - finite_max.unsqueeze(-1)).exp().sum(dim=-1)
    target = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return row_max, sum_exp, target


def _loss(row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor) -> torch.Tensor:
    """-log softmax at the target: log(sum exp(x - max)) + max - x_target."""
    return sum_exp.log() + row_max - target_logit


def _loss_and_grad(logits: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor,
                   local_t: torch.Tensor, outside: torch.Tensor, weight: torch.Tensor,
                   valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and d(sum w * loss)/d logits = w * (softmax - onehot(target)) in the logits' dtype."""
    x = _masked(logits, valid_cols)
    cols = torch.arange(x.shape[-1], device=x.device)
    # One reciprocal per row and a multiply per element (a division per element costs more).
    softmax = (x - row_max.unsqueeze(-1)).exp() * sum_exp.reciprocal().unsqueeze(-1)
    onehot = (cols == local_t.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    grad = (softmax - onehot.float()) * weight.unsqueeze(-1)
    return _loss(row_max, sum_exp, target_logit), grad.to(logits.dtype)


def _scaled_weight_grad(grad_weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad_weight * scale`` (the fp32 sum times the upstream gradient) rounded once to ``dtype``."""
    return (grad_weight * scale).to(dtype)


_local_stats_fast = compiled_on_cuda(_local_stats)
_loss_and_grad_fast = compiled_on_cuda(_loss_and_grad)
# One pass that reads the fp32 sum and writes the weight's dtype: no fp32 product of the output weight's
# size next to the forward's activations as backward starts, and no second pass to scale the cast copy.
_scaled_weight_grad_fast = compiled_on_cuda(_scaled_weight_grad)


def _chunk_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_cols: int, group: Group):
    """Row max, sum of exp(logit - max) and target logit of a chunk over the whole vocabulary (reduced
    over TP), and the local target index with the mask of targets outside this rank's block."""
    cols = logits.shape[-1]
    outside = (target < vocab_start) | (target >= vocab_start + cols)
    local_t = (target - vocab_start).masked_fill(outside, 0)
    row_max, sum_exp, target_logit = _local_stats_fast(logits, local_t, outside, valid_cols)
    if group_size(group) > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # Each block's sum rescaled to the common maximum (a padding-only block: 0 * exp(-inf) = 0).
        both = torch.stack([sum_exp * (row_max - global_max).exp(), target_logit])
        dist.all_reduce(both, group=group)
        row_max, sum_exp, target_logit = global_max, both[0], both[1]
    return row_max, sum_exp, target_logit, local_t, outside


def _add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += grad_logits^T @ h`` into the fp32 sum.

    With bf16 operands on CUDA the GEMM adds its fp32 product to the sum in its epilogue (reads and writes
    the sum once, 8 bytes per weight element and chunk), where a bf16 product added afterwards rounds each
    chunk's product to bf16 and costs 12 bytes and a second kernel (about 1 ms per chunk for a 151,936 x
    2048 output layer on an H200). Other cases add a product of the operands' dtype."""
    if h.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), h)
    elif h.is_cuda and _gemm_accumulates_in_fp32(h.device):
        torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.add_(grad_logits.t() @ h)


@functools.lru_cache(maxsize=None)
def _gemm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether this torch build's ``addmm`` takes bf16 operands with an fp32 sum and output on ``device``
    (``out_dtype``; some builds accept only a sum in the operands' dtype). Asked once per device."""
    a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    acc = torch.ones(16, 16, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool((acc == 17).all())


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
                _add_weight_grad(grad_weight, grad_logits, h)
            else:
                loss = _loss(row_max, sum_exp, target_logit)
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
        # The saved tensors stay untouched (a second backward with retain_graph reads them).
        if grad_weight.dtype == ctx.weight_dtype:  # fp32 weights: the sum is already the weight's dtype
            weight_grad = grad_weight * grad_weighted
        else:
            weight_grad = _scaled_weight_grad_fast(grad_weight, grad_weighted.float(), ctx.weight_dtype)
        return (grad_hidden * grad_weighted.to(grad_hidden.dtype), weight_grad,
                None, None, None, None, None, None)


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
    chunk = chunk_tokens or chunk_size(hidden.shape[0], weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, target, loss_weight.float(), vocab_start, valid_cols, group,
                                     chunk)


def vocab_parallel_logits_loss(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_cols: int,
                               group: Group = None) -> torch.Tensor:
    """Per-token loss from already computed logits (no gradient; used by evaluation tools and tests)."""
    with torch.no_grad():
        row_max, sum_exp, target_logit, _, _ = _chunk_stats(logits, target, vocab_start, valid_cols, group)
    return _loss(row_max, sum_exp, target_logit)
