"""Silent data corruption: data-parallel replicas compare a hash of the weights they share.

``--check-weight-hash-across-dp-replicas-interval N``: every N iterations (after the
optimizer step and its parameter all-gather) each rank hashes, on its device, the raw bits
of its parameters, in two classes:

* dense parameters, which every rank of the data x context-parallel group holds identically;
* expert parameters, which the ranks of the expert-data-parallel group hold identically.

One all-gather of six integers per rank gives every rank the whole table; ranks of one
replica group that disagree with the group's majority are named. With two replicas there
is no majority, and both are named: a hash alone cannot say which copy is the corrupt one.

The hash of a tensor reads its bytes as integer words ``w_i`` (16-bit for bf16/fp16, 32-bit
for fp32 and wider) and keeps two sums, exact in int64 arithmetic:

* ``A = sum(w_i) mod (2^61 - 1)``: one flipped bit changes one word by ``+-2^k`` (k < 32),
  which is never a multiple of that prime, so a single bit flip always changes ``A``;
* ``B = sum(w_i * c_i) mod (2^31 - 1)`` with position coefficients ``c_i`` in [1, 2^31 - 2]:
  order-sensitive, so swapped or shifted values change it too.

Tensors are folded in parameter order, so the result is the same on every replica that
holds the same bits in the same parameters, and different (up to a 1 in ~2^31 chance for
multi-bit damage) otherwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of

_P_SUM = (1 << 61) - 1     # Mersenne prime: the plain sum of words, reduced
_P_POS = (1 << 31) - 1     # Mersenne prime: the position-weighted sum, reduced
_CHUNK = 1 << 22           # words hashed per kernel group (bounds the int64 temporaries to 32 MiB)
_MIX = 1_000_003           # folds chunk and tensor results in order


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat integer tensor (a view when the tensor is contiguous)."""
    flat = t.detach().contiguous().view(-1)
    size = flat.element_size()
    if size == 2:
        return flat.view(torch.int16)
    if size >= 4 and (flat.numel() * size) % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.uint8)


class _Coefficients:
    """Position coefficients ``c_i`` for a chunk, per device, grown to the longest chunk asked for."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        coef = self._by_device.get(device)
        if coef is None or coef.numel() < n:
            size = min(_CHUNK, max(n, 2 * (coef.numel() if coef is not None else 0)))
            pos = torch.arange(size, dtype=torch.int64, device=device)
            coef = (pos * 48_271 + 12_345) % (_P_POS - 1) + 1  # never 0 mod _P_POS
            self._by_device[device] = coef
        return coef[:n]


def tensor_hash(t: torch.Tensor, coefficients: Optional[_Coefficients] = None) -> torch.Tensor:
    """The (A, B) hash of ``t``'s bits as an int64 tensor of two elements on ``t``'s device (no host sync)."""
    coefficients = coefficients or _Coefficients()
    words = _words(t)
    a = torch.zeros((), dtype=torch.int64, device=t.device)
    b = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        a = (a + w.sum()) % _P_SUM  # a chunk sums to < 2^53: no overflow before the reduction
        weighted = (w % _P_POS) * coefficients.get(t.device, w.numel()) % _P_POS
        b = (b * _MIX + weighted.sum()) % _P_POS
    return torch.stack([a, b])


def fold(hashes: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One (A, B) from the hashes of several tensors, in their order."""
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    for h in hashes:
        a = (a + h[0]) % _P_SUM
        b = (b * _MIX + h[1] + 1) % _P_POS  # +1: an empty or zero tensor still moves the fold
    return torch.stack([a, b])


def _group_key(group: Optional[dist.ProcessGroup], rank: int) -> int:
    """The lowest global rank of ``group``: equal for every member, distinct between groups."""
    if group is None:
        return rank
    return min(dist.get_process_group_ranks(group))


@dataclass
class HashVerdict:
    """The outcome of one comparison: the ranks that differ from their replica group's majority."""

    iteration: int
    ranks: list[int] = field(default_factory=list)
    majority: bool = True  # False when some group had no majority (then all its ranks are named)

    @property
    def mismatch(self) -> bool:
        return bool(self.ranks)

    def event(self) -> dict:
        """The ``weight_hash`` metrics-file event (DESIGN section 6)."""
        return {"type": "weight_hash", "iteration": self.iteration, "ranks": self.ranks,
                "majority": self.majority}


