"""A distributed-optimizer partition with one fp32 momentum per segment, on the device: what Muon's and Lion's
partitions share (SegmentAdamW's interface; the step is the subclass's)."""

from __future__ import annotations

from typing import Optional

import torch


class SegmentMomentum:
    """fp32 masters (the weights themselves where they are fp32) and one fp32 momentum, named :attr:`STATE`, for
    ``segments`` of ``param_data`` with gradients from ``grad_data``. Subclasses define ``step``."""

    STATE = "momentum"

    def __init__(self, segments, grad_data, param_data: torch.Tensor, cfg):
        from meshtron.optim.grad_buffer import grad_region

        self.segments = [s for s in segments if s.length > 0]
        self.grad_views = [grad_region(grad_data, s.buffer_offset, s.buffer_offset + s.length) for s in self.segments]
        self.param_data = param_data
        self.cfg = cfg
        self.aliased = param_data.dtype == torch.float32  # fp32 weights are their own masters
        views = [param_data[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments]
        self.master_flat: Optional[torch.Tensor] = None
        if self.aliased:
            self.masters = views
        else:
            self.master_flat = torch.empty(sum(s.length for s in self.segments), dtype=torch.float32,
                                           device=param_data.device)
            self.masters, offset = [], 0
            for v, s in zip(views, self.segments):
                self.masters.append(self.master_flat[offset:offset + s.length])
                self.masters[-1].copy_(v)
                offset += s.length
        self.momentum: list[Optional[torch.Tensor]] = [None] * len(self.segments)

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        if self.segments:
            torch._foreach_mul_(self.grad_views, coef)

    def fetch_grads(self) -> None:
        """Device partitions only (the state is not offloaded)."""

    @torch.no_grad()
    def store_params(self) -> None:
        if self.segments and not self.aliased:
            torch._foreach_copy_([self.param_data[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments],
                                 self.masters)

    def finish_store(self) -> None:
        """Nothing in flight."""

    def ensure_state(self, step: int) -> None:
        for k, master in enumerate(self.masters):
            if self.momentum[k] is None:
                self.momentum[k] = torch.zeros_like(master, dtype=torch.float32)

    def state_of(self, position: int) -> dict[str, torch.Tensor]:
        out = {"master": self.masters[position]}
        if self.momentum[position] is not None:
            out[self.STATE] = self.momentum[position]
        return out

    @torch.no_grad()
    def load_segment(self, position: int, key: str, values: torch.Tensor) -> None:
        self.state_of(position)[key].copy_(values)
        if key == "master" and not self.aliased:
            s = self.segments[position]
            self.param_data[s.buffer_offset:s.buffer_offset + s.length].copy_(self.masters[position])

    def set_step(self, step: int) -> None:
        """No step counter (no bias correction)."""

    def state_bytes(self) -> int:
        total = 0 if self.master_flat is None else self.master_flat.numel() * 4
        return total + sum(m.numel() * 4 for m in self.momentum if m is not None)
