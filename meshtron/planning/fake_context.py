"""A ParallelContext for one rank of a layout that is planned, not launched.

:func:`planned_context` gives the coordinates that :func:`meshtron.parallel.context.build_groups`
would give global rank ``rank`` of a TP x CP x DP x PP world (rank order TP, CP, DP, PP, fastest
first; EP splitting the DP x CP ranks of a stage), on the meta device, without torch.distributed.

Its groups are :class:`PlannedGroup` placeholders: they know their size and this rank's index, which
is all that building a model stage and its gradient/optimizer layout reads from them
(``dist.get_world_size(group)`` calls ``group.size()``; "is this group None" decides whether tied
embeddings are synchronised). Anything that would communicate through one fails, which is the
point: a planned rank never runs a step. A group of one rank is None, as in a real context.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from meshtron.parallel.context import LaterGroups, ParallelContext, rank_grid
from meshtron.parallel.layout import check_expert_ranks, data_parallel_size_of


@dataclasses.dataclass(frozen=True)
class PlannedGroup:
    """Stands for a process group of ``members`` (global ranks, sorted) that this rank belongs to."""

    name: str
    members: tuple[int, ...]
    index: int  # this rank's position in ``members`` (its group rank)

    def size(self) -> int:
        return len(self.members)

    def rank(self) -> int:
        return self.index


def _group(name: str, members: list[int], rank: int) -> Optional[PlannedGroup]:
    members = sorted(members)
    return PlannedGroup(name, tuple(members), members.index(rank)) if len(members) > 1 else None


def _members(grid: np.ndarray, rank: int, axes: tuple[int, ...]) -> list[int]:
    """Global ranks that differ from ``rank`` only along ``axes`` of the [pp, dp, cp, tp] grid."""
    where = [int(i) for i in np.argwhere(grid == rank)[0]]
    index = tuple(slice(None) if a in axes else where[a] for a in range(grid.ndim))
    return [int(r) for r in np.asarray(grid[index]).reshape(-1)]


def planned_context(world_size: int, rank: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                    device: str | torch.device = "meta", replicas: int = 1) -> ParallelContext:
    """The context global rank ``rank`` of ``world_size`` would have, with placeholder groups.

    Raises ConfigError (naming the flag) when the world does not factor, as a real launch would.
    """
    dp = data_parallel_size_of(world_size, tp, cp, pp)
    check_expert_ranks(ep, dp, cp)
    if replicas < 1 or (dp * cp) % replicas:
        raise ValueError(f"--num-distributed-optimizer-instances ({replicas}) must divide DP x CP ({dp * cp})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    grid = rank_grid(tp, cp, dp, pp)
    pp_rank, dp_rank, cp_rank, tp_rank = (int(i) for i in np.argwhere(grid == rank)[0])
    PP, DP, CP, TP = 0, 1, 2, 3
    pipeline = _members(grid, rank, (PP,))
    groups = dict(tp_group=_group("tp", _members(grid, rank, (TP,)), rank),
                  cp_group=_group("cp", _members(grid, rank, (CP,)), rank),
                  dp_group=_group("dp", _members(grid, rank, (DP,)), rank),
                  pp_group=_group("pp", pipeline, rank),
                  dp_cp_group=_group("dp_cp", _members(grid, rank, (DP, CP)), rank),
                  tp_cp_group=_group("tp_cp", _members(grid, rank, (CP, TP)), rank),
                  model_parallel_group=_group("model_parallel", _members(grid, rank, (PP, TP)), rank))
    if pp > 1 and rank in (pipeline[0], pipeline[-1]):
        groups["embedding_group"] = _group("embedding", [pipeline[0], pipeline[-1]], rank)
    # EP splits this stage's DP x CP ranks (index dp_rank * CP + cp_rank) as (expert_dp, ep), ep fastest.
    dpcp = _members(grid, rank, (DP, CP))
    index = dp_rank * cp + cp_rank
    ep_rank, expert_dp_rank = index % ep, index // ep
    groups["ep_group"] = _group("ep", [dpcp[expert_dp_rank * ep + e] for e in range(ep)], rank)
    groups["expert_dp_group"] = _group("expert_dp", [dpcp[j * ep + ep_rank] for j in range(dp * cp // ep)], rank)
    # Hybrid sharding: R shard groups of S consecutive DP x CP ranks, replica groups across them.
    shard = dp * cp // replicas
    shard_rank, replica_rank = index % shard, index // shard
    if replicas > 1:
        groups["dp_cp_shard_group"] = _group("dp_cp_shard", dpcp[replica_rank * shard:][:shard], rank)
        groups["dp_cp_replica_group"] = _group("dp_cp_replica", dpcp[shard_rank::shard], rank)
    # Key/value replica subgroups (GQA with TP > query groups) are made on demand by
    # meshtron.parallel.context.tp_subgroup through this cache: fill it so that no group is created.
    tp_members = _members(grid, rank, (TP,))
    subgroups = {size: _group(f"tp_sub{size}", tp_members[tp_rank // size * size:(tp_rank // size + 1) * size], rank)
                 for size in range(1, tp + 1) if tp % size == 0}
    return ParallelContext(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, rank=rank, device=torch.device(device),
                           tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=pp_rank, ep_rank=ep_rank,
                           expert_dp_rank=expert_dp_rank, dp_cp_replicas=replicas, dp_cp_shard_rank=shard_rank,
                           dp_cp_replica_rank=replica_rank, pp_ranks=tuple(pipeline),
                           later_groups=LaterGroups(tp=subgroups),
                           **groups)


def without_data_parallel_groups(ctx: ParallelContext) -> ParallelContext:
    """A copy whose DP x CP and expert-DP groups are None (sizes kept), for the bucket layout code, which
    asks torch.distributed for this rank's index in them (the planner sets that index itself)."""
    return dataclasses.replace(ctx, dp_cp_group=None, expert_dp_group=None, dp_cp_shard_group=None,
                               dp_cp_replica_group=None)


def group_rank(group: Optional[PlannedGroup]) -> int:
    """This rank's index in a planned group (0 for a group of one)."""
    return 0 if group is None else group.index