def outliers(table: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    """Ranks whose (A, B) differs from their replica group's majority.

    ``table[r]`` is rank r's ``[key, A, B]`` for one parameter class (ranks with equal keys hold
    the same weights). A group without a strict majority names all its ranks. Returns
    (sorted ranks, whether every mismatching group had a majority).
    """
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(table):
        groups.setdefault(int(row[0]), []).append(rank)
    named: set[int] = set()
    majority = True
    for members in groups.values():
        values = Counter((int(table[r][1]), int(table[r][2])) for r in members)
        if len(values) <= 1:
            continue
        value, count = values.most_common(1)[0]
        if 2 * count > len(members):
            named.update(r for r in members if (int(table[r][1]), int(table[r][2])) != value)
        else:
            majority = False
            named.update(members)
    return sorted(named), majority


class WeightHashCheck:
    """Hashes this rank's replicated weights and compares them over the replica groups.

    Every rank of the world calls :meth:`check` at the same iterations (one all-gather).
    """

    def __init__(self, model_chunks: Sequence[nn.Module], ctx: ParallelContext):
        params = [p for chunk in model_chunks for p in chunk.parameters()]
        self.dense = [p for p in params if not spec_of(p).expert]
        self.expert = [p for p in params if spec_of(p).expert]
        self.ctx = ctx
        self.dense_key = _group_key(ctx.dp_cp_group, ctx.rank)
        self.expert_key = _group_key(ctx.expert_dp_group, ctx.rank)
        self._coefficients = _Coefficients()

    @classmethod
    def from_config(cls, cfg, ctx: ParallelContext, model_chunks: Sequence[nn.Module]) -> Optional["WeightHashCheck"]:
        """The check of ``--check-weight-hash-across-dp-replicas-interval``, or None when it is off."""
        if not cfg.train.check_weight_hash_across_dp_replicas_interval:
            return None
        return cls(model_chunks, ctx)

    def local_hashes(self) -> torch.Tensor:
        """[dense key, A, B, expert key, A, B] of this rank (int64, on device)."""
        device = self.ctx.device
        dense = fold([tensor_hash(p, self._coefficients) for p in self.dense], device)
        expert = fold([tensor_hash(p, self._coefficients) for p in self.expert], device)
        keys = torch.tensor([self.dense_key, self.expert_key], dtype=torch.int64, device=device)
        return torch.stack([keys[0], dense[0], dense[1], keys[1], expert[0], expert[1]])

    def gather(self) -> list[list[int]]:
        """Every rank's :meth:`local_hashes`, by rank (one all-gather; reads the result on the host)."""
        local = self.local_hashes()
        if self.ctx.world_size == 1 or not dist.is_initialized():
            return [local.tolist()]
        rows = [torch.empty_like(local) for _ in range(self.ctx.world_size)]
        dist.all_gather(rows, local)
        return torch.stack(rows).tolist()

    def check(self, iteration: int) -> HashVerdict:
        """Compare the replicas' hashes; the same verdict on every rank."""
        table = self.gather()
        dense, dense_majority = outliers([row[0:3] for row in table])
        expert, expert_majority = outliers([row[3:6] for row in table])
        return HashVerdict(iteration, sorted(set(dense) | set(expert)), dense_majority and expert_majority)


def mismatch_message(verdict: HashVerdict, restart: bool) -> str:
    """The one-line error of a mismatch."""
    who = ", ".join(str(r) for r in verdict.ranks)
    why = ("differ from the other replicas" if verdict.majority else
           "differ, and no majority of replicas agrees (with two replicas the corrupt copy cannot be told)")
    then = ("exiting for an automatic restart from the last checkpoint" if restart
            else "stopping; the last checkpoint is intact")
    return (f"iteration {verdict.iteration}: the weights of rank(s) {who} {why} (weight-hash check across "
            f"data-parallel replicas; silent data corruption?); no checkpoint is written from this state; {then}")
