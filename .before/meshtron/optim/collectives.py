"""Flat-tensor reduce-scatter and all-gather under the names of the installed torch.

torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single`` (the old names warn); older
releases have only the old names. Both accept an output that is a slice of the
input (in-place use), which the bucketed buffers rely on: a bucket is
reduce-scattered into this rank's shard of itself, and all-gathered from it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
                          async_op: bool = False):
    """Sum ``input`` over ``group``; rank r keeps the r-th equal part in ``output``."""
    return _REDUCE_SCATTER(output, input, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
                      async_op: bool = False):
    """Concatenate every rank's ``input`` (equal sizes, by rank) into ``output``."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)
