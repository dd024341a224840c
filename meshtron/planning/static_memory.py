"""Exact static memory of one rank of a layout, from its model stage built on the meta device.

The figures are the allocations a real run makes before its first step, computed by the code that
makes them, not by a formula: the stage comes from the run's model builder on a
:func:`~meshtron.planning.fake_context.planned_context` (no process group, no memory), the flat
buffers from the run's bucket layout (:func:`meshtron.optim.factory.buffer_layout`: reverse order,
buckets, padding to ``group size x 64`` elements), and the distributed optimizer's shard from its own
segment rules (:func:`meshtron.optim.distributed_optimizer.owned_segments`) and offload split
(:func:`meshtron.optim.offload.split_for_offload`). What is left to arithmetic here is which tensor
each of those allocates, in which dtype, on which device; ``tests/planning/test_static_memory.py``
compares every figure with a real multi-process run.

Per rank:

- weights: the stage's parameters in the compute dtype; with the distributed optimizer (or CPU
  offload) they live in one flat parameter buffer of the layout's size, padding included, which is
  also the buffer the weights' all-gather writes into (in place);
- gradients: one flat buffer of the layout's size (fp32, or bf16 with ``--grad-reduce-in-bf16``),
  which the gradient all-reduce / reduce-scatter also uses in place;
- optimizer state: fp32 master weights (none where the weights are fp32 on the device: they are their
  own masters) and the ``--optimizer`` entry's states (:mod:`meshtron.optim.registry`: Adam's two
  moments, Muon's momentum), for every parameter element, or with
  ``--use-distributed-optimizer`` for this rank's shard of every bucket; with
  ``--optimizer-cpu-offload`` the first ``--optimizer-offload-fraction`` of them on the host, plus
  the host's pinned staging copies of their gradients and weights;
- with ``--data-parallel-sharding-strategy optim_grads`` the gradients are this rank's fp32 shard of
  every bucket (the full-size buckets exist only while backward reduces them), and the weights the
  full buffer plus the compact shard the optimizer writes; with ``optim_grads_params`` the weights
  are that shard only (one layer's buckets are gathered while it runs; :mod:`meshtron.optim.strategy`);
- model buffers (router expert biases, MoE counters) and one pipeline message (the activation a stage
  sends, and the gradient it receives, per transfer).

Beside them, what the sharded strategies allocate only while a step runs (ZeRO-3's gathered layers,
ZeRO-2/3's gradient buckets being reduced), replayed from the same layout by
:mod:`meshtron.planning.transient_memory`. Activations are not static: :mod:`meshtron.memory` models them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.optim.buckets import BufferLayout, ReduceGroup
from meshtron.optim.distributed_optimizer import owned_segments
from meshtron.optim.factory import buffer_layout
from meshtron.optim.offload import Segment, split_for_offload
from meshtron.optim.registry import kind_of, param_state_bytes, param_state_names
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import spec_of
from meshtron.planning.fake_context import group_rank, planned_context, without_data_parallel_groups
from meshtron.planning.transient_memory import gathered_weight_bytes, reduction_bucket_bytes
from meshtron.run_layout import (DTYPE_BYTES, compute_dtype_name, sharding_strategy, shards_gradients, shards_state,
                                 shards_weights)


def build_stage(cfg: MeshtronConfig, ctx: ParallelContext, vocab_size: int) -> list[nn.Module]:
    """This rank's model chunks, built by the run's own model builder (the one import of it here)."""
    from meshtron.build import build_model_chunks

    dtype = getattr(torch, compute_dtype_name(cfg))
    tracker = RNGTracker(cfg.train.seed, ctx.tp_rank, ctx.pp_rank, torch.device("cpu"))
    return build_model_chunks(cfg, ctx, vocab_size, tracker, dtype)


@dataclass(frozen=True)
class OptimizerState:
    """Elements and bytes of one rank's optimizer state (masters counted even where they are the weights)."""

    master_numel: int
    state_numel: dict  # elements of every state the optimizer keeps ("master" included), by name
    device_bytes: int
    host_bytes: int  # state and pinned staging buffers in host memory

    @property
    def numel(self) -> dict[str, int]:
        return dict(self.state_numel)


