"""What holds the GPU memory at its peak: live allocations grouped by the code that made them.

:func:`record_memory` switches on the CUDA caching allocator's history (every allocation and free
with its Python stack); :func:`peak_allocation_sites` replays that trace, finds the moment of the
highest allocated total, and sums the blocks alive then by allocation site: the innermost frame in
meshtron's own code, so a report reads "layers/fp8.py:52 forward: 9.1 GiB". It answers where a
measured peak departs from ``meshtron.memory.estimate_memory``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import torch

#: Trace actions that end a block's life (the first one seen counts).
_FREES = ("free_requested", "free_completed")


def record_memory(enabled: bool = True, max_entries: int = 2_000_000) -> None:
    """Start (or stop) recording allocator history on CUDA; a no-op elsewhere."""
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def allocation_site(frames: list[dict], package: str = "meshtron/") -> str:
    """``file:line function`` of the innermost frame in ``package`` (else the innermost frame)."""
    chosen = next((f for f in frames if package in f.get("filename", "")), frames[0] if frames else None)
    if chosen is None:
        return "unknown"
    filename = chosen.get("filename", "?")
    short = filename.split(package, 1)[1] if package in filename else filename.rsplit("/", 1)[-1]
    return f"{short}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def trace_peak(events: list[dict]) -> tuple[int, int]:
    """(peak bytes allocated above the trace's start, index of the event that reached it; -1 for none)."""
    live: dict[int, int] = {}
    total = peak = 0
    peak_index = -1
    for i, event in enumerate(events):
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif action in _FREES and addr in live:
            total -= live.pop(addr)
    return peak, peak_index


def peak_allocation_sites(trace: Iterable[dict], top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """(peak allocated bytes, [(site, bytes alive at the peak)] largest first) from one device's trace."""
    events = list(trace)
    peak, peak_index = trace_peak(events)
    # Replay up to the peak, keeping each live block's site.
    alive: dict[int, tuple[int, str]] = {}
    for event in events[: peak_index + 1]:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            alive[addr] = (event["size"], allocation_site(event.get("frames", [])))
        elif action in _FREES:
            alive.pop(addr, None)
    by_site: dict[str, int] = defaultdict(int)
    for size, site in alive.values():
        by_site[site] += size
    return peak, sorted(by_site.items(), key=lambda kv: -kv[1])[:top]


def memory_report(device: Optional[torch.device] = None, top: int = 12) -> Optional[list[tuple[str, float]]]:
    """Top allocation sites at the recorded peak, in GiB (None without CUDA or without a recording)."""
    if not torch.cuda.is_available():
        return None
    snapshot = torch.cuda.memory._snapshot()
    index = (device.index if device is not None and device.index is not None else torch.cuda.current_device())
    traces = snapshot.get("device_traces", [])
    if index >= len(traces) or not traces[index]:
        return None
    _, sites = peak_allocation_sites(traces[index], top)
    return [(site, size / 2**30) for site, size in sites]
