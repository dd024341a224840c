"""Collectives for checkpointing, on a gloo group of their own.

Checkpoint coordination (DCP's planning, the all-ranks-done check before the
``latest`` pointer moves) runs on a dedicated gloo group: an asynchronous save
runs these collectives in a background thread while training issues its own
collectives on the other groups, and two threads must never share a group.
Without torch.distributed everything here degrades to the one-process case.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from meshtron.parallel.context import ParallelContext

def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_group(ctx: Optional[ParallelContext]) -> Optional[dist.ProcessGroup]:
    """The checkpoint gloo group over all ranks (created on first use, kept in ``ctx.later_groups``).

    Creating it is collective: every rank must reach the first save/load together, which
    the train loop guarantees. Returns None in a one-process run.
    """
    if not is_distributed():
        return None
    later = getattr(ctx, "later_groups", None)
    if later is not None and later.checkpoint is not None:
        return later.checkpoint
    # The job's collective timeout (--distributed-timeout-minutes), so that a stuck save is bounded like training.
    timeout = getattr(ctx, "timeout", None) or datetime.timedelta(minutes=10)
    group = dist.new_group(backend="gloo", timeout=timeout)
    if later is not None:
        later.checkpoint = group
    return group


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup]) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if group is None:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Optional[dist.ProcessGroup], src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    if group is not None:
        dist.barrier(group=group)


def agree_or_raise(error: Optional[str], group: Optional[dist.ProcessGroup], what: str) -> None:
    """Share every rank's error (None when fine); if any rank failed, raise the same error on all."""
    from meshtron.checkpoint.errors import CheckpointError

    errors = all_gather_object(error, group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(what, failed)
