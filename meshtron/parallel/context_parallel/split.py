"""The load-balanced sequence split of context parallelism.

The sequence of ``S`` tokens is cut into ``2 x CP`` chunks of ``c = S / (2 CP)``
tokens, and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``, in that order.
Under a causal mask a query at position ``p`` attends to ``p + 1`` keys, so early
chunks are cheap and late chunks expensive; pairing chunk ``r`` with its mirror
gives every rank the same attention work (see :func:`causal_pairs_per_rank`).

Every per-token tensor of a micro-batch (tokens, labels, loss mask, position ids,
document ids) follows this split, so that a rank's local sequence is the
concatenation of its two chunks. Everything here is pure tensor indexing; the
gathers for tests and tools take the CP process group explicitly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from meshtron.config import ConfigError

# Per-token tensors of a micro-batch, laid out [micro-batch, seq] (or [micro-batch, seq, depth]: the
# multi-token prediction fields of meshtron.layers.mtp): they are split along dim 1.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids",
                 "mtp_tokens", "mtp_labels", "mtp_loss_mask")


def check_sequence_split(seq_length: int, cp: int) -> None:
    """Raise a ConfigError unless ``seq_length`` splits into 2 x CP equal chunks."""
    if cp > 1 and seq_length % (2 * cp):
        raise ConfigError(f"sequence length {seq_length} must be divisible by 2 x --context-parallel-size "
                          f"({cp}) = {2 * cp} for the load-balanced context-parallel split")


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x CP) that CP rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_owner(chunk: int, cp: int) -> tuple[int, int]:
    """(CP rank, half 0 or 1 of its local sequence) holding global chunk ``chunk``."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def local_token_indices(seq_local: int, cp: int, cp_rank: int,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """Global sequence indices [seq_local] of the tokens a CP rank holds (``seq_local`` = S / CP)."""
    if seq_local % 2:
        raise ConfigError(f"the local sequence of a context-parallel rank ({seq_local} tokens) must be even: "
                          "it is two chunks of equal length")
    c = seq_local // 2
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a full-sequence tensor, concatenated along ``dim``."""
    if cp == 1:
        return x
    seq = x.shape[dim]
    check_sequence_split(seq, cp)
    c = seq // (2 * cp)
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def split_micro_batch(micro_batch: dict, cp: int, cp_rank: int) -> dict:
    """A micro-batch with every per-token tensor (:data:`SEQUENCE_KEYS`) cut to this CP rank's chunks.

    Other entries pass through unchanged.
    """
    if cp == 1:
        return micro_batch
    return {k: (split_sequence(v, cp, cp_rank, dim=1) if k in SEQUENCE_KEYS and v is not None else v)
            for k, v in micro_batch.items()}


def restore_sequence_order(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor from every CP rank's local tensor (``parts`` indexed by CP rank)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    c = parts[0].shape[dim] // 2
    chunks = []
    for chunk in range(2 * cp):
        owner, half = chunk_owner(chunk, cp)
        chunks.append(parts[owner].narrow(dim, half * c, c))
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 1) -> torch.Tensor:
    """All-gather a CP-local tensor over ``group`` and put it back in sequence order (no autograd).

    For evaluation, tests and tools, e.g. full-sequence logits from CP-local ones.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return restore_sequence_order(parts, dim)


def causal_pairs_per_rank(seq_length: int, cp: int) -> list[int]:
    """Query-key pairs under the causal mask that each CP rank's queries attend to.

    With the load-balanced split every entry is ``S (S + 1) / (2 CP)``; with a plain
    contiguous split the last rank would do ``2 CP - 1`` times the work of the first.
    """
    check_sequence_split(seq_length, cp)
    out = []
    for r in range(cp):
        pos = local_token_indices(seq_length // cp, cp, r)
        out.append(int((pos + 1).sum()))
    return out
