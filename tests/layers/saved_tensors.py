"""What an autograd graph keeps for backward, and the matmuls its backward runs (tests of saved activations)."""

from __future__ import annotations

from typing import Optional

import torch


def backward_matmuls(out: torch.Tensor, fp8: bool = False) -> int:
    """Run ``out``'s backward (of its squares' sum) and count the matmuls it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.square().sum().backward()
    kinds = ("aten::_scaled_mm",) if fp8 else ("aten::mm", "aten::addmm")
    return sum(e.count for e in prof.key_averages() if e.key in kinds)


def saved_storages(fn, *args, params, fp8_shapes: Optional[set] = None) -> tuple[torch.Tensor, dict[int, int]]:
    """``fn(*args)`` and the distinct storages its autograd graph saved (pointer -> bytes; ``params`` excluded).
    ``fp8_shapes`` collects the shapes of the saved one-byte tensors."""
    storages: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        if fp8_shapes is not None and t.element_size() == 1:
            fp8_shapes.add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, storages
