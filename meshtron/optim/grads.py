"""Gradient reduction after (or overlapped with) the backward pass.

Three kinds of sums make every rank's gradients those of the whole model:

* over TP for parameters replicated across TP ranks whose inputs were sequence
  shards (sequence parallelism), and over the key/value replica group for GQA
  projections replicated when TP exceeds the query groups;
* over data-parallel x context-parallel ranks for everything (expert parameters:
  over the expert-data-parallel group). The loss is already normalised by the
  global token count, so this is a sum, not a mean: the result equals one process;
* over the embedding group (first and last pipeline stage) for tied embeddings.

The three are sums over different sets of ranks, so they commute; the order is
chosen for the layouts they need. TP/KV sums run first, bucket by bucket, just
before the bucket's data-parallel collective: they need nothing of the buffer
layout. The embedding sum runs last, after the data-parallel collective: the
embedding has a bucket of its own (see buckets.py), laid out identically on both
stages, so even after a reduce-scatter each rank's shard covers the same elements
there, and only that shard needs summing.

The data-parallel collectives run per bucket. With ``overlap`` they start during the
last micro-batch's backward (after :meth:`GradientSync.start_overlap`), as soon as a
bucket's last gradient has been accumulated; :meth:`GradientSync.finish` launches any
bucket not started yet (parameters without a gradient this step, or chunks whose last
backward ran earlier) and waits for all of them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.optim.buckets import Bucket, BufferLayout, replica_all_reduce, single_bucket_layout
from meshtron.optim.collectives import reduce_scatter_single
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of

WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _all_reduce_coalesced(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Sum ``tensors`` over ``group`` with one collective (flatten, reduce, copy back)."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def kv_replica_params(model_chunks: Sequence[nn.Module]) -> dict:
    """{key/value replica group: [parameters]} for GQA projections replicated over a TP subgroup."""
    groups: dict = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            group = getattr(module, "kv_group", None)
            if group is not None:
                kv = module.kv
                for p in (kv.weight, kv.bias):
                    if p is not None:
                        groups.setdefault(group, []).append(p)
    return groups


def embeddings_tied(model_chunks: Sequence[nn.Module]) -> bool:
    """Whether the last pipeline stage holds a copy of the word embedding whose gradient is summed with the
    first stage's: the model ties its input embedding and output layer, or (untied, PP > 1) the multi-token
    prediction depths read the input embedding there (read from the chunks' model config)."""
    for chunk in model_chunks:
        cfg = getattr(chunk, "cfg", None)
        if cfg is not None:
            ctx = getattr(chunk, "ctx", None)
            mtp_copy = bool(cfg.mtp_num_layers) and ctx is not None and ctx.pp > 1
            return not cfg.untie_embeddings_and_output_weights or mtp_copy
    return False


def tied_embedding_params(model_chunks: Sequence[nn.Module], params: Sequence[nn.Parameter],
                          ctx: ParallelContext) -> list[nn.Parameter]:
    """The word-embedding copies summed over the embedding group (first/last stage, tied, PP > 1)."""
    if ctx.embedding_group is None or not embeddings_tied(model_chunks):
        return []
    return [p for p in params if spec_of(p).pieces[0].name == WORD_EMBEDDING]


class GradientSync:
    """Performs the reductions above on the main gradients held in ``grad_buffer``.

    ``reduce_scatter`` (distributed optimizer): each bucket is reduce-scattered, so that
    afterwards only this rank's shard of every bucket holds the summed gradient.
    ``buckets_started_in_backward`` counts the buckets of the last step whose
    collective started inside the backward pass (the overlapped ones).
    """

    def __init__(self, model_chunks: Sequence[nn.Module], params: Sequence[nn.Parameter], ctx: ParallelContext,
                 grad_buffer: GradBuffer, overlap: bool = False, reduce_scatter: bool = False):
        self.ctx = ctx
        self.buffer = grad_buffer
        self.layout: BufferLayout = grad_buffer.layout or single_bucket_layout(params, ctx)
        if reduce_scatter and grad_buffer.layout is None:
            raise ValueError("reduce-scatter needs a bucketed, padded layout (meshtron.optim.buckets.build_layout)")
        self.overlap = overlap
        self.reduce_scatter = reduce_scatter
        index_of = {id(p): i for i, p in enumerate(self.layout.params)}
        self._bucket_of = {id(p): self.layout.bucket_of_param[i] for i, p in enumerate(self.layout.params)}

        # Sums that must precede each bucket's data-parallel collective: [(group, [main grads])].
        pre: list[dict] = [{} for _ in self.layout.buckets]
        tp_params = [p for p in params if spec_of(p).grad_sync == "tp"]
        if ctx.tp_group is not None:
            for p in tp_params:
                pre[self._bucket_of[id(p)]].setdefault(ctx.tp_group, []).append(p)
        for group, ps in kv_replica_params(model_chunks).items():
            for p in ps:
                pre[self._bucket_of[id(p)]].setdefault(group, []).append(p)
        self._pre_sync = [[(g, ps) for g, ps in d.items()] for d in pre]

        self._embedding = [(self.layout.buckets[self._bucket_of[id(p)]], index_of[id(p)])
                           for p in tied_embedding_params(model_chunks, params, ctx)]
        if reduce_scatter:
            for bucket, _ in self._embedding:
                if not bucket.isolated:
                    raise ValueError("a tied embedding shared across pipeline stages needs a bucket of its own "
                                     "with the distributed optimizer (build_layout(isolate=...))")

        n = len(self.layout.buckets)
        self._armed: list[bool] = [False] * n  # overlapped launch enabled for this bucket
        self._pending: list[int] = [0] * n
        self._ready: list[set] = [set() for _ in range(n)]
        self._started: list[bool] = [False] * n
        self._handles: list = []
        self._new_iteration = True
        self.buckets_started_in_backward = 0
        if overlap:
            if grad_buffer.on_grad_ready is not None:
                raise ValueError("the gradient buffer already reports ready gradients to another consumer")
            grad_buffer.on_grad_ready = self._grad_ready

    # --------------------------------------------------------------------------------- overlap
    def start_overlap(self, chunk: Optional[int] = None) -> None:
        """Called right before the last micro-batch's backward (of model chunk ``chunk``, or of all
        chunks): from then on a bucket of that chunk whose gradients are all accumulated starts its
        reduction at once (with ``overlap``).

        With interleaved pipeline schedules each chunk's last backward comes at a different time,
        and a chunk may still run earlier micro-batches' backward after another chunk's last one:
        call it per chunk, before that chunk's last backward.
        """
        if not self.overlap:
            return
        if self._new_iteration:
            self._new_iteration = False
            self.buckets_started_in_backward = 0
        for bucket in self.layout.buckets:
            if chunk is None or bucket.chunk == chunk:
                self._pending[bucket.index] = len(bucket.param_indices)
                self._ready[bucket.index] = set()
                self._armed[bucket.index] = True

    def _grad_ready(self, param: nn.Parameter) -> None:
        b = self._bucket_of[id(param)]
        if not self._armed[b]:
            return
        if self._started[b]:
            raise RuntimeError(
                "a parameter's gradient was accumulated again after its bucket's data-parallel reduction had "
                "started (a parameter used in two backward passes of the last micro-batch?); train without "
                "--overlap-grad-reduce, or call start_overlap() only before the last backward")
        if id(param) in self._ready[b]:
            return
        self._ready[b].add(id(param))
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._start(self.layout.buckets[b])
            self.buckets_started_in_backward += 1

    # --------------------------------------------------------------------------------- reductions
    def _start(self, bucket: Bucket) -> None:
        """Pre-sums of the bucket's parameters, then its data-parallel collective (asynchronous)."""
        self._started[bucket.index] = True
        for group, ps in self._pre_sync[bucket.index]:
            _all_reduce_coalesced([p.main_grad for p in ps], group)
        group = bucket.reduce.group
        if group is None:
            return
        region = self.buffer.region(bucket.start, bucket.end)
        if self.reduce_scatter:
            s, e = bucket.shard_range()
            work = reduce_scatter_single(self.buffer.region(s, e), region, group, async_op=True)
        else:
            work = dist.all_reduce(region, group=group, async_op=True)
        self._handles.append(work)

    def finish(self) -> None:
        """Start every bucket not started yet, wait for all, then sum the tied embeddings over stages."""
        self.buffer.zero_unwritten()  # parameters without a gradient this iteration hold last iteration's
        for bucket in self.layout.buckets:
            if not self._started[bucket.index]:
                self._start(bucket)
        for work in self._handles:
            work.wait()
        self._handles.clear()
        if self.reduce_scatter:  # hybrid sharding: sum the reduced shards over the replicas
            for bucket in self.layout.buckets:
                s, e = bucket.shard_range()
                work = replica_all_reduce(bucket, self.buffer.region(s, e), async_op=True)
                if work is not None:
                    self._handles.append(work)
            for work in self._handles:
                work.wait()
            self._handles.clear()
        n = len(self.layout.buckets)
        self._armed, self._started = [False] * n, [False] * n
        self._new_iteration = True
        self._sync_embeddings()

    def _sync_embeddings(self) -> None:
        for bucket, index in self._embedding:
            if self.reduce_scatter:
                s, e = bucket.shard_range()
                region = self.buffer.region(s, e)
            else:
                region = self.buffer.view_of(index)
            dist.all_reduce(region, group=self.ctx.embedding_group)
