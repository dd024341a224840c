"""Column- and row-parallel linear layers (Megatron's tensor parallelism).

ColumnParallelLinear splits the output features over TP ranks: the input is the
full activation (all-gathered from sequence shards with sequence parallelism),
the output stays sharded. RowParallelLinear splits the input features: each rank
computes a partial product that is summed over TP (all-reduce, or reduce-scatter
to sequence shards with sequence parallelism). A column layer followed by a row
layer needs one collective in each direction.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import Piece, ShardSpec, new_param


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows (output features) split over TP.

    ``weight_pieces``/``bias_pieces`` describe this rank's rows as slices of canonical
    tensors (several pieces for fused projections such as QKV or gate+up).
    """

    def __init__(self, ctx: ParallelContext, weight_pieces: Sequence[Piece], bias_pieces: Optional[Sequence[Piece]],
                 sequence_parallel: bool, gather_input: bool = True, grad_sync: Optional[str] = None,
                 tp_replicated: bool = False, group=None):
        super().__init__()
        self.group = ctx.tp_group if group is None else group
        self.sequence_parallel = sequence_parallel
        self.gather_input = gather_input
        self.weight = new_param(ShardSpec(tuple(weight_pieces), 0, tp_replicated=tp_replicated, grad_sync=grad_sync))
        self.bias = (new_param(ShardSpec(tuple(bias_pieces), 0, tp_replicated=tp_replicated, grad_sync=grad_sync))
                     if bias_pieces else None)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Enter the tensor-parallel region: all-gather sequence shards, or mark for the backward all-reduce."""
        if not self.gather_input:
            return x
        if self.sequence_parallel:
            return comm.gather_from_sequence(x, self.group, grad_is_partial=True)
        return comm.copy_to_tp(x, self.group)

    def forward(self, x: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        if not prepared:
            x = self.prepare_input(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over TP of x_r W_r^T (+ b), W's columns (input features) split over TP."""

    def __init__(self, ctx: ParallelContext, weight_piece: Piece, bias_piece: Optional[Piece], sequence_parallel: bool):
        super().__init__()
        self.group = ctx.tp_group
        self.sequence_parallel = sequence_parallel
        self.weight = new_param(ShardSpec((weight_piece,), 0))
        # The bias is added after the reduction, so every TP rank holds all of it.
        self.bias = (new_param(ShardSpec((bias_piece,), 0, tp_replicated=True,
                                         grad_sync="tp" if sequence_parallel else None))
                     if bias_piece is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence(y, self.group)
        else:
            y = comm.reduce_from_tp(y, self.group)
        if self.bias is not None:
            y = y + self.bias
        return y
