"""The clipping coefficient applied inside the optimizer step (no separate pass over the gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from meshtron.config import OptimConfig
from meshtron.optim.optimizer import MixedPrecisionAdamW


def _params(seed: int) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(32))]
    for p in params:
        p.main_grad = torch.randn_like(p) * 5
    return params


@pytest.mark.parametrize("fused", [True, False])
def test_grad_coef_equals_scaling_the_gradients_first(fused):
    """Fused kernels divide by grad_scale = 1/coef as they read; others multiply in place. Both must
    equal multiplying the gradients by the coefficient and stepping without one."""
    coef = torch.tensor(0.3)
    scaled, reference = _params(1), _params(1)
    opt_scaled = MixedPrecisionAdamW(scaled, OptimConfig(), fused=fused)
    opt_reference = MixedPrecisionAdamW(reference, OptimConfig(), fused=fused)
    for step in range(3):  # fresh gradients every step, as the training loop's zeroed buffer gives
        torch.manual_seed(10 + step)
        grads = [torch.randn_like(p) * 5 for p in scaled]
        for p, r, g in zip(scaled, reference, grads):
            p.main_grad, r.main_grad = g.clone(), g * coef
        opt_reference.step(1e-2)
        opt_scaled.step(1e-2, grad_coef=coef)
    for a, b in zip(scaled, reference):
        torch.testing.assert_close(a.data, b.data, rtol=1e-6, atol=1e-7)
    assert getattr(opt_scaled.inner, "grad_scale", None) is None  # not left behind for the next step


def test_no_coef_leaves_the_step_unscaled():
    a, b = _params(2), _params(2)
    opt_a, opt_b = MixedPrecisionAdamW(a, OptimConfig(), fused=True), MixedPrecisionAdamW(b, OptimConfig(), fused=True)
    opt_a.step(1e-2)
    opt_b.step(1e-2, grad_coef=torch.tensor(1.0))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.data, y.data, rtol=0, atol=0)
