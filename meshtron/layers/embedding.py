"""Vocabulary-parallel word embeddings (+ learned positions)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import ShardSpec, new_param, shard, whole


def vocab_parallel_lookup(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, group,
                          sequence_parallel: bool) -> torch.Tensor:
    """Word embeddings [seq, batch, hidden] of ``tokens`` [batch, seq] from this rank's block of vocabulary rows
    ``weight`` (starting at ``vocab_start``): zeros for tokens outside the block, summed over the TP ``group``
    (reduce-scattered to sequence shards with ``sequence_parallel``)."""
    tokens = tokens.t()
    if comm.group_size(group) == 1:
        return F.embedding(tokens, weight)
    outside = (tokens < vocab_start) | (tokens >= vocab_start + weight.shape[0])
    out = F.embedding((tokens - vocab_start).masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return comm.reduce_scatter_to_sequence(out, group) if sequence_parallel else comm.reduce_from_tp(out, group)


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds a contiguous block of the (padded) vocabulary's rows.

    A token outside the block gives zeros locally; the sum over TP (all-reduce, or a
    reduce-scatter to sequence shards with sequence parallelism) gives every rank
    its embeddings. Output layout [seq, batch, hidden].
    """

    def __init__(self, ctx: ParallelContext, vocab_size: int, padded_vocab: int, hidden: int, std: float,
                 sequence_parallel: bool, max_positions: Optional[int] = None):
        super().__init__()
        self.group = ctx.tp_group
        self.tp = ctx.tp
        self.sequence_parallel = sequence_parallel
        self.rows = padded_vocab // ctx.tp
        self.vocab_start = ctx.tp_rank * self.rows
        self.weight = new_param(ShardSpec((shard("embedding.word_embeddings.weight", (vocab_size, hidden), 0,
                                                 ctx.tp_rank, ctx.tp, std=std, padded_size=padded_vocab),)))
        self.position_weight = (new_param(ShardSpec((whole("embedding.position_embeddings.weight",
                                                           (max_positions, hidden), std=std),), tp_replicated=True))
                                if max_positions else None)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = vocab_parallel_lookup(tokens, self.weight, self.vocab_start, self.group, self.sequence_parallel)
        tokens = tokens.t()  # [seq, batch]
        if self.position_weight is not None:
            pos = position_ids.t() if position_ids is not None else torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            pos_emb = F.embedding(pos, self.position_weight)
            if self.sequence_parallel:
                pos_emb = comm.scatter_to_sequence(pos_emb.expand(-1, tokens.shape[1], -1), self.group)
            out = out + pos_emb
        return out
