"""AdamW over segments of the flat gradient/parameter buffers, with its state on one device.

A partition of the distributed optimizer: fp32 master weights for its segments
(views of one flat fp32 tensor, or of the parameter buffer itself when the weights
are fp32 and on the same device), Adam moments, and torch's AdamW (fused kernel for
host partitions on the CPU; multi-tensor on devices without Triton). On CUDA the step
is meshtron's Triton AdamW, which writes the updated weights in the same pass. Weight
decay follows the parameter each segment belongs to (none for 1-D norms and biases).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from meshtron.config import OptimConfig
from meshtron.optim import fused_adamw
from meshtron.optim.grad_buffer import GradBuffer, grad_region
from meshtron.optim.offload import HostCopier, Segment
from meshtron.optim.optimizer import low_precision_moments, moment_dtypes, scaled_gradients


class SegmentAdamW:
    """AdamW stepping ``segments`` of ``param_data`` with gradients from ``grad_data``.

    ``host``: the state lives in CPU memory and the step runs there; gradients and
    updated weights travel through :class:`~meshtron.optim.offload.HostCopier`.
    """

    def __init__(self, segments: Sequence[Segment], grad_data: Union[torch.Tensor, GradBuffer],
                 param_data: torch.Tensor, cfg: OptimConfig, host: bool = False):
        """``grad_data``: the flat gradients the segments' ``buffer_offset`` address (a tensor, or the
        GradBuffer itself where its buckets are tensors of their own)."""
        self.segments = [s for s in segments if s.length > 0]
        self.param_data = param_data
        # Views made once: a released gradient bucket keeps its storage object, so they stay valid.
        self.grad_views = [grad_region(grad_data, s.buffer_offset, s.buffer_offset + s.length) for s in self.segments]
        self.grad_dtype = grad_data.dtype
        self.host = host
        self.numel = sum(s.length for s in self.segments)
        state_device = torch.device("cpu") if host else param_data.device
        self.aliased = (not host) and param_data.dtype == torch.float32
        self.local_offsets: list[int] = []
        offset = 0
        for s in self.segments:
            self.local_offsets.append(offset)
            offset += s.length
        if self.aliased:  # fp32 weights on this device are their own masters
            self.master_flat: Optional[torch.Tensor] = None
            views = [param_data[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments]
        else:
            self.master_flat = torch.empty(self.numel, dtype=torch.float32, device=state_device)
            views = [self.master_flat[o:o + s.length] for o, s in zip(self.local_offsets, self.segments)]
            with torch.no_grad():
                for v, s in zip(views, self.segments):
                    v.copy_(param_data[s.buffer_offset:s.buffer_offset + s.length])
        # Parameters sharing the views' storage: torch's optimizer needs leaf tensors to key its state.
        self.masters = [nn.Parameter(v, requires_grad=True) for v in views]
        groups = [g for g in ({"params": [m for m, s in zip(self.masters, self.segments) if s.decay],
                               "weight_decay": cfg.weight_decay},
                              {"params": [m for m, s in zip(self.masters, self.segments) if not s.decay],
                               "weight_decay": 0.0}) if g["params"]]
        self.fused = state_device.type == "cuda" or host
        self.inner = (torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                        fused=self.fused, foreach=None if self.fused else True)
                      if groups else None)
        self.cfg = cfg
        # meshtron's step: the Triton kernel on CUDA, or its torch twin for moments below fp32.
        self.kernel = (not host) and self.inner is not None and (fused_adamw.available(param_data)
                                                                 or low_precision_moments(cfg))
        self.copier: Optional[HostCopier] = None
        if host and self.segments:
            self.copier = HostCopier(param_data.device)
            self.grad_stage = self.copier.empty(self.numel, self.grad_dtype)
            self.param_stage = self.copier.empty(self.numel, param_data.dtype)

    # ----------------------------------------------------------------------------------- step
    def _stage_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.length] for o, s in zip(self.local_offsets, self.segments)]

    def _buffer_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments]

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply this partition's gradients in the device buffer by ``coef`` in place."""
        if self.segments:
            torch._foreach_mul_(self.grad_views, coef)

    def fetch_grads(self) -> None:
        """Start copying this partition's gradients to the host (host partitions only)."""
        if self.copier is not None:
            self.copier.to_host(list(zip(self._stage_views(self.grad_stage), self.grad_views)))

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None, step_number: int = 0) -> None:
        """One AdamW step of the masters at ``lr`` (gradients already reduced), with the gradients
        multiplied by ``grad_coef`` (the clipping coefficient) when given; host partitions take
        gradients that were scaled before they were fetched, so they refuse it. ``step_number`` (1 for
        the first step) is what the Triton kernel's bias correction needs; torch's AdamW counts itself."""
        if grad_coef is not None and self.copier is not None:
            raise ValueError("host partitions fetch gradients that are already scaled; pass no grad_coef")
        if self.inner is None:
            return
        if self.kernel:
            self._kernel_step(lr, grad_coef, step_number)
            return
        if self.copier is not None:
            self.copier.wait_host()
            grads = self._stage_views(self.grad_stage if self.grad_stage.dtype == torch.float32
                                      else self.grad_stage.float())
        else:
            grads = self._fp32_device_grads()
        for m, g in zip(self.masters, grads):
            m.grad = g
        for group in self.inner.param_groups:
            group["lr"] = lr
        with scaled_gradients(self.inner, grads, grad_coef):
            self.inner.step()
        for m in self.masters:
            m.grad = None

    def _fp32_device_grads(self) -> list[torch.Tensor]:
        """This partition's gradients from the device buffer, as fp32 (copies where it holds bf16)."""
        grads = self.grad_views
        return grads if self.grad_dtype == torch.float32 else [g.float() for g in grads]

    def _kernel_step(self, lr: float, grad_coef: Optional[torch.Tensor], step_number: int) -> None:
        if step_number < 1:
            raise ValueError(f"SegmentAdamW: step_number must count from 1 on the kernel path, got {step_number}")
        self.ensure_state(step_number - 1)
        grads = self.grad_views  # the kernel reads bf16 gradients as they are
        weights = [None] * len(grads) if self.aliased else self._buffer_views(self.param_data)
        items = [(m.data, g, self.inner.state[m], w, s.decay)
                 for m, s, g, w in zip(self.masters, self.segments, grads, weights)]
        fused_adamw.step_tensors(items, self.cfg, lr, step_number, grad_coef)

    @torch.no_grad()
    def store_params(self) -> None:
        """Write the updated masters into the weights (host partitions: start the copy; the kernel
        path wrote them during the step)."""
        if not self.segments or self.aliased or self.kernel:
            return
        if self.copier is not None:
            self.param_stage.copy_(self.master_flat)  # fp32 -> weight dtype on the CPU
            self.copier.to_device(list(zip(self._buffer_views(self.param_data), self._stage_views(self.param_stage))))
        else:
            torch._foreach_copy_(self._buffer_views(self.param_data), [m.data for m in self.masters])

    def finish_store(self) -> None:
        """Order the host-to-device weight copies before later work on the device."""
        if self.copier is not None:
            self.copier.wait_device()

    # ----------------------------------------------------------------------------------- state
    def ensure_state(self, step: int) -> None:
        """Create zeroed moments (and a step counter at ``step``) for segments without state."""
        if self.inner is None:
            return
        avg_dtype, sq_dtype = moment_dtypes(self.cfg)
        for m in self.masters:
            state = self.inner.state[m]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(m.data, dtype=avg_dtype)
                state["exp_avg_sq"] = torch.zeros_like(m.data, dtype=sq_dtype)
                state["step"] = torch.full((), float(step), dtype=torch.float32,
                                           device=m.device if self.fused else torch.device("cpu"))

    def state_of(self, position: int) -> dict[str, torch.Tensor]:
        """Master and (when they exist) moments of segment ``position`` (1-D views)."""
        m = self.masters[position]
        out = {"master": m.data}
        if self.inner is not None:
            state = self.inner.state.get(m, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out[key] = state[key]
        return out

    @torch.no_grad()
    def load_segment(self, position: int, key: str, values: torch.Tensor) -> None:
        """Overwrite ``key`` of segment ``position`` (a 1-D tensor of its length); a master also updates
        the weight it stands for."""
        target = self.state_of(position)[key]
        target.copy_(values)
        if key == "master" and not self.aliased:
            s = self.segments[position]
            self.param_data[s.buffer_offset:s.buffer_offset + s.length].copy_(target)

    def set_step(self, step: int) -> None:
        if self.inner is None:
            return
        for m in self.masters:
            state = self.inner.state.get(m, {})
            if "step" in state:
                state["step"].fill_(step)

    def state_bytes(self) -> int:
        """Bytes of masters (when not the weights themselves), moments and staging buffers."""
        total = 0 if self.master_flat is None else self.master_flat.numel() * 4
        if self.inner is not None:
            for m in self.masters:
                for key in ("exp_avg", "exp_avg_sq"):
                    t = self.inner.state.get(m, {}).get(key)
                    if t is not None:
                        total += t.numel() * t.element_size()
        if self.copier is not None:
            total += self.grad_stage.numel() * self.grad_stage.element_size()
            total += self.param_stage.numel() * self.param_stage.element_size()
        return total
