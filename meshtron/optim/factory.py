"""Builds the gradient buffers, gradient reduction and optimizer for a run from its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.optim.accounting import BytesPerParameter, bytes_per_parameter
from meshtron.optim.buckets import BufferLayout, build_layout, default_bucket_size
from meshtron.optim.clip import GradNorm, data_copy_counted, model_copy_counted
from meshtron.optim.distributed_optimizer import DistributedOptimizer
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.grads import GradientSync, kv_replica_params, tied_embedding_params
from meshtron.optim.optimizer import MixedPrecisionAdamW
from meshtron.optim.param_buffer import ParamBuffer, ParamGather
from meshtron.parallel.context import ParallelContext


@dataclass
class Optimization:
    """Everything the training step needs after the forward/backward passes.

    grad_buffer: zero() before an iteration (marks every view unwritten; see GradBuffer).
    grad_sync: start_overlap() before the last backward, finish() after it.
    grad_norm: GradNorm: () -> 0-d tensor, the global gradient norm (after finish()); count_zeros().
    optimizer: step(lr), plus the checkpoint interface (params, state_tensors, load_state_tensors,
        ensure_state, step_count, set_step_count). A DistributedOptimizer also has
        finish_param_gather(), to call before reading the weights outside a forward pass.
    layout: where every parameter sits in the flat buffers, and the buckets.
    bytes_per_param: the memory accounting of this configuration (per parameter of this rank).
    """

    grad_buffer: GradBuffer
    grad_sync: GradientSync
    grad_norm: GradNorm
    optimizer: Union[MixedPrecisionAdamW, DistributedOptimizer]
    layout: Optional[BufferLayout] = None
    bytes_per_param: Optional[BytesPerParameter] = None

    def close(self) -> None:
        """Remove the hooks this optimization put on parameters and modules.

        The gradient hooks form a reference cycle through the parameters that the garbage collector
        cannot always break (compiled graphs keep the parameters alive from C++), so a process that
        builds several models one after another (``meshtron bench``) calls this to free each one.
        """
        self.grad_buffer.remove_hooks()
        gather = getattr(self.optimizer, "param_gather", None)
        if gather is not None:
            gather.remove_hooks()


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
    buckets of ``--ddp-bucket-size`` (Megatron's default), the tied embedding in a bucket of its own.
    Also what :mod:`meshtron.planning` lays out for a rank that is planned, not launched."""
    chunk_params = [list(chunk.parameters()) for chunk in model_chunks]
    params = [p for ps in chunk_params for p in ps]
    bucket_size = cfg.parallel.ddp_bucket_size or default_bucket_size(ctx.dp * ctx.cp)
    return build_layout(chunk_params, ctx, bucket_size, isolate=_isolate_tied_embedding(model_chunks, params, ctx))


def build_optimization(cfg: MeshtronConfig, ctx: ParallelContext, model_chunks: Sequence[nn.Module]) -> Optimization:
    """Gradient buffers (bucketed), their reduction, the norm and the optimizer for ``model_chunks``."""
    par, opt = cfg.parallel, cfg.optim
    chunk_params = [list(chunk.parameters()) for chunk in model_chunks]
    params = [p for ps in chunk_params for p in ps]
    # The flags were checked by meshtron.validation (--overlap-param-gather, --optimizer-offload-fraction,
    # --ddp-bucket-size), which owns those rules.
    offload = opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0
    layout = buffer_layout(cfg, ctx, model_chunks)
    grad_dtype = torch.bfloat16 if par.grad_reduce_in_bf16 else torch.float32
    buffer = GradBuffer(params, dtype=grad_dtype, device=ctx.device, layout=layout)
    shard = par.use_distributed_optimizer
    sync = GradientSync(model_chunks, params, ctx, buffer, overlap=par.overlap_grad_reduce, reduce_scatter=shard)

    kv_first = _kv_first(model_chunks)
    counted = [model_copy_counted(p, ctx, kv_first) for p in params]
    optimizer: Union[MixedPrecisionAdamW, DistributedOptimizer]
    if shard or offload > 0.0:
        param_buffer = ParamBuffer(layout, ctx.device)
        gather = ParamGather(layout, param_buffer, model_chunks, overlap=shard and par.overlap_param_gather)
        optimizer = DistributedOptimizer(layout, buffer, param_buffer, gather, opt, shard=shard,
                                         offload_fraction=offload)
    else:
        optimizer = MixedPrecisionAdamW(params, opt)
    if shard:  # owned shards partition the elements: each rank counts its own
        views = [buffer.data[s.buffer_offset:s.buffer_offset + s.length]
                 for s in optimizer.segments if counted[s.param_index]]
    else:
        views = [buffer.view_of(i) for i, p in enumerate(params) if counted[i] and data_copy_counted(p, ctx)]
    norm = GradNorm(views, ctx, ctx.device)

    weight_bytes = params[0].element_size() if params else 2
    shards = ctx.dp * ctx.cp if shard else 1
    accounting = bytes_per_parameter(weight_bytes, torch.tensor([], dtype=grad_dtype).element_size(), shards, offload)
    return Optimization(buffer, sync, norm, optimizer, layout, accounting)
