"""Contiguous gradient buffers: every parameter's gradient accumulates into a view of one flat tensor.

Backward produces each parameter's gradient in the parameter's dtype (bf16 on GPU);
a post-accumulate hook adds it into ``param.main_grad`` (fp32 by default) and frees
it. Accumulating over micro-batches in fp32 keeps the sum exact to fp32 rounding, and
the flat layout lets reductions and the optimizer work on few large tensors.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn


class GradBuffer:
    """One flat gradient tensor for ``params`` (in the given order), with per-parameter views.

    ``on_grad_ready`` (optional) is called with the parameter after its gradient has
    been added, which is where overlapped data-parallel reduction hooks in.
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, pad_to: int = 1,
                 on_grad_ready: Optional[Callable[[nn.Parameter], None]] = None):
        self.params = list(params)
        self.dtype = dtype
        device = device or self.params[0].device
        self.offsets: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            self.offsets.append((offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        padded = -(-offset // pad_to) * pad_to
        self.data = torch.zeros(padded, dtype=dtype, device=device)
        self.on_grad_ready = on_grad_ready
        self._hooks = []
        for p, (start, n) in zip(self.params, self.offsets):
            p.main_grad = self.data[start:start + n].view(p.shape)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _accumulate(self, param: nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.on_grad_ready is not None:
            self.on_grad_ready(param)

    def zero(self) -> None:
        self.data.zero_()

    def view_of(self, index: int) -> torch.Tensor:
        start, n = self.offsets[index]
        return self.data[start:start + n]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
