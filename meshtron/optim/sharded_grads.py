"""Gradients reduce-scattered as backward produces them, kept only as this rank's shards (ZeRO-2).

``--data-parallel-sharding-strategy optim_grads`` (and ``optim_grads_params``): no full gradient
buffer lives across micro-batches. When the first gradient of a bucket arrives, a temporary
full-size bucket tensor is allocated; each parameter's gradient is added into its view of it
(post-accumulate hook) and freed. When every parameter of the bucket has contributed, the bucket
is summed over TP / key-value replicas where needed (as :mod:`meshtron.optim.grads` does), then
reduce-scattered over its data-parallel group (asynchronously); when that completes, the result is
added into this rank's fp32 shard (:class:`~meshtron.optim.shards.CompactShards`) and the
temporary bucket is dropped. This happens for every micro-batch, so gradient accumulation sums
reduced shards: more communication than ``optim``, for 4 bytes/parameter x (1 - 1/DP) less memory.

The buckets' completion order must be the same on every rank of a bucket's group (the collectives
pair up by order), which holds when every rank runs the same schedule over the same model (a
parameter that gets a gradient on one rank gets one on all). :meth:`ShardedGradients.finish`
reduces the buckets still incomplete (parameters without a gradient), in layout order, waits for
all, then sums tied embeddings over the embedding group, shard by shard.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.optim.buckets import BufferLayout, replica_all_reduce
from meshtron.optim.collectives import reduce_scatter_single
from meshtron.optim.grads import _all_reduce_coalesced, kv_replica_params, tied_embedding_params
from meshtron.optim.shards import CompactShards, param_index, parameter_view
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of

#: Reduce-scatters kept in flight before the oldest is waited for (bounds the temporary buckets).
MAX_IN_FLIGHT = 2


class ShardedGradients:
    """This rank's reduced gradient shards (``data``, fp32), filled during backward."""

    def __init__(self, model_chunks: Sequence[nn.Module], layout: BufferLayout, ctx: ParallelContext,
                 reduce_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        self.layout, self.ctx = layout, ctx
        self.shards = CompactShards(layout)
        self.reduce_dtype = reduce_dtype
        device = device or layout.params[0].device
        self.data = torch.zeros(self.shards.numel, dtype=torch.float32, device=device)
        self._index = param_index(layout)
        n = len(layout.buckets)
        self._full: list[Optional[torch.Tensor]] = [None] * n
        self._arrived: list[set[int]] = [set() for _ in range(n)]
        self._reduced: list[bool] = [False] * n  # this iteration's shard holds a first sum
        self._in_flight: deque = deque()
        #: Called with a bucket's index once its gradients of this backward pass are all in (ZeRO-3 frees
        #: the bucket's gathered weights there).
        self.on_bucket_complete: Optional[Callable[[int], None]] = None

        pre: list[dict] = [{} for _ in layout.buckets]
        if ctx.tp_group is not None:
            for i, p in enumerate(layout.params):
                if spec_of(p).grad_sync == "tp":
                    pre[layout.bucket_of_param[i]].setdefault(ctx.tp_group, []).append(i)
        for group, ps in kv_replica_params(model_chunks).items():
            for p in ps:
                i = self._index[id(p)]
                pre[layout.bucket_of_param[i]].setdefault(group, []).append(i)
        self._pre_sync = [list(d.items()) for d in pre]
        params = layout.params
        self._embedding = [layout.bucket_of_param[self._index[id(p)]]
                           for p in tied_embedding_params(model_chunks, params, ctx)]
        for b in self._embedding:
            if not layout.buckets[b].isolated:
                raise ValueError("a tied embedding shared across pipeline stages needs a bucket of its own")
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]

    # ----------------------------------------------------------------------------------- backward
    def _accumulate(self, param: nn.Parameter) -> None:
        i = self._index[id(param)]
        b = self.layout.bucket_of_param[i]
        if self._full[b] is None:  # zeros: padding and parameters that never get a gradient sum to 0
            self._full[b] = torch.zeros(self.layout.buckets[b].numel, dtype=self.reduce_dtype,
                                        device=self.data.device)
        with torch.no_grad():
            parameter_view(self.layout, i, self._full[b]).add_(param.grad)
        param.grad = None
        self._arrived[b].add(i)
        if len(self._arrived[b]) == len(self.layout.buckets[b].param_indices):
            self._reduce(b)
            if self.on_bucket_complete is not None:
                self.on_bucket_complete(b)

    def _reduce(self, b: int) -> None:
        """TP / key-value pre-sums, then the bucket's asynchronous reduce-scatter."""
        full = self._full[b]
        self._full[b], self._arrived[b] = None, set()
        for group, indices in self._pre_sync[b]:
            _all_reduce_coalesced([parameter_view(self.layout, i, full) for i in indices], group)
        bucket = self.layout.buckets[b]
        group = bucket.reduce.group
        if group is None:
            self._in_flight.append((b, None, full))  # one rank: the whole bucket is the shard
        else:
            out = torch.empty(bucket.shard_size, dtype=full.dtype, device=full.device)
            self._in_flight.append((b, reduce_scatter_single(out, full, group, async_op=True), out))
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._retire()

    def _retire(self) -> None:
        b, work, out = self._in_flight.popleft()
        if work is not None:
            work.wait()
        lo, hi = self.shards.range_of(b)
        if self._reduced[b]:
            self.data[lo:hi].add_(out)
        else:
            self.data[lo:hi].copy_(out)
            self._reduced[b] = True

    # ----------------------------------------------------------------------------------- iteration
    def zero(self) -> None:
        """Start a new accumulation: the next reduced sums overwrite the shards."""
        self._reduced = [False] * len(self.layout.buckets)

    def finish(self) -> None:
        """Reduce the incomplete buckets (layout order), wait for all, sum tied embeddings over stages."""
        for b in range(len(self.layout.buckets)):
            if self._full[b] is not None:
                self._reduce(b)
        while self._in_flight:
            self._retire()
        for b, reduced in enumerate(self._reduced):
            if not reduced:  # no gradient at all this iteration (on every rank: see the module docstring)
                lo, hi = self.shards.range_of(b)
                self.data[lo:hi].zero_()
                self._reduced[b] = True
        # Hybrid sharding: the shards summed over this shard group are summed over the replicas, once per step
        # (the per-micro-batch sums add up first: fewer bytes across nodes).
        handles = [replica_all_reduce(bucket, self.data[slice(*self.shards.range_of(b))], async_op=True)
                   for b, bucket in enumerate(self.layout.buckets)]
        for work in handles:
            if work is not None:
                work.wait()
        for b in self._embedding:
            lo, hi = self.shards.range_of(b)
            dist.all_reduce(self.data[lo:hi], group=self.ctx.embedding_group)

    def drop_partial(self) -> None:
        """Forget temporary buckets and pending reductions of an abandoned execution (waits for them)."""
        while self._in_flight:
            b, work, _ = self._in_flight.popleft()
            if work is not None:
                work.wait()
        n = len(self.layout.buckets)
        self._full, self._arrived = [None] * n, [set() for _ in range(n)]
        self.data.zero_()
        self.zero()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
