"""Lion's step (torch), for :mod:`meshtron.optim.kinds.lion`: over every parameter of a rank, and over segments
of the flat buffers as a partition of the distributed optimizer.

For a parameter with fp32 master ``W``, reduced gradient ``G`` and momentum ``M``, at learning rate ``lr``::

    U <- sign(beta1 M + (1 - beta1) G)
    W <- W (1 - lr wd) - lr U          (decoupled weight decay, none for norms and biases)
    M <- beta2 M + (1 - beta2) G

Every operation is elementwise, so the distributed optimizer may cut a parameter's state anywhere.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from meshtron.optim.optimizer import no_weight_decay
from meshtron.optim.segment_momentum import SegmentMomentum

#: A parameter's states: the fp32 master and the momentum.
STATES = ("master", "exp_avg")


@torch.no_grad()
def lion_step(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor],
              decays: Sequence[bool], lr: float, cfg, grad_coef: Optional[torch.Tensor] = None) -> None:
    """One Lion step of ``masters`` (fp32, in place) with fp32 ``grads`` (times ``grad_coef``, the clipping
    coefficient, when given) and ``momenta`` (in place); ``decays``: whether each master takes weight decay."""
    if not masters:
        return
    beta1, beta2 = cfg.lion_beta1, cfg.lion_beta2
    if grad_coef is not None:
        grads = torch._foreach_mul(list(grads), grad_coef)
    direction = torch._foreach_mul(list(momenta), beta1)
    torch._foreach_add_(direction, list(grads), alpha=1.0 - beta1)
    direction = torch._foreach_sign(direction)
    decayed = [m for m, d in zip(masters, decays) if d]
    if decayed and cfg.weight_decay:
        torch._foreach_mul_(decayed, 1.0 - lr * cfg.weight_decay)
    torch._foreach_add_(list(masters), direction, alpha=-lr)
    torch._foreach_mul_(list(momenta), beta2)
    torch._foreach_add_(list(momenta), list(grads), alpha=1.0 - beta2)


class MixedPrecisionLion:
    """Lion over every parameter of this rank, with fp32 masters and gradients from ``param.main_grad`` (the
    TrainingOptimizer interface)."""

    def __init__(self, params: Sequence[nn.Parameter], cfg):
        self.params = list(params)
        self.cfg = cfg
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.decays = [not no_weight_decay(p) for p in self.params]
        self.momenta: list[Optional[torch.Tensor]] = [None] * len(self.params)
        self._step = 0

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None) -> None:
        """One step at ``lr`` with the (already reduced) main grads, times ``grad_coef`` when given."""
        self.ensure_state()
        grads = [p.main_grad.float() for p in self.params]
        lion_step(self.masters, grads, self.momenta, self.decays, lr, self.cfg, grad_coef)
        copies = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if copies:
            torch._foreach_copy_([p.data for p, _ in copies], [m for _, m in copies])
        self._step += 1

    def state_names(self, index: int) -> tuple[str, ...]:
        return STATES

    def state_tensors(self, index: int) -> dict[str, torch.Tensor]:
        out = {"master": self.masters[index].data}
        if self.momenta[index] is not None:
            out["exp_avg"] = self.momenta[index]
        return out

    @torch.no_grad()
    def load_state_tensors(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        self.ensure_state()
        if "master" in tensors:
            self.masters[index].data.copy_(tensors["master"])
            if self.masters[index] is not self.params[index]:
                self.params[index].data.copy_(self.masters[index].data)
        if "exp_avg" in tensors:
            self.momenta[index].copy_(tensors["exp_avg"])

    def ensure_state(self) -> None:
        """Zeroed momenta (so a checkpoint can be loaded into them before any step)."""
        for k, master in enumerate(self.masters):
            if self.momenta[k] is None:
                self.momenta[k] = torch.zeros_like(master.data, dtype=torch.float32)

    @property
    def step_count(self) -> int:
        return self._step

    def set_step_count(self, step: int) -> None:
        self._step = step

    def finish_param_gather(self) -> None:
        """Nothing to wait for: the parameters are the weights."""

    def weights_written(self) -> None:
        """Nothing to copy: the masters follow the weights through load_state_tensors."""


class SegmentLion(SegmentMomentum):
    """Lion stepping ``segments`` of ``param_data`` with gradients from ``grad_data``: a partition of the
    distributed optimizer with SegmentAdamW's interface (its state on the device)."""

    STATE = "exp_avg"

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None, step_number: int = 0) -> None:
        self.ensure_state(step_number)
        grads = [g.float() for g in self.grad_views]
        lion_step(self.masters, grads, self.momentum, [s.decay for s in self.segments], lr, self.cfg, grad_coef)
