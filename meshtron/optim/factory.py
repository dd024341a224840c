"""Builds the gradient buffers, gradient reduction and optimizer for a run from its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.optim.accounting import BytesPerParameter, strategy_bytes_per_parameter
from meshtron.optim.buckets import BufferLayout, build_layout, default_bucket_size
from meshtron.optim.clip import GradNorm, data_copy_counted, model_copy_counted
from meshtron.optim.distributed_optimizer import DistributedOptimizer
from meshtron.optim.grad_buffer import GradBuffer, grad_region
from meshtron.optim.grads import GradientSync, kv_replica_params, tied_embedding_params
from meshtron.optim.registry import kind_of, param_state_bytes, whole_layout
from meshtron.optim.sharded_params import unit_layout
from meshtron.optim.strategy import DataParallelStrategy, TrainingOptimizer, build_strategy
from meshtron.parallel.context import ParallelContext
from meshtron.run_layout import sharding_strategy, shards_weights


@dataclass
class Optimization:
    """Everything the training step needs after the forward/backward passes.

    strategy: the data-parallel strategy (:mod:`meshtron.optim.strategy`): zero() before an iteration,
        start_overlap(chunk) as the schedule's on_chunk_grads_ready, finish() after the last backward.
    grad_norm: GradNorm: () -> 0-d tensor, the global gradient norm (after finish()); count_zeros().
    optimizer: step(lr), plus the checkpoint interface (:class:`~meshtron.optim.strategy.TrainingOptimizer`):
        the ``--optimizer`` entry's (:mod:`meshtron.optim.registry`) over every parameter, or the distributed
        optimizer stepping this rank's segments with that entry's partitions.
    layout: where every parameter sits in the flat buffers, and the buckets.
    bytes_per_param: the memory accounting of this configuration (per parameter of this rank).
    grad_buffer / grad_sync: the strategy's full gradient buffer and its reduction (``no_shard`` and
        ``optim`` only; None with the sharded-gradient strategies).
    """

    strategy: DataParallelStrategy
    grad_norm: GradNorm
    optimizer: TrainingOptimizer
    layout: Optional[BufferLayout] = None
    bytes_per_param: Optional[BytesPerParameter] = None

    @property
    def grad_buffer(self) -> Optional[GradBuffer]:
        return self.strategy.grad_buffer

    @property
    def grad_sync(self) -> Optional[GradientSync]:
        return self.strategy.grad_sync

    def close(self) -> None:
        """Remove the hooks this optimization put on parameters and modules.

        The gradient hooks form a reference cycle through the parameters that the garbage collector
        cannot always break (compiled graphs keep the parameters alive from C++), so a process that
        builds several models one after another (``meshtron bench``) calls this to free each one.
        """
        self.strategy.remove_hooks()


def _isolate_tied_embedding(model_chunks: Sequence[nn.Module], params: list[nn.Parameter], ctx: ParallelContext):
    tied = {id(p) for p in tied_embedding_params(model_chunks, params, ctx)}
    return lambda p: id(p) in tied


def _kv_first(model_chunks: Sequence[nn.Module]) -> dict[int, bool]:
    """id(param) -> whether this rank is the first of the parameter's key/value replica group."""
    out: dict[int, bool] = {}
    for group, ps in kv_replica_params(model_chunks).items():
        first = dist.get_rank(group) == 0
        for p in ps:
            out[id(p)] = first
    return out


def weights_norm(model_chunks: Sequence[nn.Module], ctx: ParallelContext) -> GradNorm:
    """The L2 norm of the whole model's weights (every element counted once over all ranks, by the
    same rules as the gradient norm); every rank must call it."""
    kv_first = _kv_first(model_chunks)
    weights = [p.detach() for chunk in model_chunks for p in chunk.parameters()
               if model_copy_counted(p, ctx, kv_first) and data_copy_counted(p, ctx)]
    return GradNorm(weights, ctx, ctx.device)


