"""Memory the sharded data-parallel strategies allocate only while a step runs, from a rank's bucket layout.

Between steps ZeRO-2 (``optim_grads``) and ZeRO-3 (``optim_grads_params``) keep shards
(:mod:`meshtron.planning.static_memory`); during a step they also hold:

- ZeRO-3, gathered weights (:mod:`meshtron.optim.sharded_params`): a model chunk's root unit (embedding,
  final norm, output layer) stays gathered through the chunk's forward and, from the chunk's first
  backward hook, through its backward; each transformer layer is gathered while it runs, with the next
  one (forward) or the previous one (backward) prefetched, and freed after its forward and once its
  gradients are in. At most: the root's buckets plus the two largest neighbouring layers' buckets.
- ZeRO-2 and ZeRO-3, reduction buckets (:mod:`meshtron.optim.sharded_grads`): a bucket's full-size
  gradient tensor (in the reduction dtype) from its first gradient to the end of its reduce-scatter, and the
  scattered shard; up to ``MAX_IN_FLIGHT`` reduce-scatters stay in flight (their inputs and outputs alive)
  before the oldest is waited for, also across micro-batches. :func:`reduction_bucket_bytes` replays that
  over the order in which backward produces gradients (:func:`gradient_arrival_order`: the output layer
  and final norm first, the layers from the last, the embedding last; chunks in reverse order), once per
  micro-batch.

``tests/planning/test_static_memory.py`` compares both figures with a real multi-process run's allocations.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch.nn as nn

from meshtron.optim.buckets import BufferLayout
from meshtron.optim.sharded_grads import MAX_IN_FLIGHT
from meshtron.optim.sharded_params import unit_modules, unit_of_params


def gathered_weight_bytes(layout: BufferLayout, chunks: Sequence[nn.Module], weight_bytes: int) -> int:
    """Most bytes of full (gathered) weight buckets a ZeRO-3 rank holds at once (``layout`` from
    :func:`meshtron.optim.sharded_params.unit_layout`)."""
    owner = unit_of_params(chunks)
    units: dict[tuple[int, int], int] = {}  # (chunk, unit) -> elements of its buckets
    for bucket in layout.buckets:
        key = owner[id(layout.params[bucket.param_indices[0]])]
        units[key] = units.get(key, 0) + bucket.numel
    peak = 0
    for c, chunk in enumerate(chunks):
        root_index = len(unit_modules(chunk)) - 1  # unit_of_params numbers the root after the layers
        root = units.get((c, root_index), 0)
        layers = [n for (cc, u), n in sorted(units.items()) if cc == c and u != root_index]
        pairs = [a + b for a, b in zip(layers, layers[1:])] or layers
        peak = max(peak, root + max(pairs, default=0))
    return peak * weight_bytes


def gradient_arrival_order(layout: BufferLayout, chunks: Sequence[nn.Module]) -> list[int]:
    """Indices into ``layout.params`` in the order one micro-batch's backward produces their gradients.

    Per chunk, last chunk first: the chunk's own parameters (the output layer's weight, read by the loss,
    whose backward runs first; ``parameters()`` lists them before the submodules'), then the others in
    reverse registration order (final norm, layers from the last, embedding: a tied embedding's gradient is
    complete only when the embedding's own part arrives)."""
    index = {id(p): i for i, p in enumerate(layout.params)}
    order: list[int] = []
    for chunk in reversed(chunks):
        own = list(chunk.parameters(recurse=False))
        mine = {id(p) for p in own}
        order += [index[id(p)] for p in own]
        order += [index[id(p)] for p in reversed(list(chunk.parameters())) if id(p) not in mine]
    return order


def reduction_bucket_bytes(layout: BufferLayout, chunks: Sequence[nn.Module], reduce_bytes: int,
                           micro_batches: int) -> int:
    """Most bytes of temporary gradient buckets (full tensors and scattered shards) alive at once during the
    backward passes of one step under ZeRO-2 / ZeRO-3 (see the module docstring)."""
    order = gradient_arrival_order(layout, chunks)
    remaining: dict[int, int] = {}  # open bucket -> gradients still to come
    open_bytes = 0
    in_flight: deque = deque()  # bytes each in-flight reduction keeps (input and output)
    peak = 0
    for _ in range(max(1, micro_batches)):
        for i in order:
            b = layout.bucket_of_param[i]
            bucket = layout.buckets[b]
            if b not in remaining:  # the first gradient allocates the bucket's full tensor
                remaining[b] = len(bucket.param_indices)
                open_bytes += bucket.numel * reduce_bytes
                peak = max(peak, open_bytes + sum(in_flight))
            remaining[b] -= 1
            if remaining[b]:
                continue
            del remaining[b]  # complete: its reduce-scatter's output is allocated, the input kept in flight
            full = bucket.numel * reduce_bytes
            shard = bucket.shard_size * reduce_bytes if bucket.reduce.size > 1 else 0
            peak = max(peak, open_bytes + shard + sum(in_flight))
            open_bytes -= full
            in_flight.append(full + shard)
            while len(in_flight) > MAX_IN_FLIGHT:
                in_flight.popleft()
    return peak
