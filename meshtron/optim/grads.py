"""Gradient reduction after the backward pass.

Three kinds of sums make every rank's gradients those of the whole model:

* over TP for parameters replicated across TP ranks whose inputs were sequence
  shards (sequence parallelism), and over the key/value replica group for GQA
  projections replicated when TP exceeds the query groups;
* over the embedding group (first and last pipeline stage) for tied embeddings;
* over data-parallel x context-parallel ranks for everything (the loss is already
  normalised by the global token count, so this is a sum, not a mean).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.optim.grad_buffer import GradBuffer
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of


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


class GradientSync:
    """Performs the reductions above on the main gradients of ``params``."""

    def __init__(self, model_chunks: Sequence[nn.Module], params: Sequence[nn.Parameter], ctx: ParallelContext,
                 grad_buffer: GradBuffer):
        self.ctx = ctx
        self.buffer = grad_buffer
        self.tp_params = [p for p in params if spec_of(p).grad_sync == "tp"]
        self.kv_groups: dict = {}
        for chunk in model_chunks:
            for module in chunk.modules():
                group = getattr(module, "kv_group", None)
                if group is not None:
                    kv = module.kv
                    for p in (kv.weight, kv.bias):
                        if p is not None:
                            self.kv_groups.setdefault(group, []).append(p)
        self.embedding_params = [p for p in params if spec_of(p).pieces[0].name == "embedding.word_embeddings.weight"]

    def start_overlap(self) -> None:
        """Called before the last micro-batch's backward; reductions here run after it (no overlap yet)."""

    def finish(self) -> None:
        """All reductions, in order: TP/KV replicas, tied embeddings, then data parallel."""
        _all_reduce_coalesced([p.main_grad for p in self.tp_params], self.ctx.tp_group)
        for group, ps in self.kv_groups.items():
            _all_reduce_coalesced([p.main_grad for p in ps], group)
        if self.ctx.embedding_group is not None and len(self.embedding_params) > 0:
            _all_reduce_coalesced([p.main_grad for p in self.embedding_params], self.ctx.embedding_group)
        if self.ctx.dp_cp_group is not None:
            dist.all_reduce(self.buffer.data, group=self.ctx.dp_cp_group)
