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

With ``release=True`` (a bucketed layout) every bucket has a tensor of its own, allocated when its
first gradient of an iteration arrives and freed when the next iteration starts (:meth:`GradBuffer.zero`;
the last step's gradients stay readable until then, for logging). The gradients then take no memory
during the forward pass: with one micro-batch per step the forward's activations (the peak) and the
gradients, which backward produces as it frees those activations, do not meet. The parameters' ``main_grad`` are views of the bucket
tensors and stay valid across a release (they share the storage, which is resized, never replaced); code
that writes them itself, outside backward, calls :meth:`GradBuffer.zero_unwritten` first (after
:meth:`GradBuffer.zero` a released bucket has no storage until then).
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from meshtron.optim.buckets import BufferLayout


class GradBuffer:
    """The gradient tensor(s) for ``params``, with per-parameter views ``param.main_grad``.

    Without ``layout`` the parameters are packed in the given order (padded at the end
    to a multiple of ``pad_to``); with a :class:`~meshtron.optim.buckets.BufferLayout`
    they sit at the layout's offsets (reverse order, buckets, shard padding).
    ``on_grad_ready`` (optional) is called with the parameter after its gradient has
    been added, which is where overlapped data-parallel reduction hooks in.
    ``release``: one tensor per bucket, freed between steps (see the module docstring); ``data`` is then
    None and :meth:`region` addresses the buffer.
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, pad_to: int = 1,
                 on_grad_ready: Optional[Callable[[nn.Parameter], None]] = None,
                 layout: Optional[BufferLayout] = None, release: bool = False):
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
            if release:
                raise ValueError("GradBuffer: release=True needs a bucketed layout")
            self.offsets = []
            offset = 0
            for p in self.params:
                self.offsets.append((offset, p.numel()))
                offset += p.numel()
            total = -(-offset // pad_to) * pad_to
        self.numel = sum(n for _, n in self.offsets)
        self.total_numel = total
        self.releases = release
        self.on_grad_ready = on_grad_ready
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._written = [False] * len(self.params)  # the buffer starts zeroed: every view is a valid sum
        if release:
            self.data: Optional[torch.Tensor] = None
            self._pieces = [torch.zeros(b.numel, dtype=dtype, device=device) for b in layout.buckets]
            self._bucket_of = list(layout.bucket_of_param)
            self._bucket_starts = [b.start for b in layout.buckets]
        else:
            self.data = torch.zeros(total, dtype=dtype, device=device)
        self._allocated = [True] * (len(layout.buckets) if release else 0)
        self._hooks = []
        for i, p in enumerate(self.params):
            p.main_grad = self.view_of(i).view(p.shape)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    # ----------------------------------------------------------------------------------- storage
    def region(self, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flat buffer (with ``release``: inside one bucket)."""
        if self.data is not None:
            return self.data[start:end]
        b = bisect.bisect_right(self._bucket_starts, start) - 1
        bucket = self.layout.buckets[b] if b >= 0 else None
        if bucket is not None and end <= bucket.end:
            self._ensure(b)
            return self._pieces[b][start - bucket.start:end - bucket.start]
        raise ValueError(f"GradBuffer.region: [{start}, {end}) is not inside one bucket")

    def view_of(self, index: int) -> torch.Tensor:
        start, n = self.offsets[index]
        if self.data is not None:
            return self.data[start:start + n]
        b = self._bucket_of[index]
        first = self.layout.buckets[b].start
        return self._pieces[b][start - first:start - first + n]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradients (each allocated, its unwritten views zeroed)."""
        self.zero_unwritten()
        return [self.data] if self.data is not None else list(self._pieces)

    def _ensure_holding(self, index: int) -> None:
        """Allocate the bucket that holds parameter ``index``'s gradient (no-op without ``release``)."""
        if self.releases:
            self._ensure(self._bucket_of[index])

    def _ensure(self, b: int) -> None:
        if not self._allocated[b]:
            piece = self._pieces[b]
            piece.untyped_storage().resize_(piece.numel() * piece.element_size())
            self._allocated[b] = True

    def release(self) -> None:
        """Free every bucket's tensor until its next gradient (no-op without ``release``); the gradients
        are gone, as after :meth:`zero`."""
        self._written = [False] * len(self.params)
        for b, piece in enumerate(self._pieces if self.releases else ()):
            if self._allocated[b]:
                piece.untyped_storage().resize_(0)
                self._allocated[b] = False

    # ----------------------------------------------------------------------------------- accumulation
    def _accumulate(self, param: nn.Parameter) -> None:
        i = self._index[id(param)]
        if self._written[i]:
            param.main_grad.add_(param.grad)
        else:  # the iteration's first gradient of this parameter
            self._ensure_holding(i)
            # The multi-tensor copy is vectorised where copy_ converting bf16 to fp32 is not: on an H200
            # 6.6 against 10.4 ms for every gradient of llama3-3b (benchmarks/optimizer_probe.py).
            torch._foreach_copy_([param.main_grad], [param.grad])
            self._written[i] = True
        param.grad = None
        if self.on_grad_ready is not None:
            self.on_grad_ready(param)

    def zero(self) -> None:
        """Start a new accumulation (no device work: the next gradients overwrite the old ones; with
        ``release`` the buckets are freed until backward reaches them)."""
        self.release()

    def zero_unwritten(self) -> None:
        """Zero the views of parameters that received no gradient since :meth:`zero`."""
        for i, written in enumerate(self._written):
            if not written:
                self._ensure_holding(i)
                self.params[i].main_grad.zero_()
                self._written[i] = True

    def bytes(self) -> int:
        """Bytes of the buffer while allocated (padding included)."""
        return self.total_numel * torch.tensor([], dtype=self.dtype).element_size()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def grad_region(grads: Union[torch.Tensor, GradBuffer], start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a flat gradient tensor, or of a :class:`GradBuffer` (whose buckets may be
    tensors of their own: then the range lies inside one). A view: it stays valid across releases."""
    return grads.region(start, end) if isinstance(grads, GradBuffer) else grads[start:end]
