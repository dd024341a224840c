"""The distributed optimizer (ZeRO-1, ``--use-distributed-optimizer``), with optional CPU offload.

Every bucket of the flat buffers splits into equal contiguous shards, one per rank
of the bucket's data-parallel group (buckets.py). A rank keeps fp32 master weights
and Adam moments only for the parameter elements inside its shards (the
*segments*), steps them with the gradients that the reduce-scatter left there, and
writes the new weights into its shard of the flat parameter buffer; an all-gather
per bucket then gives every rank all the weights (param_buffer.py).

Memory per parameter with bf16 weights: 2 (weights) + 4 (fp32 gradients) + 12/DP
(fp32 master, Adam m and v), see :func:`meshtron.optim.accounting.bytes_per_parameter`.

What steps the segments is the run's optimizer (:mod:`meshtron.optim.registry`): its ``partitions``
(AdamW: :class:`~meshtron.optim.segment_adam.SegmentAdamW`); an optimizer that needs whole parameters
per owner gets a layout whose shards never cut a parameter (:func:`meshtron.optim.buckets.place_buckets`),
so each of its segments is a whole parameter. The state names of a parameter come from the same entry.

The same class also serves CPU offload without sharding (``shard=False``): the rank
then owns every bucket entirely and no all-gather runs.

Checkpoint interface (as :class:`~meshtron.optim.optimizer.MixedPrecisionAdamW`):
``params``, ``state_tensors(i)`` (full parameter-shaped tensors, gathered over the
bucket's group: a collective, so every rank calls it for every ``i`` in the same
order), ``load_state_tensors(i, tensors)`` (keeps this rank's segments),
``ensure_state()``, ``step_count``, ``set_step_count(n)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn as nn

from meshtron.config import OptimConfig
from meshtron.optim.buckets import BufferLayout
from meshtron.optim.collectives import all_gather_single
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.offload import Segment, split_for_offload
from meshtron.optim.optimizer import no_weight_decay
from meshtron.optim.registry import OptimizerKind, optimizer_kind, param_state_names
from meshtron.optim.shards import CompactShards

if TYPE_CHECKING:  # strategy.py imports this module
    from meshtron.optim.strategy import WeightGather


def owned_range(layout: BufferLayout, bucket_index: int, shard: bool, rank: Optional[int] = None) -> tuple[int, int]:
    bucket = layout.buckets[bucket_index]
    return bucket.shard_range(rank) if shard else (bucket.start, bucket.end)


def owned_segments(layout: BufferLayout, shard: bool, compact: Optional[CompactShards] = None) -> list[Segment]:
    """The pieces of parameters inside this rank's owned ranges, in buffer order. ``compact``: their
    ``buffer_offset`` addresses the compact shard tensors (the sharded strategies) instead of the full buffer."""
    out: list[Segment] = []
    for bucket in layout.buckets:
        lo, hi = owned_range(layout, bucket.index, shard)
        for i in sorted(bucket.param_indices, key=lambda j: layout.offsets[j][0]):
            start, n = layout.offsets[i]
            a, b = max(start, lo), min(start + n, hi)
            if b > a:
                where = a if compact is None else compact.compact_offset(bucket.index, a)
                out.append(Segment(i, a - start, where, b - a, not no_weight_decay(layout.params[i])))
    return out


class DistributedOptimizer:
    """The optimizer on this rank's shards of the flat buffers, then an all-gather of the weights."""

    def __init__(self, layout: BufferLayout, grad_data: Union[torch.Tensor, GradBuffer], param_data: torch.Tensor,
                 param_gather: "WeightGather", cfg: OptimConfig, shard: bool = True, offload_fraction: float = 0.0,
                 compact: Optional[CompactShards] = None, param_buffer=None,
                 kind: Optional[OptimizerKind] = None, ctx=None):
        """``grad_data`` / ``param_data``: the flat gradient and weight tensors the segments address (the
        full buffers, or with ``compact`` this rank's compact shards; the gradients may be a GradBuffer whose
        buckets are tensors of their own); ``param_gather`` brings the
        updated shards to every rank (:class:`meshtron.optim.strategy.WeightGather`); ``kind``: the optimizer
        that steps the segments (default ``--optimizer``'s), ``ctx`` the parallel context its parts may use."""
        self.layout = layout
        self.kind = kind if kind is not None else optimizer_kind(cfg.optimizer)
        self.params: list[nn.Parameter] = layout.params
        self.param_data, self.param_gather = param_data, param_gather
        self.param_buffer = param_buffer  # the full flat weights (a ParamBuffer), where the strategy has them
        self.shard = shard
        self.segments = owned_segments(layout, shard, compact)
        device_segments, host_segments = split_for_offload(self.segments, offload_fraction)
        self.host_parts = self.kind.partitions(host_segments, self.params, grad_data, param_data, cfg, ctx, True)
        self.device_parts = self.kind.partitions(device_segments, self.params, grad_data, param_data, cfg, ctx, False)
        self.parts = self.device_parts + self.host_parts
        # For every parameter: [(partition, position)] of its segments, in parameter-offset order.
        self._where: list[list[tuple[object, int]]] = [[] for _ in self.params]
        for part in self.parts:
            for pos, seg in enumerate(part.segments):
                self._where[seg.param_index].append((part, pos))
        for entries in self._where:
            entries.sort(key=lambda e: e[0].segments[e[1]].param_offset)
        self._step = 0
        self._has_state = False
        self._state_names = [param_state_names(self.kind, p) for p in self.params]

    def state_names(self, index: int) -> tuple[str, ...]:
        """The states kept for parameter ``index`` (the same on every rank, whoever owns it)."""
        return self._state_names[index]

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None) -> None:
        """One AdamW step at ``lr`` with the reduce-scattered gradients of this rank's shards, multiplied
        by ``grad_coef`` (the clipping coefficient) when given: only the shards this rank steps are scaled."""
        self.param_gather.wait_all()  # a gather still landing in the buffer must finish before we write it
        for part in self.host_parts:
            if grad_coef is not None:  # scaled on the device before the copy to the host
                part.scale_grads(grad_coef)
            part.fetch_grads()  # device -> host copies overlap the device partition's step
        for part in self.device_parts:
            part.step(lr, grad_coef, step_number=self._step + 1)
            part.store_params()
        for part in self.host_parts:
            part.step(lr)
            part.store_params()
        for part in self.host_parts:
            part.finish_store()
        self._step += 1
        self._has_state = True
        if self.shard:
            self.param_gather.start()

    def finish_param_gather(self) -> None:
        """Make the full weights readable outside a forward pass: wait for the weights' all-gather (with
        sharded weights: gather every bucket)."""
        self.param_gather.materialize()

    def weights_written(self) -> None:
        """The weights were written outside the optimizer (a checkpoint load): keep the shards in step."""
        self.param_gather.commit()

    # ----------------------------------------------------------------------------------- sizes
    @property
    def local_numel(self) -> int:
        """Parameter elements this rank keeps optimizer state for."""
        return sum(s.length for s in self.segments)

    def state_numel(self) -> dict[str, int]:
        """Elements of each kind of optimizer state held on this rank (the masters counted even
        where they are the fp32 weights themselves)."""
        out = {key: 0 for names in self._state_names for key in names}
        for part in self.parts:
            for pos in range(len(part.segments)):
                for key, t in part.state_of(pos).items():
                    out[key] += t.numel()
        return out

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on the device and on the host (masters, moments, staging)."""
        return {"device": sum(p.state_bytes() for p in self.device_parts),
                "host": sum(p.state_bytes() for p in self.host_parts)}

    # ----------------------------------------------------------------------------------- checkpoints
    @property
    def step_count(self) -> int:
        return self._step

    def set_step_count(self, step: int) -> None:
        self._step = step
        for part in self.parts:
            part.set_step(step)

    def ensure_state(self) -> None:
        """Create zeroed Adam moments (so a checkpoint can be loaded into them before any step)."""
        for part in self.parts:
            part.ensure_state(self._step)
        self._has_state = True

    def _param_range(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """[lo, hi) of parameter ``index`` (flattened) owned by ``rank`` of its bucket's group."""
        start, n = self.layout.offsets[index]
        lo, hi = owned_range(self.layout, self.layout.bucket_of_param[index], self.shard, rank)
        a, b = max(start, lo), min(start + n, hi)
        return (a - start, b - start) if b > a else (0, 0)

    @torch.no_grad()
    def state_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Full fp32 master and optimizer states of parameter ``index`` (collective over its bucket's group)."""
        self.param_gather.wait_all()
        param = self.params[index]
        keys = self.state_names(index) if self._has_state else ("master",)
        device = self.param_data.device
        lo, hi = self._param_range(index)
        mine = torch.zeros(len(keys), hi - lo, dtype=torch.float32, device=device)
        for part, pos in self._where[index]:
            seg = part.segments[pos]
            state = part.state_of(pos)
            a = seg.param_offset - lo
            for k, key in enumerate(keys):
                mine[k, a:a + seg.length].copy_(state[key])
        bucket = self.layout.buckets[self.layout.bucket_of_param[index]]
        group = bucket.reduce.group
        if not self.shard or group is None:
            full = mine
        else:
            ranges = [self._param_range(index, r) for r in range(bucket.reduce.size)]
            width = max(b - a for a, b in ranges)
            send = torch.zeros(len(keys), width, dtype=torch.float32, device=device)
            send[:, :hi - lo] = mine
            recv = torch.empty(bucket.reduce.size * len(keys) * width, dtype=torch.float32, device=device)
            all_gather_single(recv, send.reshape(-1), group)
            recv = recv.view(bucket.reduce.size, len(keys), width)
            full = torch.empty(len(keys), param.numel(), dtype=torch.float32, device=device)
            for r, (a, b) in enumerate(ranges):
                full[:, a:b] = recv[r, :, :b - a]
        return {key: full[k].view(param.shape) for k, key in enumerate(keys)}

    @torch.no_grad()
    def load_state_tensors(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors`: keep this rank's part of the given full tensors."""
        self.ensure_state()
        for key in self.state_names(index):
            if key not in tensors:
                continue
            flat = tensors[key].reshape(-1)
            for part, pos in self._where[index]:
                seg = part.segments[pos]
                part.load_segment(pos, key, flat[seg.param_offset:seg.param_offset + seg.length])