def buffer_layout(cfg: MeshtronConfig, ctx: ParallelContext, model_chunks: Sequence[nn.Module]) -> BufferLayout:
    """Where this run puts every parameter of ``model_chunks`` in the flat gradient (and weight) buffers:
    buckets of ``--ddp-bucket-size`` (Megatron's default), the tied embedding in a bucket of its own;
    with ``optim_grads_params`` one bucket per layer (a unit gathered at once, see sharded_params.py).
    An optimizer that needs whole parameters per owner (Muon) gets shards that never cut a parameter.
    Also what :mod:`meshtron.planning` lays out for a rank that is planned, not launched."""
    chunk_params = [list(chunk.parameters()) for chunk in model_chunks]
    params = [p for ps in chunk_params for p in ps]
    isolate = _isolate_tied_embedding(model_chunks, params, ctx)
    whole = whole_layout(cfg)
    if shards_weights(sharding_strategy(cfg)):
        return unit_layout(model_chunks, ctx, isolate=isolate, whole=whole)
    bucket_size = cfg.parallel.ddp_bucket_size or default_bucket_size(ctx.dp * ctx.cp)
    return build_layout(chunk_params, ctx, bucket_size, isolate=isolate, whole=whole)


def build_optimization(cfg: MeshtronConfig, ctx: ParallelContext, model_chunks: Sequence[nn.Module]) -> Optimization:
    """The data-parallel strategy (gradient storage and reduction, weight gather), the norm and the
    optimizer for ``model_chunks``."""
    par, opt = cfg.parallel, cfg.optim
    # The flags were checked by meshtron.validation (--data-parallel-sharding-strategy, --overlap-param-gather,
    # --optimizer-offload-fraction, --ddp-bucket-size), which owns those rules.
    name = sharding_strategy(cfg)
    offload = opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0
    layout = buffer_layout(cfg, ctx, model_chunks)
    params = layout.params
    grad_dtype = torch.bfloat16 if par.grad_reduce_in_bf16 else torch.float32
    strategy = build_strategy(name, model_chunks, layout, ctx, grad_dtype, overlap_grad_reduce=par.overlap_grad_reduce,
                              overlap_param_gather=par.overlap_param_gather, flat_weights=offload > 0.0,
                              release_grad_buffer=par.release_grad_buffer)
    shard = strategy.shards_optimizer

    kv_first = _kv_first(model_chunks)
    counted = [model_copy_counted(p, ctx, kv_first) for p in params]
    kind = kind_of(cfg)
    optimizer: TrainingOptimizer
    if strategy.gather is not None:
        optimizer = DistributedOptimizer(layout, strategy.grad_source, strategy.param_data, strategy.gather, opt,
                                         shard=shard, offload_fraction=offload, compact=strategy.compact,
                                         param_buffer=strategy.param_buffer, kind=kind, ctx=ctx)
    else:
        optimizer = kind.build(params, opt, ctx)
    if shard:  # owned shards partition the elements: each rank counts its own (hybrid: in the first replica)
        views = [grad_region(strategy.grad_source, s.buffer_offset, s.buffer_offset + s.length)
                 for s in optimizer.segments if counted[s.param_index]] if ctx.dp_cp_replica_rank == 0 else []
    else:
        views = [strategy.grad_buffer.view_of(i) for i, p in enumerate(params)
                 if counted[i] and data_copy_counted(p, ctx)]
    norm = GradNorm(views, ctx, ctx.device)

    weight_bytes = params[0].element_size() if params else 2
    numel = sum(p.numel() for p in params)  # the optimizer's own state per element, averaged over the parameters
    moments = (sum(param_state_bytes(kind, opt, p) * p.numel() for p in params) / numel if numel
               else float(kind.state_bytes(opt, ())))
    accounting = strategy_bytes_per_parameter(name, weight_bytes, torch.tensor([], dtype=grad_dtype).element_size(),
                                              ctx.dp_cp_shard, offload, moments)
    return Optimization(strategy, norm, optimizer, layout, accounting)
