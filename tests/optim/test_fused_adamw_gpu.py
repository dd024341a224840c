"""The Triton AdamW step (CUDA): equal to torch's fused AdamW to fp32 rounding, and the optimizer that
uses it equal to the one that steps with torch's kernels, bf16 weights included. Needs CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from meshtron.config import OptimConfig
from meshtron.optim.fused_adamw import adamw_step_
from meshtron.optim.optimizer import MixedPrecisionAdamW


def assert_same_updates(new: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> None:
    """The two optimizers moved the weights alike up to rounding: implementations may round 1 - beta2
    or the bias corrections differently (relative differences ~1e-5 of the update) and the weights
    themselves carry fp32 rounding (~1e-7); a wrong formula is off by a good part of the update."""
    torch.testing.assert_close(new - start, ref - start, rtol=1e-4, atol=3e-7)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kernel_step_equals_torch_fused_adamw():
    g = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(10_001, device="cuda", generator=g)  # not a multiple of the block
    start = master.clone()
    ref = nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    weights = torch.empty(master.shape, device="cuda", dtype=torch.bfloat16)
    for step in (1, 2, 3):
        grad = torch.randn(master.shape, device="cuda", generator=g)
        coef = torch.tensor(0.5 if step == 2 else 1.0, device="cuda")
        ref.grad = grad * coef
        opt.step()
        adamw_step_(master, grad, exp_avg, exp_avg_sq, weights, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                    weight_decay=0.1, step=step, grad_coef=coef)
        assert_same_updates(master, ref.detach(), start)
        torch.testing.assert_close(exp_avg_sq, opt.state[ref]["exp_avg_sq"], rtol=1e-4, atol=1e-12)
        assert torch.equal(weights, master.to(torch.bfloat16))


def test_optimizer_with_the_kernel_equals_torch_kernels():
    cfg = OptimConfig()
    cfg.lr, cfg.weight_decay = 1e-2, 0.1
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(64, 32), (32,), (17, 5)]
    params = {}
    for name in ("kernel", "torch"):
        torch.manual_seed(0)
        params[name] = [nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]
    starts = [p.detach().float() for p in params["torch"]]
    opts = {"kernel": MixedPrecisionAdamW(params["kernel"], cfg),
            "torch": MixedPrecisionAdamW(params["torch"], cfg, fused=False)}
    assert opts["kernel"]._kernel and not opts["torch"]._kernel
    for step in range(3):
        grads = [torch.randn(s, device="cuda", generator=g) for s in shapes]
        coef = torch.tensor(0.7, device="cuda") if step == 1 else None
        for name, opt in opts.items():
            for p, grad in zip(params[name], grads):
                p.main_grad = grad.clone()
            opt.step(cfg.lr, grad_coef=coef)
    for a, b, start in zip(opts["kernel"].masters, opts["torch"].masters, starts):
        assert_same_updates(a.detach(), b.detach(), start)
    for p, m in zip(params["kernel"], opts["kernel"].masters):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    assert opts["kernel"].step_count == opts["torch"].step_count == 3
    opts["kernel"].set_step_count(10)  # as a checkpoint load does: the next step is number 11
    assert opts["kernel"].step_count == 10


def test_segment_optimizer_with_the_kernel_equals_torch_kernels():
    """The distributed optimizer's partitions: the kernel writes the bf16 weights of its segments and
    leaves the rest of the buffer alone."""
    from meshtron.optim.offload import Segment
    from meshtron.optim.segment_adam import SegmentAdamW

    cfg = OptimConfig()
    cfg.lr, cfg.weight_decay = 1e-2, 0.1
    segments = [Segment(0, 0, 0, 300, True), Segment(1, 0, 400, 50, False)]  # 300..400 belongs elsewhere
    g = torch.Generator(device="cuda").manual_seed(2)
    weights = torch.randn(512, device="cuda", generator=g).to(torch.bfloat16)
    start = weights.float()
    parts, grads = {}, {}
    for name in ("kernel", "torch"):
        grads[name] = torch.zeros(512, device="cuda")
        parts[name] = (SegmentAdamW(segments, grads[name], weights.clone(), cfg))
    parts["torch"].kernel = False
    assert parts["kernel"].kernel
    for step in (1, 2):
        grad = torch.randn(512, device="cuda", generator=g)
        for name, part in parts.items():
            grads[name].copy_(grad)
            part.step(cfg.lr, torch.tensor(0.5, device="cuda"), step_number=step)
            part.store_params()
    a, b = parts["kernel"], parts["torch"]
    assert_same_updates(a.master_flat, b.master_flat, torch.cat([start[:300], start[400:450]]))
    assert torch.equal(a.param_data[300:400], weights[300:400])  # not this partition's
    assert torch.equal(a.param_data[:300], a.master_flat[:300].to(torch.bfloat16))
    assert torch.equal(a.param_data[400:450], a.master_flat[300:].to(torch.bfloat16))
