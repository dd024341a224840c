"""Contiguous gradient buffers: every parameter's gradient accumulates into a view of one flat tensor.

Backward produces each parameter's gradient in the parameter's dtype (bf16 on GPU);
a post-accumulate hook adds it into ``param.main_grad`` (fp32 by default) and frees
it. Accumulating over micro-batches in fp32 keeps the sum exact to fp32 rounding, and
the flat layout lets reductions and the optimizer work on few large tensors.

A new iteration does not zero-fill the buffer: ``zero()`` only marks every parameter
unwritten, and a parameter's first gradient of the iteration is copied into its view
instead of added (one pass over the buffer saved, and the copy reads less than an add).
``zero_unwritten()`` zeroes the views of parameters that got no gradient; the gradient
reduction calls it before anything reads the buffer.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from meshtron.optim.buckets import BufferLayout


class GradBuffer:
    """One flat gradient tensor for ``params``, with per-parameter views ``param.main_grad``.

    Without ``layout`` the parameters are packed in the given order (padded at the end
    to a multiple of ``pad_to``); with a :class:`~meshtron.optim.buckets.BufferLayout`
    they sit at the layout's offsets (reverse order, buckets, shard padding).
    ``on_grad_ready`` (optional) is called with the parameter after its gradient has
    been added, which is where overlapped data-parallel reduction hooks in.
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, pad_to: int = 1,
                 on_grad_ready: Optional[Callable[[nn.Parameter], None]] = None,
                 layout: Optional[BufferLayout] = None):
        self.params = list(params)
        self.dtype = dtype
        self.layout = layout
        device = device or self.params[0].device
        if layout is not None:
            if [id(p) for p in layout.params] != [id(p) for p in self.params]:
                raise ValueError("GradBuffer: the layout describes other parameters than the ones given")
            self.offsets = list(layout.offsets)
            total = layout.numel
        else:
            self.offsets = []
            offset = 0
            for p in self.params:
                self.offsets.append((offset, p.numel()))
                offset += p.numel()
            total = -(-offset // pad_to) * pad_to
        self.numel = sum(n for _, n in self.offsets)
        self.data = torch.zeros(total, dtype=dtype, device=device)
        self.on_grad_ready = on_grad_ready
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._written = [False] * len(self.params)  # the buffer starts zeroed: every view is a valid sum
        self._hooks = []
        for p, (start, n) in zip(self.params, self.offsets):
            p.main_grad = self.data[start:start + n].view(p.shape)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _accumulate(self, param: nn.Parameter) -> None:
        i = self._index[id(param)]
        if self._written[i]:
            param.main_grad.add_(param.grad)
        else:  # the iteration's first gradient of this parameter
            # The multi-tensor copy is vectorised where copy_ converting bf16 to fp32 is not: on an H200
            # 6.6 against 10.4 ms for every gradient of llama3-3b (benchmarks/optimizer_probe.py).
            torch._foreach_copy_([param.main_grad], [param.grad])
            self._written[i] = True
        param.grad = None
        if self.on_grad_ready is not None:
            self.on_grad_ready(param)

    def zero(self) -> None:
        """Start a new accumulation (no device work: the next gradients overwrite the old ones)."""
        self._written = [False] * len(self.params)

    def zero_unwritten(self) -> None:
        """Zero the views of parameters that received no gradient since :meth:`zero`."""
        for i, written in enumerate(self._written):
            if not written:
                self.params[i].main_grad.zero_()
                self._written[i] = True

    def view_of(self, index: int) -> torch.Tensor:
        start, n = self.offsets[index]
        return self.data[start:start + n]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
