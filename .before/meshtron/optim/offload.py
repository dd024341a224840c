"""CPU optimizer offload: which part of the optimizer's shard lives on the host, and the copies.

With ``--optimizer-cpu-offload`` the first ``--optimizer-offload-fraction`` of the
elements this rank updates (its whole range, or its shard with the distributed
optimizer) keep their fp32 master weights and Adam moments in host memory, and
their AdamW step runs on the CPU (torch's fused CPU kernel). Each step copies the
gradients of that part device -> host and the updated weights host -> device.

On CUDA the copies run on a side stream from/to pinned staging buffers with
``non_blocking=True``: the device-to-host copy of the gradients overlaps the GPU's
step of the part that stayed on the device, and the host-to-device copy of the
weights overlaps the data-parallel all-gather of other buckets. The optimizer
state itself is ordinary (pageable) host memory: it never moves, so pinning it
would only lock RAM. Without CUDA the same code runs with plain CPU tensors and
synchronous copies (the "host" part is then a separate copy of the state on the
same CPU), which keeps this path covered by CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch


@dataclass(frozen=True)
class Segment:
    """The part of parameter ``param_index`` this rank updates: ``length`` elements starting at
    ``param_offset`` in the flattened parameter, stored at ``buffer_offset`` in the flat buffers."""

    param_index: int
    param_offset: int
    buffer_offset: int
    length: int
    decay: bool


def split_for_offload(segments: Sequence[Segment], fraction: float) -> tuple[list[Segment], list[Segment]]:
    """(device segments, host segments): the first ``fraction`` of the elements go to the host.

    A segment crossing the boundary is cut in two, so the host part holds exactly
    ``round(fraction * total)`` elements.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be between 0 and 1 (got {fraction})")
    total = sum(s.length for s in segments)
    budget = round(fraction * total)
    host: list[Segment] = []
    device: list[Segment] = []
    for s in segments:
        if budget >= s.length:
            host.append(s)
            budget -= s.length
        elif budget > 0:
            host.append(replace(s, length=budget))
            device.append(replace(s, param_offset=s.param_offset + budget, buffer_offset=s.buffer_offset + budget,
                                  length=s.length - budget))
            budget = 0
        else:
            device.append(s)
    return device, host


class HostCopier:
    """Device <-> host copies for an offloaded partition (side stream and pinned staging on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._to_host_done = None

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer (pinned when copies go to a CUDA device)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start ``dst.copy_(src)`` for (host dst, device src) pairs; :meth:`wait_host` completes them."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # gradients final (clipped)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self._to_host_done = torch.cuda.Event()
            self._to_host_done.record(self.stream)

    def wait_host(self) -> None:
        if self._to_host_done is not None:
            self._to_host_done.synchronize()
            self._to_host_done = None

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start ``dst.copy_(src)`` for (device dst, host src) pairs; :meth:`wait_device` orders them
        before later work of the current stream."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def wait_device(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