@dataclass(frozen=True)
class RankMemory:
    """Static memory of one global rank (see the module docstring); bytes unless named ``_numel``."""

    rank: int
    coordinates: dict  # tp, cp, dp, pp, ep and expert-DP rank of this rank
    parameters: int  # elements of this rank's parameters
    expert_parameters: int
    weights: int
    param_buffer_numel: Optional[int]  # the flat weight buffer (distributed optimizer / offload, ZeRO-2), else None
    grad_buffer_numel: int  # the gradients kept: the full buffer, or (ZeRO-2/3) this rank's shards of it
    gradients: int
    optimizer: OptimizerState
    model_buffers: int
    pipeline_message: int  # one activation (or gradient) crossing a stage boundary; 0 without PP
    buckets: int
    strategy: str = "no_shard"  # --data-parallel-sharding-strategy
    layout_numel: int = 0  # the flat layout of every parameter of this rank, padding included
    weight_shard_numel: Optional[int] = None  # ZeRO-2/3: this rank's compact shard of the weights
    gathered_weights: int = 0  # ZeRO-3: most bytes of layer weights gathered at once during a step
    reduction_buckets: int = 0  # ZeRO-2/3: most bytes of full gradient buckets and shards being reduced

    @property
    def padding_numel(self) -> int:
        """Elements the bucket layout adds to align and split its buckets."""
        return self.layout_numel - self.parameters

    @property
    def device_total(self) -> int:
        """Bytes on the GPU before the first step (no activations)."""
        return self.weights + self.gradients + self.optimizer.device_bytes + self.model_buffers

    @property
    def step_transients(self) -> int:
        """Bytes a sharded strategy adds during a step (gathered weights, gradient buckets in reduction)."""
        return self.gathered_weights + self.reduction_buckets

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["optimizer"] = {**out["optimizer"], "numel": self.optimizer.numel}
        out.update(padding_numel=self.padding_numel, device_total=self.device_total,
                   step_transients=self.step_transients)
        return out


def _with_group_ranks(layout: BufferLayout, ctx: ParallelContext) -> BufferLayout:
    """The layout with each bucket's reduce group carrying this rank's index in it (the layout code asks
    torch.distributed for it; a planned rank knows it from its coordinates)."""
    dense, expert = group_rank(ctx.dp_cp_group), group_rank(ctx.expert_dp_group)
    if ctx.dp_cp_replicas > 1:  # hybrid sharding: shards over this rank's shard group (experts too: EP is 1)
        dense = expert = ctx.dp_cp_shard_rank
    for bucket in layout.buckets:
        r = bucket.reduce
        bucket.reduce = ReduceGroup(None, r.size, expert if r.expert else dense, r.expert, replicas=r.replicas,
                                    replica_rank=r.replica_rank)
    return layout


def _segment_state(cfg: MeshtronConfig, layout: BufferLayout, segments: Sequence[Segment], on_host: bool,
                   weights_fp32: bool, grad_bytes: int, weight_bytes: int, numel_by_state: dict) -> int:
    """Bytes of one partition of the distributed optimizer (its masters and the optimizer's states), adding
    its elements to ``numel_by_state``."""
    kind = kind_of(cfg)
    numel = sum(s.length for s in segments)
    if numel == 0:
        return 0
    aliased = (not on_host) and weights_fp32  # fp32 weights on the device are their own masters
    total = 0 if aliased else 4 * numel
    for s in segments:
        param = layout.params[s.param_index]
        total += param_state_bytes(kind, cfg, param) * s.length
        for name in param_state_names(kind, param):
            numel_by_state[name] = numel_by_state.get(name, 0) + s.length
    if on_host:
        total += numel * (grad_bytes + weight_bytes)  # pinned staging of gradients and weights
    return total


def optimizer_state(cfg: MeshtronConfig, layout: BufferLayout, weights_fp32: bool, grad_bytes: int,
                    weight_bytes: int) -> OptimizerState:
    """The optimizer state ``meshtron.optim.factory.build_optimization`` creates for ``layout``'s rank."""
    opt, shard = cfg.optim, shards_state(sharding_strategy(cfg))
    offload = opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0
    kind = kind_of(cfg)
    numel: dict[str, int] = {name: 0 for p in layout.params for name in param_state_names(kind, p)}
    if not shard and offload <= 0.0:  # the optimizer over every parameter, on the device
        total = 0
        for p in layout.params:
            n = p.numel()
            total += (0 if weights_fp32 else 4 * n) + param_state_bytes(kind, cfg, p) * n
            for name in param_state_names(kind, p):
                numel[name] += n
        return OptimizerState(numel.get("master", 0), numel, total, 0)
    device_segments, host_segments = split_for_offload(owned_segments(layout, shard), offload)
    device_bytes = _segment_state(cfg, layout, device_segments, False, weights_fp32, grad_bytes, weight_bytes, numel)
    host_bytes = _segment_state(cfg, layout, host_segments, True, weights_fp32, grad_bytes, weight_bytes, numel)
    return OptimizerState(numel.get("master", 0), numel, device_bytes, host_bytes)


