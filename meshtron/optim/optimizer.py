"""AdamW with fp32 master weights over bf16 (or fp32) model parameters.

Each model parameter has an fp32 master copy (the parameter itself when it is
already fp32) and reads its gradient from ``param.main_grad`` (see GradBuffer).
After the step the updated masters are copied back into the model parameters.
Norm and bias parameters (1-D) get no weight decay. On CUDA the step is one Triton
kernel per parameter that also writes the bf16 weights (meshtron.optim.fused_adamw);
torch's multi-tensor AdamW elsewhere. torch's AdamW holds the state either way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.nn as nn

from meshtron.config import OptimConfig
from meshtron.optim import fused_adamw


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: AdamW's state of every parameter (checkpoint keys ``optim.<state>.<name>``).
STATES = ("master", "exp_avg", "exp_avg_sq")


def moment_dtypes(cfg: OptimConfig) -> tuple[torch.dtype, torch.dtype]:
    """Storage dtypes of Adam's first and second moments (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``)."""
    return _DTYPES[cfg.exp_avg_dtype], _DTYPES[cfg.exp_avg_sq_dtype]


def low_precision_moments(cfg: OptimConfig) -> bool:
    """Whether a moment is stored below fp32: torch's AdamW cannot step such state, meshtron's step can."""
    return moment_dtypes(cfg) != (torch.float32, torch.float32)


def no_weight_decay(param: torch.Tensor) -> bool:
    """Norm weights and biases (1-D tensors) are not decayed."""
    return param.dim() == 1


@contextlib.contextmanager
def scaled_gradients(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor],
                     coef: Optional[torch.Tensor]) -> Iterator[None]:
    """Make ``optimizer.step()`` see ``grads`` multiplied by ``coef`` (a 0-d tensor; None: unscaled).

    torch's fused Adam kernels divide the gradients by the optimizer's ``grad_scale`` as they read
    them, so clipping costs no extra pass over the fp32 gradients (8 bytes per parameter); other
    implementations get the gradients multiplied in place first.
    """
    if coef is None:
        yield
    elif optimizer.defaults.get("fused"):
        optimizer.grad_scale = coef.reciprocal().to(torch.float32)
        try:
            yield
        finally:
            optimizer.grad_scale = None
    else:
        torch._foreach_mul_(list(grads), coef)
        yield


class MixedPrecisionAdamW:
    """AdamW stepping fp32 masters with gradients taken from ``param.main_grad``."""

    def __init__(self, params: Sequence[nn.Parameter], cfg: OptimConfig, fused: bool | None = None):
        self.params = list(params)
        self.masters: list[torch.Tensor] = []
        for p in self.params:
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                self.masters.append(nn.Parameter(p.detach().float().clone()))
        decay = [m for p, m in zip(self.params, self.masters) if not no_weight_decay(p)]
        skip = [m for p, m in zip(self.params, self.masters) if no_weight_decay(p)]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": skip, "weight_decay": 0.0}) if g["params"]]
        device_is_cuda = bool(self.params) and self.params[0].is_cuda
        fused = device_is_cuda if fused is None else fused
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                       fused=fused, foreach=None if fused else True)
        self._copy_back = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        self.cfg = cfg
        # meshtron's step: the Triton kernel on CUDA, or its torch twin for moments below fp32.
        self._kernel = (fused and all(fused_adamw.available(p) for p in self.params)) or low_precision_moments(cfg)
        self._host_step: Optional[int] = None  # the kernel path's step count, read from the state once

    def _main_grads(self) -> list[torch.Tensor]:
        return [p.main_grad if p.main_grad.dtype == torch.float32 else p.main_grad.float() for p in self.params]

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None) -> None:
        """One AdamW step at learning rate ``lr`` using the (already reduced) main grads, multiplied
        by ``grad_coef`` (the clipping coefficient, a device tensor) when given."""
        if self._kernel:
            self._kernel_step(lr, grad_coef)
            return
        grads = self._main_grads()
        for m, g in zip(self.masters, grads):
            m.grad = g
        for group in self.inner.param_groups:
            group["lr"] = lr
        with scaled_gradients(self.inner, grads, grad_coef):
            self.inner.step()
        if self._copy_back:
            torch._foreach_copy_([p.data for p, _ in self._copy_back], [m.data for _, m in self._copy_back])
        for m in self.masters:
            m.grad = None

    def _kernel_step(self, lr: float, grad_coef: Optional[torch.Tensor]) -> None:
        self.ensure_state()
        if self._host_step is None:
            self._host_step = self.step_count  # one device-to-host read after construction or a load
        self._host_step += 1
        # The kernel reads bf16 gradients as they are (no fp32 copies; torch's AdamW needs them).
        items = [(m.data, p.main_grad, self.inner.state[m], None if m is p else p.data, not no_weight_decay(p))
                 for p, m in zip(self.params, self.masters)]
        fused_adamw.step_tensors(items, self.cfg, lr, self._host_step, grad_coef)

    def state_names(self, index: int) -> tuple[str, ...]:
        """The states of parameter ``index``: master and Adam's two moments."""
        return STATES

    def state_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """fp32 master and Adam moments of parameter ``index`` (same local shape as the parameter)."""
        m = self.masters[index]
        state = self.inner.state.get(m, {})
        out = {"master": m.data}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[key] = state[key]
        return out

    @torch.no_grad()
    def load_state_tensors(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors`: copy master/moments into parameter ``index``'s state."""
        self.ensure_state()
        m = self.masters[index]
        if "master" in tensors:
            m.data.copy_(tensors["master"])
            p = self.params[index]
            if p is not m:
                p.data.copy_(m.data)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in tensors:
                self.inner.state[m][key].copy_(tensors[key])

    @property
    def step_count(self) -> int:
        for state in self.inner.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def ensure_state(self) -> None:
        """Create zeroed Adam moments (so a checkpoint can be loaded into them before any step)."""
        avg_dtype, sq_dtype = moment_dtypes(self.cfg)
        for m in self.masters:
            state = self.inner.state[m]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(m.data, dtype=avg_dtype)
                state["exp_avg_sq"] = torch.zeros_like(m.data, dtype=sq_dtype)
                fused = self.inner.defaults.get("fused")
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=m.device if fused else torch.device("cpu"))

    def finish_param_gather(self) -> None:
        """Nothing to wait for: the parameters are the weights (the TrainingOptimizer interface)."""

    def weights_written(self) -> None:
        """Nothing to copy: the masters follow the weights through load_state_tensors."""

    def set_step_count(self, step: int) -> None:
        self._host_step = None
        for m in self.masters:
            if "step" in self.inner.state[m]:
                self.inner.state[m]["step"].fill_(step)
