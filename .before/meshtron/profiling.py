"""Where a training step's GPU time goes: communication kernels, and how much of them compute hides.

:func:`profile_communication` runs a callable (one training step) under torch.profiler and
reads the GPU kernel timeline: NCCL kernels are communication, every other kernel is compute.
Communication is *exposed* where no compute kernel runs at the same time, i.e. the GPU waits on
the network; the rest overlaps compute. The interval arithmetic is plain Python on the kernels'
start/end times, so it is the same on any device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

Interval = tuple[float, float]

#: NCCL kernel name fragments -> collective kind (all-to-all and point-to-point run as SendRecv).
_KINDS = (("AllGather", "all_gather"), ("ReduceScatter", "reduce_scatter"), ("AllReduce", "all_reduce"),
          ("SendRecv", "send_recv"), ("Send", "send_recv"), ("Recv", "send_recv"), ("Broadcast", "broadcast"))


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total_length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merge_intervals(intervals))


def exposed_length(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Length of the union of ``comm`` not covered by the union of ``compute``."""
    busy = merge_intervals(compute)
    exposed, i = 0.0, 0
    for start, end in merge_intervals(comm):  # both sorted and disjoint: one sweep
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        covered, j = 0.0, i
        while j < len(busy) and busy[j][0] < end:
            covered += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
        exposed += (end - start) - covered
    return exposed


def collective_kind(kernel_name: str) -> str | None:
    """The collective an NCCL kernel belongs to, or None for a kernel that is not NCCL's."""
    if "nccl" not in kernel_name.lower():
        return None
    for fragment, kind in _KINDS:
        if re.search(fragment, kernel_name):
            return kind
    return "other"


@dataclass
class CommunicationProfile:
    """GPU kernel time of one profiled step, in seconds."""

    compute_s: float = 0.0  # union of non-NCCL kernels
    comm_s: float = 0.0  # union of NCCL kernels
    exposed_comm_s: float = 0.0  # NCCL time with no compute kernel running
    by_kind_s: dict[str, float] = field(default_factory=dict)  # union per collective kind

    @classmethod
    def from_kernels(cls, kernels: Sequence[tuple[str, float, float]]) -> "CommunicationProfile":
        """From (name, start, end) of every GPU kernel, times in microseconds."""
        comm, compute, kinds = [], [], {}
        for name, start, end in kernels:
            kind = collective_kind(name)
            if kind is None:
                compute.append((start, end))
            else:
                comm.append((start, end))
                kinds.setdefault(kind, []).append((start, end))
        return cls(compute_s=total_length(compute) / 1e6, comm_s=total_length(comm) / 1e6,
                   exposed_comm_s=exposed_length(comm, compute) / 1e6,
                   by_kind_s={k: total_length(v) / 1e6 for k, v in sorted(kinds.items())})


def profile_communication(step: Callable[[], object], device: torch.device) -> CommunicationProfile:
    """Run ``step`` once under torch.profiler and split its GPU kernel time (zeros without CUDA)."""
    if device.type != "cuda":
        step()
        return CommunicationProfile()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return CommunicationProfile.from_kernels(gpu_kernels(prof.events(), DeviceType.CUDA))


def gpu_kernels(events: Iterable, device_type: object) -> list[tuple[str, float, float]]:
    """(name, start, end) of the profiler events that ran on ``device_type``, without the GPU-side
    copies of ``record_function`` ranges (user annotations such as ``nccl:all_gather``): those span
    whole regions of the timeline and would count as kernels that cover everything."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == device_type and not getattr(e, "is_user_annotation", False)]
