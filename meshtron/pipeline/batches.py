"""Batches and the loss on pipeline ranks that do not read data or do not compute the loss.

Only the first stage (tokens) and the one with the loss (labels, loss mask: the last,
or the first under ZBV) read data; another stage needs just the number of micro-batches,
so it gets empty micro-batches. The loss is broadcast from its stage over the pipeline
group so that every rank reports the same value.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from meshtron.parallel.context import ParallelContext


def empty_micro_batches(num_micro_batches: int) -> list[dict]:
    """The micro-batches of a rank that reads no data: one empty dict per micro-batch."""
    return [{} for _ in range(num_micro_batches)]


def train_batches(data, ctx: ParallelContext, reads_data: bool, start_iteration: int,
                  num_micro_batches: int) -> Iterator[list[dict]]:
    """This rank's micro-batches for every iteration from ``start_iteration`` on.

    ``data`` is the run's :class:`meshtron.data.DataBundle`; ranks with ``reads_data`` False get
    empty micro-batches for as many iterations as they ask for.
    """
    if reads_data:
        yield from data.train_batches(start_iteration)
        return
    while True:
        yield empty_micro_batches(num_micro_batches)


def eval_batches(data, ctx: ParallelContext, reads_data: bool, num_micro_batches: int,
                 split: str = "valid", iteration: Optional[int] = None) -> Optional[Iterator[list[dict]]]:
    """Micro-batches of ``split`` ("valid", or "test": ``data.test_batches()``), or None without that data;
    ``iteration``: the training iteration the evaluation follows.

    With pipeline stages, the first stage tells the others (one broadcast per iteration)
    whether another iteration follows, so that middle stages, which have no data, run
    exactly as many as the data ranks.
    """
    batches = None
    if reads_data:
        # Megatron's order continues each validation where the previous one stopped: it needs the iteration.
        continues = split == "valid" and iteration is not None and getattr(data, "order", "meshtron") == "megatron"
        batches = data.valid_batches(iteration) if continues else getattr(data, f"{split}_batches")()
    if ctx.pp_group is None:
        return batches
    return _follow_first_stage(batches, ctx, num_micro_batches)


def _follow_first_stage(batches: Optional[Iterable[list[dict]]], ctx: ParallelContext,
                        num_micro_batches: int) -> Iterator[list[dict]]:
    it = iter(batches) if batches is not None else None
    while True:
        mbs = next(it, None) if it is not None else None
        more = torch.tensor([0 if mbs is None else 1], dtype=torch.int32, device=ctx.device)
        dist.broadcast(more, src=ctx.pp_ranks[0], group=ctx.pp_group)
        if not more.item():
            return
        yield mbs if mbs is not None else empty_micro_batches(num_micro_batches)


def broadcast_from_loss_stage(tensor: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``tensor`` as the pipeline stage with the loss holds it (the last; the first under ZBV), on every
    stage (in place; returned)."""
    if ctx.pp_group is not None:
        dist.broadcast(tensor, src=ctx.pp_ranks[ctx.loss_stage], group=ctx.pp_group)
    return tensor
