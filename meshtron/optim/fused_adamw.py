"""One AdamW step of an fp32 master tensor that also writes the low-precision model weights.

torch's fused AdamW updates the masters and moments in one pass, but the weights the model computes
with (bf16) then need a second pass that reads every master again. This Triton kernel writes them in
the same pass: on an H200, 26.3 against 35.2 ms (fused AdamW + copy) for llama3-3b's 3.6B parameters
(benchmarks/optimizer_probe.py). The arithmetic is AdamW's as torch implements it (decoupled weight
decay first, then the bias-corrected update), with IEEE-rounded division and square root; results
agree with torch's AdamW to rounding (a few units in the last place of the weights), and bit for bit with
:func:`reference_step_` run on the same GPU: every operation is rounded on its own (no fused multiply-adds).

The moments may be stored in bf16 (``--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16``): they are read into fp32, the update is computed in fp32 from the fp32
values, and only what is stored is rounded. The gradients may be bf16 too (``--main-grads-dtype bf16``, or
``--grad-reduce-in-bf16``): the kernel reads them as they are and computes with their fp32 values, with no fp32
copy of them first. :func:`reference_step_` is the same arithmetic in torch operations, for devices without
Triton (and the tests).

CUDA with Triton only; :func:`available` says whether a tensor can take this path.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

from meshtron.config import OptimConfig

_BLOCK = 2048


def available(tensor: torch.Tensor) -> bool:
    """Whether the fused kernel can step ``tensor`` (a CUDA tensor, Triton installed)."""
    return triton is not None and tensor.is_cuda


def adamw_step_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                weights: Optional[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, grad_coef: Optional[torch.Tensor] = None) -> None:
    """Update ``master``, ``exp_avg`` and ``exp_avg_sq`` in place for step number ``step`` (1 for the
    first), using ``grad`` multiplied by ``grad_coef`` (a one-element fp32 device tensor) when given,
    and write the new master into ``weights`` (any float dtype; None: no copy). All tensors are
    contiguous with the same number of elements; master is fp32, grad and the moments fp32 or bf16."""
    n = master.numel()
    if n == 0:
        return
    tensors = (master, grad, exp_avg, exp_avg_sq) + ((weights,) if weights is not None else ())
    if any(not t.is_contiguous() or t.numel() != n for t in tensors):
        raise ValueError("adamw_step_: master, gradient, moments and weights must be contiguous and of one size")
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    coef = grad_coef if grad_coef is not None else master  # unread without HAS_COEF
    out = weights if weights is not None else master       # unwritten without HAS_OUT
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, out, coef, n, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        1.0 - lr * weight_decay, lr / bias1, bias2_sqrt,
        HAS_COEF=grad_coef is not None, HAS_OUT=weights is not None, BLOCK=_BLOCK,
        # No contraction of a multiply and an add into one fused multiply-add: which pairs the compiler
        # fuses depends on how it orders the instructions, and that differs between the bf16- and the
        # fp32-gradient variants of the kernel (their masters differed in the last place after three
        # steps). Rounded after every operation, the kernel equals :func:`reference_step_` bit for bit;
        # the step is memory-bound, so the extra instructions cost nothing measurable.
        enable_fp_fusion=False)


@torch.no_grad()
def reference_step_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    weights: Optional[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, grad_coef: Optional[torch.Tensor] = None) -> None:
    """:func:`adamw_step_`'s arithmetic in torch operations (any device; moments fp32 or bf16)."""
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    g = grad.float()  # a copy only where the gradient is bf16
    g = g * grad_coef if grad_coef is not None else g
    m = exp_avg.float() * beta1 + (1.0 - beta1) * g
    v = exp_avg_sq.float() * beta2 + (1.0 - beta2) * g * g
    master.mul_(1.0 - lr * weight_decay)
    # Divided by a one-element device tensor, not a Python number: torch's CUDA division by a scalar multiplies
    # by its reciprocal (another rounding), the kernel divides.
    bias2 = torch.tensor([bias2_sqrt], dtype=torch.float32, device=v.device)
    master.sub_((lr / bias1) * m / (v.sqrt().div_(bias2).add_(eps)))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if weights is not None:
        weights.copy_(master)


def step_tensors(items: Sequence[tuple[torch.Tensor, torch.Tensor, dict, Optional[torch.Tensor], bool]],
                 cfg: OptimConfig, lr: float, step: int, grad_coef: Optional[torch.Tensor]) -> None:
    """One AdamW step of every (master, fp32 or bf16 gradient, torch AdamW state dict, weights or None, decays)
    item, and the state's step counters advanced (they stay true for checkpoints and torch's AdamW).
    The Triton kernel where it is available, :func:`reference_step_` elsewhere."""
    for master, grad, state, weights, decays in items:
        update = adamw_step_ if available(master) else reference_step_
        update(master, grad, state["exp_avg"], state["exp_avg_sq"], weights, lr=lr, beta1=cfg.adam_beta1,
               beta2=cfg.adam_beta2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay if decays else 0.0,
               step=step, grad_coef=grad_coef)
    torch._foreach_add_([item[2]["step"] for item in items], 1.0)


if triton is not None:

    @triton.jit
    def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, n, beta1, one_minus_beta1,
                      beta2, one_minus_beta2, eps, decay_keep, step_size, bias2_sqrt,
                      HAS_COEF: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_COEF:
            grad = grad * tl.load(coef_ptr)
        # 1 - beta comes from the host in double precision: 1 - 0.999 rounded after the subtraction, not
        # before it (in fp32 it would be 1.3e-5 off).
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32) * beta1 + one_minus_beta1 * grad
        v = (tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32) * beta2
             + one_minus_beta2 * grad * grad)
        w = tl.load(master_ptr + offs, mask=mask, other=0.0) * decay_keep
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        w = w - tl.div_rn(step_size * m, denom)
        tl.store(master_ptr + offs, w, mask=mask)
        tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask)
