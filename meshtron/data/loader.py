"""Per data-parallel rank iteration over a sample source, with prefetching.

Sample order contract: iteration ``i`` uses global samples ``i*G .. i*G + G - 1`` (G = global
batch size); data-parallel rank ``r`` of ``dp`` takes slots ``[r*G/dp, (r+1)*G/dp)`` of them and
cuts them into consecutive micro-batches (with ``--data-order megatron``, Megatron-LM's assignment
instead: rank ``r``'s micro-batch ``m`` holds slots ``[(m*dp + r)*mbs, (m*dp + r + 1)*mbs)``). The order
thus depends only on the seed, the data and G, never on the data-parallel size or micro-batch size, and a
rank reads only its own samples.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch

from meshtron.data.batching import BatchOptions, make_micro_batch
from meshtron.data.blended import SampleSource

T = TypeVar("T")

#: How long closing a prefetching iterator waits for its thread to finish the item in hand.
_JOIN_TIMEOUT_S = 30.0


class RankSampler:
    """Micro-batches of one data-parallel rank, iteration by iteration."""

    def __init__(self, dataset: SampleSource, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, options: BatchOptions, interleaved: bool = False) -> None:
        if global_batch_size % dp_size or (global_batch_size // dp_size) % micro_batch_size:
            raise ValueError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} "
                             f"x data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.options = options
        self.per_rank = global_batch_size // dp_size
        # Megatron-LM's sampler: micro-batch m of every rank comes from the m-th run of micro x DP samples,
        # rank r taking its r-th micro-batch of it (the global batch is the same either way).
        self.interleaved = interleaved

    @property
    def num_iterations(self) -> int:
        """Complete global batches the dataset holds."""
        return len(self.dataset) // self.global_batch_size

    def iteration(self, i: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of iteration ``i``."""
        mbs = self.micro_batch_size
        if self.interleaved:
            first = i * self.global_batch_size + self.dp_rank * mbs
            step = mbs * self.dp_size
            return [make_micro_batch(self.dataset.samples(first + m * step, mbs), self.options)
                    for m in range(self.per_rank // mbs)]
        start = i * self.global_batch_size + self.dp_rank * self.per_rank
        block = self.dataset.samples(start, self.per_rank)
        return [make_micro_batch(block[m:m + mbs], self.options) for m in range(0, self.per_rank, mbs)]


def prefetch(produce: Callable[[int], T], indices: range, depth: int = 2) -> Iterator[T]:
    """``produce(i)`` for ``i`` in ``indices``, computed ahead by a background thread.

    Errors in the thread are raised in the consumer; abandoning the iterator stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item: tuple) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)  # wake up now and then to notice an abandoned iterator
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for i in indices:
                if not put(("item", produce(i))):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the consumer
            put(("error", exc))

    thread = threading.Thread(target=run, name="meshtron-data-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "item":
                yield value
            elif kind == "end":
                return
            else:
                raise value
    finally:
        stop.set()
        # Joined, not left running: a thread still inside a torch call when the interpreter exits
        # aborts the process. It notices ``stop`` within 0.1 s of finishing its current item.
        thread.join(timeout=_JOIN_TIMEOUT_S)


class _Iterations(torch.utils.data.Dataset):
    """A map-style dataset whose item ``i`` is iteration ``i``'s micro-batches (for DataLoader workers)."""

    def __init__(self, sampler: RankSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return self.sampler.num_iterations

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return self.sampler.iteration(i)


def _keep(item: Any) -> Any:
    return item


def iterate(sampler: RankSampler, start: int, stop: int, num_workers: int = 0, depth: int = 2) -> Iterator[list[dict]]:
    """Iterations ``start .. stop - 1`` of ``sampler``: in worker processes when ``num_workers > 0``,
    else in a background thread. Pinning follows ``sampler.options.pin_memory``."""
    if stop <= start:
        return iter(())
    if num_workers <= 0:
        return prefetch(sampler.iteration, range(start, stop), depth)
    pin = sampler.options.pin_memory
    unpinned = RankSampler(sampler.dataset, sampler.global_batch_size, sampler.micro_batch_size, sampler.dp_rank,
                           sampler.dp_size, BatchOptions(**{**sampler.options.__dict__, "pin_memory": False}),
                           sampler.interleaved)
    loader = torch.utils.data.DataLoader(_Iterations(unpinned), batch_size=None, sampler=range(start, stop),
                                         num_workers=num_workers, collate_fn=_keep, pin_memory=pin,
                                         prefetch_factor=depth)
    return iter(loader)
