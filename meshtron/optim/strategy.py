"""The data-parallel strategy seam: gradient storage, its reduction, the weights' gather, and what the
optimizer steps, behind one interface per ``--data-parallel-sharding-strategy`` (Megatron-FSDP's names).

=====================  ======================  =====================  ==========================
strategy               weights per rank         gradients per rank     optimizer state per rank
=====================  ======================  =====================  ==========================
``no_shard``           all                      all (flat buffer)      all
``optim``              all (flat buffer)        all (flat buffer)      shard (ZeRO-1)
``optim_grads``        all (flat buffer)        shard (ZeRO-2)         shard
``optim_grads_params`` shard + one unit at use  shard                  shard (ZeRO-3)
=====================  ======================  =====================  ==========================

The trainer calls :meth:`DataParallelStrategy.zero` before an iteration, passes
:meth:`~DataParallelStrategy.start_overlap` to the pipeline schedule as ``on_chunk_grads_ready``,
and calls :meth:`~DataParallelStrategy.finish` after the last backward; the optimizer
(:class:`TrainingOptimizer`) then steps the gradients the strategy left (``grad_data``) on the weights
it addresses (``param_data``), and the strategy's :class:`WeightGather` brings updated weights to
every rank. Checkpoints read and write the model's parameters between
``optimizer.finish_param_gather()`` and ``optimizer.weights_written()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.nn as nn

from meshtron.config import SHARDING_STRATEGIES
from meshtron.optim.accounting import releases_gradients
from meshtron.optim.buckets import BufferLayout
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.grads import GradientSync
from meshtron.optim.param_buffer import ParamBuffer, ParamGather
from meshtron.optim.shards import CompactShards
from meshtron.optim.sharded_grads import ShardedGradients
from meshtron.optim.sharded_params import ShardedParams
from meshtron.parallel.context import ParallelContext
from meshtron.run_layout import shards_gradients, shards_state, shards_weights

#: ``--data-parallel-sharding-strategy`` values, from least to most sharded (the schema's one list).
STRATEGIES = SHARDING_STRATEGIES


class TrainingOptimizer(Protocol):
    """What the trainer and the checkpoint code use of an optimizer: an ``--optimizer`` entry's own
    (:mod:`meshtron.optim.registry`: MixedPrecisionAdamW, MixedPrecisionMuon) or the DistributedOptimizer."""

    params: list[nn.Parameter]  # every parameter of this rank, in the checkpoint's index order

    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None) -> None:
        """One step at ``lr`` with the reduced gradients, multiplied by ``grad_coef`` (clipping) when given."""

    def state_names(self, index: int) -> tuple[str, ...]:
        """The states kept for parameter ``index`` ("master" first), as the checkpoint names them."""

    def state_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Parameter ``index``'s states, parameter-shaped (for a sharded optimizer: a collective)."""

    def load_state_tensors(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors` (a master also updates the weight it stands for)."""

    def ensure_state(self) -> None:
        """Create zeroed states, so that a checkpoint can be saved or loaded before any step."""

    @property
    def step_count(self) -> int:
        """Steps taken (restored from a checkpoint by :meth:`set_step_count`)."""

    def set_step_count(self, step: int) -> None:
        """Set the step counter (bias corrections count from it)."""

    def finish_param_gather(self) -> None:
        """Make the full weights readable outside a forward pass."""

    def weights_written(self) -> None:
        """The weights were written outside the optimizer (a checkpoint load): follow them."""


class WeightGather(Protocol):
    """Brings the optimizer's updated weight shards to every rank (ParamGather, ShardedParams)."""

    def start(self) -> None: ...
    def wait_all(self) -> None: ...
    def materialize(self) -> None: ...
    def commit(self) -> None: ...
    def remove_hooks(self) -> None: ...


@dataclass(frozen=True)
class AllocatedBytes:
    """Bytes this strategy holds between steps on one rank (weights, gradients), as allocated."""

    weights: int
    gradients: int


class DataParallelStrategy:
    """Base of the strategies: the interface the trainer, the optimizer factory and the checkpoint use."""

    name: str = ""
    #: Whether the optimizer steps only this rank's shards (DistributedOptimizer with shard=True).
    shards_optimizer: bool = False
    layout: BufferLayout
    grad_data: Optional[torch.Tensor]  # the gradients the optimizer reads (full buffer or compact shards; None:
    # buckets that are tensors of their own, released between steps)
    grad_source: "torch.Tensor | GradBuffer"  # what the optimizer's views are made from (grad_data or the buffer)
    param_data: Optional[torch.Tensor] = None  # the weights it writes (None: the parameters themselves)
    gather: Optional[WeightGather] = None
    compact: Optional[CompactShards] = None  # set when grad_data / param_data are compact shards
    grad_buffer: Optional[GradBuffer] = None  # the full gradient buffer (no_shard, optim)
    grad_sync: Optional[GradientSync] = None  # its reduction
    param_buffer: Optional[ParamBuffer] = None  # the full flat weights (optim, optim_grads, offload)

    def zero(self) -> None:
        """Start an iteration's gradient accumulation."""
        raise NotImplementedError

    def start_overlap(self, chunk: Optional[int] = None) -> None:
        """Before model chunk ``chunk``'s last backward (``on_chunk_grads_ready``)."""

    def finish(self) -> None:
        """After the last backward: complete the gradient reduction."""
        raise NotImplementedError

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradients (zeroed before a re-run, corrupted by fault drills)."""
        return [self.grad_data]

    def local_gradients(self) -> Optional[list[torch.Tensor]]:
        """This rank's own gradients before the reduction, or None where they are reduced as they arrive."""
        return None

    def clear_gradients(self) -> None:
        """Zero every gradient (nothing of an abandoned execution stays behind)."""
        for t in self.gradient_tensors():
            t.zero_()

    def allocated(self) -> AllocatedBytes:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        raise NotImplementedError


class ReplicatedGradients(DataParallelStrategy):
    """``no_shard`` and ``optim``: a full flat gradient buffer, all-reduced or reduce-scattered per bucket."""

    def __init__(self, model_chunks: Sequence[nn.Module], layout: BufferLayout, ctx: ParallelContext,
                 grad_dtype: torch.dtype, shard: bool, overlap_grad_reduce: bool, overlap_param_gather: bool,
                 flat_weights: bool, release_grads: bool = False):
        """``release_grads``: free the gradient buckets from each iteration's start until backward reaches
        them (GradBuffer's ``release``); the optimizer reads the gradients through views made once
        (``grad_source``)."""
        self.name = "optim" if shard else "no_shard"
        self.shards_optimizer = shard
        self.layout = layout
        params = layout.params
        self.param_buffer: Optional[ParamBuffer] = None
        if flat_weights:  # the distributed optimizer (or CPU offload) addresses weights in one flat buffer
            # Before the gradient buffer: while the weights move into the flat buffer they exist twice, and
            # with the gradients beside them that moment was the rank's peak (a million-token llama3-8b rank:
            # 15 GiB of weights twice and 30 GiB of gradients, above its training steps).
            self.param_buffer = ParamBuffer(layout, ctx.device)
            self.param_data = self.param_buffer.data
        self.grad_buffer = GradBuffer(params, dtype=grad_dtype, device=ctx.device, layout=layout,
                                      release=release_grads)
        self.grad_sync = GradientSync(model_chunks, params, ctx, self.grad_buffer, overlap=overlap_grad_reduce,
                                      reduce_scatter=shard)
        self.grad_data = self.grad_buffer.data
        self.grad_source = self.grad_buffer if release_grads else self.grad_data
        if self.param_buffer is not None:
            self.gather = ParamGather(layout, self.param_buffer, model_chunks, overlap=shard and overlap_param_gather)

    def zero(self) -> None:
        self.grad_buffer.zero()

    def start_overlap(self, chunk: Optional[int] = None) -> None:
        self.grad_sync.start_overlap(chunk)

    def finish(self) -> None:
        self.grad_sync.finish()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return self.grad_buffer.tensors()

    def clear_gradients(self) -> None:
        if self.grad_buffer.releases:
            self.grad_buffer.release()  # the next gradients are copied in, the missing ones zeroed
        else:
            super().clear_gradients()

    def local_gradients(self) -> Optional[list[torch.Tensor]]:
        self.grad_buffer.zero_unwritten()
        return [self.grad_buffer.view_of(i) for i in range(len(self.layout.params))]

    def allocated(self) -> AllocatedBytes:
        """The gradients are counted whole, also where they are freed between steps (they are allocated
        from each backward to the next iteration's start)."""
        if self.param_buffer is not None:
            weights = self.param_buffer.data.numel() * self.param_buffer.data.element_size()
        else:
            weights = sum(p.numel() * p.element_size() for p in self.layout.params)
        return AllocatedBytes(weights, self.grad_buffer.bytes())

    def remove_hooks(self) -> None:
        self.grad_buffer.remove_hooks()
        if self.gather is not None:
            self.gather.remove_hooks()


class ShardedGradStrategy(DataParallelStrategy):
    """``optim_grads`` (ZeRO-2) and ``optim_grads_params`` (ZeRO-3): gradients kept as this rank's shards,
    reduce-scattered as backward produces them; with ``shard_params`` the weights are sharded too."""

    shards_optimizer = True

    def __init__(self, model_chunks: Sequence[nn.Module], layout: BufferLayout, ctx: ParallelContext,
                 grad_dtype: torch.dtype, shard_params: bool, overlap_param_gather: bool):
        self.name = "optim_grads_params" if shard_params else "optim_grads"
        self.layout = layout
        # The flat weights first, as above: while the weights move into it they exist twice.
        self.param_buffer = None if shard_params else ParamBuffer(layout, ctx.device)
        self.grads = ShardedGradients(model_chunks, layout, ctx, grad_dtype, ctx.device)
        self.compact = self.grads.shards
        self.grad_data = self.grad_source = self.grads.data
        if shard_params:
            self.sharded_params = ShardedParams(layout, model_chunks, ctx.device, prefetch=True)
            self.grads.on_bucket_complete = self.sharded_params.release_after_backward
            self.gather = self.sharded_params
            self.param_data = self.sharded_params.data
        else:
            gather = ParamGather(layout, self.param_buffer, model_chunks, overlap=overlap_param_gather,
                                 shards=self.compact)
            self.gather, self.param_data = gather, gather.shard_data

    def zero(self) -> None:
        self.grads.zero()

    def finish(self) -> None:
        self.grads.finish()

    def clear_gradients(self) -> None:
        self.grads.drop_partial()

    def allocated(self) -> AllocatedBytes:
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        if self.param_buffer is not None:  # full weights plus the compact shard the optimizer writes
            weights = size(self.param_buffer.data) + size(self.param_data)
        else:
            weights = size(self.param_data)  # plus one unit's full buckets while it is in use
        return AllocatedBytes(weights, size(self.grad_data))

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()
        if self.gather is not None:
            self.gather.remove_hooks()


def build_strategy(name: str, model_chunks: Sequence[nn.Module], layout: BufferLayout, ctx: ParallelContext,
                   grad_dtype: torch.dtype, overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                   flat_weights: bool = False, release_grad_buffer: bool = False) -> DataParallelStrategy:
    """The strategy ``name`` (one of :data:`STRATEGIES`) for ``layout``'s parameters."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown data-parallel sharding strategy {name!r} (valid: {', '.join(STRATEGIES)})")
    if not shards_gradients(name):
        return ReplicatedGradients(model_chunks, layout, ctx, grad_dtype, shard=shards_state(name),
                                   overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                                   flat_weights=flat_weights or shards_state(name),
                                   release_grads=releases_gradients(name, release_grad_buffer))
    return ShardedGradStrategy(model_chunks, layout, ctx, grad_dtype, shard_params=shards_weights(name),
                               overlap_param_gather=overlap_param_gather)
