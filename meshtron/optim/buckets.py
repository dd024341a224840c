"""Where each parameter's gradient (and, with the distributed optimizer, its weight) lives in one flat buffer.

Parameters are laid out in reverse order of registration, the order in which
backward produces their gradients, and grouped into buckets of about
``--ddp-bucket-size`` elements. A bucket is the unit of data-parallel
communication: one all-reduce (or reduce-scatter / all-gather with the
distributed optimizer) per bucket, launched as soon as all of its gradients are
ready when ``--overlap-grad-reduce`` is on.

Rules that keep the collectives and the optimizer shards consistent:

* a bucket never mixes parameters reduced over different groups (dense
  parameters over DP x CP, expert parameters over the expert-data-parallel group)
  nor parameters of different model chunks (virtual pipeline stages);
* a bucket's padded size is a multiple of ``group size x align``, so that it splits
  into equal, aligned shards: data-parallel rank ``r`` of the bucket's group owns the
  contiguous range ``[start + r*s, start + (r+1)*s)`` with ``s = padded size / group size``;
* a parameter marked ``isolate`` (the word embedding shared by the first and the
  last pipeline stage) gets a bucket of its own, so that both stages lay it out the
  same way and their shards cover the same elements;
* with ``whole=True`` (an optimizer whose layout need is whole parameters per owner,
  :mod:`meshtron.optim.registry`, e.g. Muon) no parameter straddles two shards: a bucket's
  members are split into as many contiguous runs as its group has ranks, balanced by size,
  and every shard is padded to the largest run (rank ``r`` then owns the parameters of run ``r``
  whole). The collectives stay equal-sized reduce-scatters and all-gathers; the price is the padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch.distributed as dist
import torch.nn as nn

from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of

DEFAULT_ALIGN = 64  # elements: shard boundaries on 256-byte (fp32) / 128-byte (bf16) addresses


def default_bucket_size(data_parallel_size: int) -> int:
    """Megatron's default bucket size: max(40M, 1M x data-parallel size) elements."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


@dataclass
class ReduceGroup:
    """The process group over which a bucket's gradients are summed (and its shards split), with this rank's
    index in it.

    With hybrid sharding (``--num-distributed-optimizer-instances R``) ``group`` is this rank's shard
    group (S ranks) and ``replica`` the group of the R ranks that hold the same shard in the other shard
    groups: a bucket is reduce-scattered over ``group``, then its shard all-reduced over ``replica``.
    """

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    expert: bool = False
    replica: Optional[dist.ProcessGroup] = None
    replicas: int = 1
    replica_rank: int = 0


def dense_group(ctx: ParallelContext) -> ReduceGroup:
    if ctx.dp_cp_replicas > 1:
        return ReduceGroup(ctx.dp_cp_shard_group, ctx.dp_cp_shard, ctx.dp_cp_shard_rank,
                           replica=ctx.dp_cp_replica_group, replicas=ctx.dp_cp_replicas,
                           replica_rank=ctx.dp_cp_replica_rank)
    group = ctx.dp_cp_group
    return ReduceGroup(group, ctx.dp * ctx.cp, dist.get_rank(group) if group is not None else 0)


def expert_group(ctx: ParallelContext) -> ReduceGroup:
    if ctx.dp_cp_replicas > 1:  # validation refuses hybrid sharding with EP > 1: the expert-DP group is DP x CP
        hybrid = dense_group(ctx)
        hybrid.expert = True
        return hybrid
    group = ctx.expert_dp_group
    return ReduceGroup(group, ctx.expert_dp, dist.get_rank(group) if group is not None else 0, expert=True)


def replica_all_reduce(bucket: "Bucket", shard, async_op: bool = False):
    """Hybrid sharding: sum a bucket's reduced ``shard`` over its replica group (None without one)."""
    if bucket.reduce.replica is None:
        return None
    return dist.all_reduce(shard, group=bucket.reduce.replica, async_op=async_op)


@dataclass
class Bucket:
    """A contiguous range ``[start, end)`` of the flat buffer (``end`` includes the padding)."""

    index: int
    start: int
    end: int
    param_indices: list[int]
    reduce: ReduceGroup
    chunk: int = 0
    isolated: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.reduce.size

    def shard_range(self, rank: Optional[int] = None) -> tuple[int, int]:
        """The part of this bucket owned by ``rank`` (default: this rank) of its reduce group."""
        r = self.reduce.rank if rank is None else rank
        return self.start + r * self.shard_size, self.start + (r + 1) * self.shard_size


@dataclass
class BufferLayout:
    """Offsets of ``params`` (in their given order) in a flat buffer of ``numel`` elements, and its buckets."""

    params: list[nn.Parameter]
    offsets: list[tuple[int, int]]  # (start, numel) of params[i]
    buckets: list[Bucket]
    numel: int
    bucket_of_param: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.bucket_of_param:
            self.bucket_of_param = [0] * len(self.params)
            for b in self.buckets:
                for i in b.param_indices:
                    self.bucket_of_param[i] = b.index


