"""Activation offloading: the tensors a transformer layer saves for backward wait in host memory.

``--offload-activations`` trades host-device copies for device memory. During a layer's forward,
every activation autograd saves for that layer's backward (through
:func:`torch.autograd.graph.saved_tensors_hooks`, so compiled layers and custom autograd functions
are covered) is copied to a pinned host buffer on a side stream, and the device copy is released
as soon as the forward no longer needs it. When the backward reaches a layer, the saved tensors of
that layer and of the one before it are copied back on the side stream, so that the next layer's
copy overlaps this layer's backward compute.

What is not moved: parameters (and views of them), tensors smaller than ``min_bytes``, tensors
whose elements do not fill one gap-free block of memory (a transposed or permuted tensor does, such
as the attention kernel's output, and is copied in its own layout), and the saved tensors of each
model chunk's last layer (its backward
follows its forward at once, so a copy could not overlap anything). The values are bit-identical:
a copy there and back.

Meant for long sequences, where recomputation costs more than the copies: the copy of a layer's
activations must take less time than the layer's forward (or backward) compute for the overlap to
hide it; PCIe 5 moves about 50 GB/s each way.

On a CPU device the same copies are made between host buffers (no streams), which keeps the
mechanism testable without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn as nn

__all__ = ["ActivationOffloader", "OffloadGroup"]

#: Smaller saved tensors stay on the device on GPUs: their copies would cost more launches than memory.
DEFAULT_MIN_BYTES = 1 << 20


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free block of memory in some order of its dimensions
    (contiguous, or a transpose or permutation of a contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _pool_key(t: torch.Tensor) -> tuple:
    """Host buffers are reused for tensors of the same shape, strides and dtype."""
    return tuple(t.shape), t.stride(), t.dtype


class _Saved:
    """One offloaded tensor: its host copy, and the device copy once it is fetched back."""

    __slots__ = ("host", "device", "copied_out", "fetched", "tensor")

    def __init__(self, host: torch.Tensor, copied_out: Optional[torch.cuda.Event]) -> None:
        self.host = host
        self.copied_out = copied_out  # the device-to-host copy's completion (CUDA)
        self.fetched: Optional[torch.cuda.Event] = None
        self.tensor: Optional[torch.Tensor] = None  # the device copy, after the fetch


@dataclass
class OffloadGroup:
    """The offloaded tensors of one layer call (one micro-batch through one layer)."""

    saved: list = field(default_factory=list)
    prefetched: bool = False


class ActivationOffloader:
    """Offloads the saved activations of the layers of one model chunk (see the module docstring).

    ``num_layers``: how many of the chunk's first layers offload (default: all but the last).
    ``min_bytes``: tensors smaller than this stay on the device (default 1 MiB on CUDA, 0 on CPU).
    ``offloaded_bytes`` / ``offloaded_tensors``: what has been moved so far (tests, reports).
    """

    def __init__(self, module: nn.Module, device: torch.device, num_layers: Optional[int] = None,
                 min_bytes: Optional[int] = None) -> None:
        self.device = device
        self.num_layers = num_layers
        self.cuda = device.type == "cuda"
        self.min_bytes = (DEFAULT_MIN_BYTES if self.cuda else 0) if min_bytes is None else min_bytes
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        # Storages of the parameters: a saved weight (or a view of it) must not be copied.
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()
                                if p.device.type != "meta"}
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0

    def refresh_parameters(self, module: nn.Module) -> None:
        """Re-read the parameters' storages (after they were materialised or moved)."""
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}

    # -- forward ------------------------------------------------------------------------------------

    def offloads(self, position: int, count: int) -> bool:
        """Whether the chunk's layer at ``position`` (of ``count``) offloads: never the last one, whose
        backward follows its forward at once; with ``num_layers``, only that many of the first ones."""
        limit = count - 1 if self.num_layers is None else min(self.num_layers, count - 1)
        return position < limit

    @contextlib.contextmanager
    def layer(self, offload: bool = True) -> Iterator[OffloadGroup]:
        """Run one layer call inside this context; its saved tensors go to host memory if ``offload``."""
        group = OffloadGroup()
        if not offload or not torch.is_grad_enabled():
            yield group
            return
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            yield group

    def fetch_when_backward_reaches(self, output: torch.Tensor, group: OffloadGroup,
                                    previous: Optional[OffloadGroup]) -> None:
        """When the gradient of ``output`` (this layer's output) arrives, fetch this layer's tensors
        and start fetching the previous layer's, whose backward comes next."""
        if not output.requires_grad or (not group.saved and (previous is None or not previous.saved)):
            return

        def hook(grad: torch.Tensor) -> None:
            self._prefetch(group)
            if previous is not None:
                self._prefetch(previous)

        output.register_hook(hook)

    def _keeps(self, t: torch.Tensor) -> bool:
        return (t.device.type != self.device.type or t.is_sparse or t.numel() * t.element_size() < self.min_bytes
                or not is_dense(t) or t.untyped_storage().data_ptr() in self._param_storages)

    def _pack(self, t: torch.Tensor, group: OffloadGroup):
        if self._keeps(t):
            return t
        host = self._host_buffer(t)
        if self.cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            self._stream.wait_event(produced)
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
                copied = self._stream.record_event()
            # The device memory may be freed by the forward before the copy ran: the allocator must
            # not hand it out again until the side stream is done with it.
            t.record_stream(self._stream)
        else:
            host.copy_(t)
            copied = None
        saved = _Saved(host, copied)
        group.saved.append(saved)
        self.offloaded_bytes += t.numel() * t.element_size()
        self.offloaded_tensors += 1
        return saved

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor with ``t``'s shape and strides (so the copies are one block each way)."""
        free = self._pool.get(_pool_key(t))
        if free:
            return free.pop()
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    # -- backward -----------------------------------------------------------------------------------

    def _prefetch(self, group: OffloadGroup) -> None:
        if group.prefetched:
            return
        group.prefetched = True
        for saved in group.saved:
            self._fetch(saved)

    def _fetch(self, saved: _Saved) -> None:
        if saved.tensor is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self._stream):
                saved.tensor = saved.host.to(self.device, non_blocking=True)
                saved.fetched = self._stream.record_event()
        else:
            saved.tensor = saved.host.clone()
        # The host buffer is free for the next forward once the copy back is queued: every later
        # copy into it runs on the same side stream, after this one.
        self._pool.setdefault(_pool_key(saved.host), []).append(saved.host)
        saved.host = None

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.host is None and saved.tensor is None:
            raise RuntimeError("--offload-activations: a saved activation was read a second time (a backward "
                               "with retain_graph=True); offloaded activations can be read once")
        self._fetch(saved)
        tensor, saved.tensor = saved.tensor, None  # the layer's backward holds it from here, not the group
        if self.cuda and saved.fetched is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.fetched)
            tensor.record_stream(current)  # allocated on the side stream, used on this one
            saved.fetched = None
        return tensor