def pipeline_message_bytes(cfg: MeshtronConfig, ctx: ParallelContext) -> int:
    """Bytes of one tensor crossing a pipeline stage boundary (meshtron.pipeline.p2p.activation_shape)."""
    if ctx.pp == 1:
        return 0
    from meshtron.pipeline.p2p import activation_shape

    seq, batch, hidden = activation_shape(cfg, ctx)
    return seq * batch * hidden * DTYPE_BYTES[compute_dtype_name(cfg)]


def plan_config(cfg: MeshtronConfig) -> MeshtronConfig:
    """A copy of a validated ``cfg`` for building meta-device stages: layers are not compiled (compiling
    allocates nothing that the plan counts, and there is nothing to compile for)."""
    planned = copy.deepcopy(cfg)
    planned.train.compile = False
    return planned


def rank_memory(cfg: MeshtronConfig, vocab_size: int, world_size: int, rank: int) -> RankMemory:
    """Static memory of global ``rank`` of ``world_size`` for a validated ``cfg`` (no GPU, no process group).

    ``vocab_size`` is the tokenizer's (the model pads it).
    """
    p = cfg.parallel
    ctx = planned_context(world_size, rank, p.tensor_model_parallel_size, p.context_parallel_size,
                          p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                          replicas=getattr(p, "num_distributed_optimizer_instances", 1))
    planned = plan_config(cfg)
    chunks = build_stage(planned, ctx, vocab_size)
    layout = _with_group_ranks(buffer_layout(planned, without_data_parallel_groups(ctx), chunks), ctx)
    params = layout.params
    weight_bytes = params[0].element_size() if params else DTYPE_BYTES[compute_dtype_name(cfg)]
    weights_fp32 = bool(params) and params[0].dtype == torch.float32
    grad_bytes = 2 if p.grad_reduce_in_bf16 else 4
    numel = sum(q.numel() for q in params)
    expert = sum(q.numel() for q in params if spec_of(q).expert)
    strategy = sharding_strategy(cfg)
    flat_weights = shards_state(strategy) or (cfg.optim.optimizer_cpu_offload
                                              and cfg.optim.optimizer_offload_fraction > 0.0)
    # The sharded strategies (meshtron.optim.strategy) keep this rank's shard of every bucket compactly.
    shard_numel = sum(b.shard_size for b in layout.buckets)
    sharded = shards_gradients(strategy)
    if shards_weights(strategy):
        weights_numel = shard_numel
    elif sharded:  # ZeRO-2: the full flat weights and the compact shard the optimizer writes
        weights_numel = layout.numel + shard_numel
    else:
        weights_numel = layout.numel if flat_weights else numel
    grad_numel = shard_numel if sharded else layout.numel
    grad_bytes_kept = 4 if sharded else grad_bytes  # fp32 shards
    buffers = sum(b.numel() * b.element_size() for chunk in chunks for b in chunk.buffers())
    coordinates = {"tp": ctx.tp_rank, "cp": ctx.cp_rank, "dp": ctx.dp_rank, "pp": ctx.pp_rank, "ep": ctx.ep_rank,
                   "expert_dp": ctx.expert_dp_rank}
    micro_batches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * ctx.dp)
    return RankMemory(
        rank=rank, coordinates=coordinates, parameters=numel, expert_parameters=expert,
        weights=weights_numel * weight_bytes,
        # ZeRO-3 has no flat weight buffer: each bucket's full tensor is empty between uses.
        param_buffer_numel=layout.numel if flat_weights and not shards_weights(strategy) else None,
        grad_buffer_numel=grad_numel, gradients=grad_numel * grad_bytes_kept,
        optimizer=optimizer_state(cfg, layout, weights_fp32, grad_bytes, weight_bytes),
        model_buffers=buffers, pipeline_message=pipeline_message_bytes(cfg, ctx), buckets=len(layout.buckets),
        strategy=strategy, layout_numel=layout.numel, weight_shard_numel=shard_numel if sharded else None,
        gathered_weights=(gathered_weight_bytes(layout, chunks, weight_bytes)
                          if shards_weights(strategy) else 0),
        reduction_buckets=(reduction_bucket_bytes(layout, chunks, grad_bytes, micro_batches) if sharded else 0))
