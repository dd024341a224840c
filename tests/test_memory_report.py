"""The peak-memory report: replaying an allocator trace and grouping the blocks alive at the peak."""

from __future__ import annotations

from meshtron.memory_report import allocation_site, memory_report, peak_allocation_sites


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


FP8 = _frames(("/x/torch/_tensor.py", 10, "to"), ("/repo/meshtron/layers/fp8.py", 52, "forward"))
NORM = _frames(("/repo/meshtron/layers/norm.py", 30, "forward"))


def test_site_is_the_innermost_meshtron_frame():
    assert allocation_site(FP8) == "layers/fp8.py:52 forward"
    assert allocation_site(_frames(("/x/torch/nn/functional.py", 7, "linear"))) == "functional.py:7 linear"
    assert allocation_site([]) == "unknown"


def test_peak_and_the_blocks_alive_then():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": NORM},
        {"action": "alloc", "addr": 2, "size": 300, "frames": FP8},
        {"action": "alloc", "addr": 3, "size": 50, "frames": FP8},      # peak: 450
        {"action": "free_requested", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 2, "size": 300},           # a second free of the same block
        {"action": "alloc", "addr": 4, "size": 200, "frames": NORM},    # 350: below the peak
        {"action": "free_requested", "addr": 99, "size": 7},            # unknown block: ignored
    ]
    peak, sites = peak_allocation_sites(trace)
    assert peak == 450
    assert sites == [("layers/fp8.py:52 forward", 350), ("layers/norm.py:30 forward", 100)]


def test_report_without_cuda_is_none():
    assert memory_report() is None