def _close(open_buckets: dict, key, finished: list) -> None:
    members = open_buckets.pop(key, None)
    if members:
        finished.append((key, members))


def build_layout(chunk_params: Sequence[Sequence[nn.Parameter]], ctx: ParallelContext, bucket_size: int,
                 align: int = DEFAULT_ALIGN, isolate: Callable[[nn.Parameter], bool] = lambda p: False,
                 whole: bool = False) -> BufferLayout:
    """Assign every parameter of every model chunk a range in one flat buffer, grouped in buckets.

    ``chunk_params[c]`` are chunk ``c``'s parameters in registration order; the returned
    layout's ``params`` is their concatenation in that order (the order optimizers and
    checkpoints index), while offsets follow the reverse order within each chunk.
    """
    if bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size must be positive (got {bucket_size})")
    dense, expert = dense_group(ctx), expert_group(ctx)
    params: list[nn.Parameter] = []
    groups: list[tuple[int, ReduceGroup, bool, list[int]]] = []  # (chunk, reduce group, isolated, param indices)
    for chunk, plist in enumerate(chunk_params):
        first = len(params)
        params.extend(plist)
        open_buckets: dict = {}
        sizes: dict = {}
        finished: list = []
        for i in reversed(range(first, len(params))):
            p = params[i]
            is_expert = spec_of(p).expert
            if isolate(p):
                finished.append(((is_expert, True, i), [i]))
                continue
            key = (is_expert, False)
            open_buckets.setdefault(key, []).append(i)
            sizes[key] = sizes.get(key, 0) + p.numel()
            if sizes[key] >= bucket_size:
                _close(open_buckets, key, finished)
                sizes[key] = 0
        for key in list(open_buckets):
            _close(open_buckets, key, finished)
        # Buckets in the order their first gradient becomes ready (their first member's position).
        finished.sort(key=lambda item: -item[1][0])
        for key, members in finished:
            is_expert, isolated = key[0], key[1]
            groups.append((chunk, expert if is_expert else dense, isolated, members))
    return place_buckets(params, groups, align, whole=whole)


def owner_runs(sizes: Sequence[int], ranks: int) -> tuple[list[int], int]:
    """Split ``sizes`` (in order) into at most ``ranks`` contiguous runs, minimising the largest run's sum:
    (the run index of each size, that largest sum). Runs past the last size are empty."""
    if not sizes:
        return [], 0

    def runs_for(limit: int) -> Optional[list[int]]:
        out, run, total = [], 0, 0
        for n in sizes:
            if total + n > limit and total > 0:
                run, total = run + 1, 0
            out.append(run)
            total += n
        return out if run < ranks else None

    lo, hi = max(max(sizes), -(-sum(sizes) // ranks)), sum(sizes)
    while lo < hi:  # the smallest largest-run for which the greedy split needs at most `ranks` runs
        mid = (lo + hi) // 2
        if runs_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return runs_for(lo), lo


def place_buckets(params: Sequence[nn.Parameter], groups: Sequence[tuple[int, ReduceGroup, bool, list[int]]],
                  align: int, whole: bool = False) -> BufferLayout:
    """Lay out ``groups`` (chunk, reduce group, isolated, parameter indices), in this order, one bucket each,
    in one flat buffer: members back to back, every bucket padded to a multiple of ``align`` times its
    reduce group's size (so that each rank's shard of it is aligned). ``whole``: every member inside one
    rank's shard (see the module docstring)."""
    offsets: list[tuple[int, int]] = [(0, 0)] * len(params)
    buckets: list[Bucket] = []
    cursor = 0
    for chunk, reduce, isolated, members in groups:
        start = cursor
        if whole and reduce.size > 1:
            runs, largest = owner_runs([params[i].numel() for i in members], reduce.size)
            shard = max(align, -(-largest // align) * align)
            filled = [0] * reduce.size
            for i, run in zip(members, runs):
                offsets[i] = (start + run * shard + filled[run], params[i].numel())
                filled[run] += params[i].numel()
            cursor = start + shard * reduce.size
        else:
            for i in members:
                offsets[i] = (cursor, params[i].numel())
                cursor += params[i].numel()
            multiple = reduce.size * align
            cursor = start + -(-(cursor - start) // multiple) * multiple
        buckets.append(Bucket(len(buckets), start, cursor, members, reduce, chunk, isolated))
    return BufferLayout(list(params), offsets, buckets, cursor)


def single_bucket_layout(params: Sequence[nn.Parameter], ctx: ParallelContext) -> BufferLayout:
    """Parameters in their given order, one bucket over DP x CP, no padding (the simplest layout)."""
    params = list(params)
    offsets, cursor = [], 0
    for p in params:
        offsets.append((cursor, p.numel()))
        cursor += p.numel()
    reduce = dense_group(ctx)
    if reduce.size > 1 and any(spec_of(p).expert for p in params):
        raise ValueError("expert parameters need build_layout() (they are reduced over the expert-data-parallel group)")
    return BufferLayout(params, offsets, [Bucket(0, 0, cursor, list(range(len(params))), reduce)], cursor)
