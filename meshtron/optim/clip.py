"""Global gradient norm over every parallel group, and clipping.

Every element of the model's gradient must be counted exactly once, whichever
ranks hold copies of it. Copies come from:

* tensor parallelism: parameters replicated over TP (norms, row-parallel biases,
  position embeddings; ``ShardSpec.tp_replicated``) count on TP rank 0 only; GQA
  key/value projections replicated over a TP subgroup count on that subgroup's first rank;
* pipeline parallelism: the last stage's copy of a tied word embedding
  (``extra["tied_copy"]``) is not counted (the first stage's is);
* data parallelism: after the reduction every DP x CP rank holds the same dense
  gradients, so they count on DP x CP rank 0; expert gradients are the same over the
  expert-data-parallel group and count on its rank 0. With the distributed optimizer
  only the owned shards are summed, which partition the elements: every rank counts its shards (with hybrid
  sharding they partition them inside a shard group, so only the first replica's ranks count theirs).

What remains distinct (TP shards, pipeline stages, expert-parallel ranks, shards) is
summed by one all-reduce of the squared norm over all ranks. The result is the norm
one process computes for the whole model.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of


def model_copy_counted(param: nn.Parameter, ctx: ParallelContext, kv_replica: dict[int, bool]) -> bool:
    """Whether this rank's copy of ``param`` is the one counted among its TP / pipeline copies.

    ``kv_replica`` maps id(param) -> whether this rank is the first of its key/value replica group.
    """
    spec = spec_of(param)
    if spec.tp_replicated and ctx.tp_rank != 0:
        return False
    if not kv_replica.get(id(param), True):
        return False
    return not spec.extra.get("tied_copy", False)


def data_copy_counted(param: nn.Parameter, ctx: ParallelContext) -> bool:
    """Whether this rank's fully reduced gradient of ``param`` is the counted one among DP replicas."""
    if spec_of(param).expert:
        return ctx.expert_dp_rank == 0
    return ctx.dp_rank == 0 and ctx.cp_rank == 0


class GradNorm:
    """The L2 norm of the whole model's gradient from the tensors this rank counts (0-d tensor, no host sync).

    ``tensors``: the gradient views to count on this rank (already filtered with the
    rules above); every rank of the world calls it (one all-reduce over all ranks).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], ctx: ParallelContext, device: torch.device):
        self.tensors = [t for t in tensors if t.numel() > 0]
        self.ctx = ctx
        self.device = device

    def squared_local(self) -> torch.Tensor:
        if not self.tensors:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        # Accumulated in fp32 whatever the gradients' dtype (bf16 buffers are read without an fp32 copy).
        norms = torch._foreach_norm(self.tensors, 2, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    def __call__(self) -> torch.Tensor:
        return self._summed(self.squared_local()).sqrt()

    def count_zeros(self) -> torch.Tensor:
        """How many of the counted elements are exactly zero, over all ranks (``--log-num-zeros-in-grad``)."""
        local = sum((torch.count_nonzero(t == 0) for t in self.tensors),
                    torch.zeros((), dtype=torch.int64, device=self.device))
        return self._summed(local.to(torch.float64))

    def _summed(self, local: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size > 1 and dist.is_initialized():
            dist.all_reduce(local)
        return local


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / norm) as a tensor (1 when clipping is off)."""
    if max_norm <= 0:
        return torch.ones_like(total_norm)
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
