"""ParallelContext: every process group and this rank's coordinates.

Rank order, fastest-varying first: TP, CP, DP, PP (Megatron's order, so that a
tensor-parallel group is made of neighbouring ranks, i.e. GPUs of one node):

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

Expert parallelism splits the DP x CP ranks of each pipeline stage (with the same
TP rank): ``ep_rank`` varies fastest inside that set, the remaining index is the
expert-data-parallel rank over which expert gradients are reduced.

Hybrid sharded data parallelism (``--num-distributed-optimizer-instances R``) splits the same
DP x CP ranks (index ``dp_rank * CP + cp_rank``) into R shard groups of S = DP x CP / R
consecutive ranks (neighbours: inside a node), over which the sharded strategies shard, and S
replica groups of R ranks (the same position in each shard group), over which the reduced
shards are summed.

The context is created once, with every group, and passed explicitly; it is frozen (the groups
made later, on first use, live in its own small :class:`LaterGroups`). A process without torch.distributed gets the trivial context (every size 1, no
groups), so every code path also runs in one plain Python process.
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.distributed as dist

from meshtron.resilience.restart import attempt_store_options
from meshtron.parallel.layout import check_expert_ranks, data_parallel_size_of

if TYPE_CHECKING:
    from meshtron.run_layout import RunLayout


@dataclass
class LaterGroups:
    """Groups made after the context, on first use (every rank in the same order): the TP subgroups of
    replicated key/value heads by size (:func:`tp_subgroup`), hierarchical CP's (all-to-all, ring) groups by
    all-to-all size (:func:`meshtron.parallel.context_parallel.attention.cp_subgroups`) and the checkpoint's
    gloo group (:func:`meshtron.checkpoint.coordination.checkpoint_group`)."""

    tp: dict = field(default_factory=dict)
    cp: dict = field(default_factory=dict)
    checkpoint: Optional[dist.ProcessGroup] = None


@dataclass(frozen=True)
class ParallelContext:
    """Process groups and coordinates of this rank, fixed at construction. Groups are None when their size
    is 1."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    expert_dp_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    cp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    dp_cp_group: Optional[dist.ProcessGroup] = None  # gradient reduction of non-expert parameters
    tp_cp_group: Optional[dist.ProcessGroup] = None
    model_parallel_group: Optional[dist.ProcessGroup] = None  # TP x PP: sums of norms over distinct parameters
    embedding_group: Optional[dist.ProcessGroup] = None  # first and last pipeline stage (tied embeddings)
    ep_group: Optional[dist.ProcessGroup] = None
    expert_dp_group: Optional[dist.ProcessGroup] = None
    # Hybrid sharding (R = dp_cp_replicas > 1): the S = DP x CP / R ranks that shard the state together, and
    # the R ranks holding the same shard in the R shard groups. Both None without hybrid sharding.
    dp_cp_replicas: int = 1
    dp_cp_shard_rank: int = 0
    dp_cp_replica_rank: int = 0
    dp_cp_shard_group: Optional[dist.ProcessGroup] = None
    dp_cp_replica_group: Optional[dist.ProcessGroup] = None
    pp_ranks: tuple = (0,)  # global ranks of this rank's pipeline group, by stage
    loss_stage: int = -1  # the pipeline stage with the loss: the last (-1), or the first (0) under ZBV; set at
    # construction from the run's layout (meshtron.run_layout), never changed after
    # Every group's collective timeout (--distributed-timeout-minutes), also for groups created later.
    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    # The groups made on first use: the one mutable part, shared by dataclasses.replace copies (same groups).
    later_groups: LaterGroups = field(default_factory=LaterGroups, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_loss_stage(self) -> bool:
        """Whether this stage computes the loss (the last one, or the first under ZBV's V)."""
        return self.pp_rank == self.loss_stage % self.pp

    @property
    def expert_dp(self) -> int:
        return (self.dp * self.cp) // self.ep

    @property
    def dp_cp_shard(self) -> int:
        """S: the ranks a sharded strategy shards over (DP x CP, or DP x CP / R with hybrid sharding)."""
        return (self.dp * self.cp) // self.dp_cp_replicas

    @property
    def is_logging_rank(self) -> bool:
        """The rank that writes logs and metrics: TP/CP/DP rank 0 of the pipeline stage that holds the
        loss (the last; the first under ZBV). Global rank 0 when PP is 1."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0 and self.is_loss_stage

    def describe(self) -> str:
        hybrid = f" (shard {self.dp_cp_shard} x {self.dp_cp_replicas} replicas)" if self.dp_cp_replicas > 1 else ""
        return f"TP={self.tp} CP={self.cp} DP={self.dp}{hybrid} PP={self.pp} EP={self.ep}"


def rank_grid(tp: int, cp: int, dp: int, pp: int) -> np.ndarray:
    """Global ranks laid out as an array indexed [pp, dp, cp, tp]."""
    return np.arange(tp * cp * dp * pp).reshape(pp, dp, cp, tp)


def _groups_varying(grid: np.ndarray, axes: tuple[int, ...]) -> list[list[int]]:
    """Every group of ranks that differ only along ``axes`` of ``grid``."""
    other = [a for a in range(grid.ndim) if a not in axes]
    moved = np.transpose(grid, other + list(axes))
    flat = moved.reshape(-1, int(np.prod([grid.shape[a] for a in axes])) if axes else 1)
    return [list(map(int, row)) for row in flat]


def _expert_groups(tp: int, cp: int, dp: int, pp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """EP groups and expert-DP groups: the DP x CP ranks of a stage split as (expert_dp, ep)."""
    grid = rank_grid(tp, cp, dp, pp)  # [pp, dp, cp, tp]
    dpcp = grid.reshape(pp, dp * cp, tp)  # dp-major then cp: index = dp_rank * cp + cp_rank
    edp = (dp * cp) // ep
    split = dpcp.reshape(pp, edp, ep, tp)
    ep_groups = _groups_varying(split, (2,))
    edp_groups = _groups_varying(split, (1,))
    return ep_groups, edp_groups


def hybrid_groups(tp: int, cp: int, dp: int, pp: int, replicas: int) -> tuple[list[list[int]], list[list[int]]]:
    """Shard groups and replica groups of hybrid sharding: the DP x CP ranks of a stage split as
    (replica, shard), the shard index fastest (a shard group is S consecutive DP x CP ranks)."""
    grid = rank_grid(tp, cp, dp, pp)
    split = grid.reshape(pp, dp * cp, tp).reshape(pp, replicas, (dp * cp) // replicas, tp)
    return _groups_varying(split, (2,)), _groups_varying(split, (1,))


def _new_groups(all_groups: list[list[int]], rank: int, backend: Optional[str],
                timeout: datetime.timedelta) -> Optional[dist.ProcessGroup]:
    """Create every group (all ranks must call new_group for each) and return this rank's."""
    mine = None
    for ranks in all_groups:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def check_layout(world_size: int, tp: int, cp: int, pp: int, ep: int, replicas: int = 1) -> int:
    """DP of the world split TP x CP x DP x PP, with EP (and hybrid sharding's replicas) over DP x CP; the
    rules are :mod:`meshtron.parallel.layout`'s."""
    dp = data_parallel_size_of(world_size, tp, cp, pp)
    check_expert_ranks(ep, dp, cp)
    if replicas < 1 or (dp * cp) % replicas:
        raise ValueError(f"--num-distributed-optimizer-instances ({replicas}) must divide DP x CP ({dp * cp})")
    return dp


def build_parallel_context(tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, device: Optional[str] = None,
                           backend: Optional[str] = None, timeout_minutes: float = 10.0,
                           replicas: int = 1, loss_stage: int = -1) -> ParallelContext:
    """Initialise torch.distributed if launched by torchrun (WORLD_SIZE set) and build every group.

    Without torchrun (or with a world of one) returns the trivial context. ``loss_stage``: the pipeline stage
    with the loss (the last, -1; the first, 0, under ZBV), fixed at construction.
    """
    dev_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        check_layout(1, tp, cp, pp, ep, replicas)
        dev = torch.device("cuda", torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")
        return ParallelContext(device=dev, loss_stage=loss_stage)

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if dev_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dist.is_initialized():  # a world set up by the caller: its groups take the world's backend
        backend = backend or dist.get_backend()
    backend = backend or ("nccl" if dev_type == "cuda" else "gloo")
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev_type == "cuda" else {}
        kwargs.update(attempt_store_options(timeout))  # a restarted attempt must not read the last one's keys
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return build_groups(tp, cp, pp, ep, dev, backend, timeout, replicas, loss_stage)


def build_groups(tp: int, cp: int, pp: int, ep: int, device: torch.device, backend: Optional[str] = None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10), replicas: int = 1,
                 loss_stage: int = -1) -> ParallelContext:
    """Build every group on an initialised default process group (``replicas``: hybrid sharding's R;
    ``loss_stage`` as in :func:`build_parallel_context`)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    dp = check_layout(world, tp, cp, pp, ep, replicas)
    grid = rank_grid(tp, cp, dp, pp)
    pp_rank, dp_rank, cp_rank, tp_rank = (int(i) for i in np.argwhere(grid == rank)[0])

    PP, DP, CP, TP = 0, 1, 2, 3

    def new(groups: list[list[int]]) -> Optional[dist.ProcessGroup]:
        return _new_groups(groups, rank, backend, timeout)

    # Every rank creates every group, in this order (new_group is collective).
    groups = dict(tp_group=new(_groups_varying(grid, (TP,))), cp_group=new(_groups_varying(grid, (CP,))),
                  dp_group=new(_groups_varying(grid, (DP,))))
    pp_groups = _groups_varying(grid, (PP,))
    groups.update(pp_group=new(pp_groups), dp_cp_group=new(_groups_varying(grid, (DP, CP))),
                  tp_cp_group=new(_groups_varying(grid, (CP, TP))),
                  model_parallel_group=new(_groups_varying(grid, (PP, TP))),
                  embedding_group=new([[g[0], g[-1]] for g in pp_groups] if pp > 1 else []))
    ep_groups, edp_groups = _expert_groups(tp, cp, dp, pp, ep)
    groups.update(ep_group=new(ep_groups), expert_dp_group=new(edp_groups))
    dpcp_index = dp_rank * cp + cp_rank
    shard = (dp * cp) // replicas
    if replicas > 1:
        shard_groups, replica_groups = hybrid_groups(tp, cp, dp, pp, replicas)
        groups.update(dp_cp_shard_group=new(shard_groups), dp_cp_replica_group=new(replica_groups))
    return ParallelContext(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, rank=rank, device=device,
                           tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                           ep_rank=dpcp_index % ep, expert_dp_rank=dpcp_index // ep,
                           dp_cp_replicas=replicas, dp_cp_shard_rank=dpcp_index % shard,
                           dp_cp_replica_rank=dpcp_index // shard,
                           pp_ranks=tuple(next(g for g in pp_groups if rank in g)), loss_stage=loss_stage,
                           timeout=timeout, **groups)


def destroy_process_groups(timeout_s: float) -> bool:
    """Destroy every process group, subgroups first and the default group last; True when done in time.

    ``torch.distributed.destroy_process_group()`` shuts the groups down in the reverse order of their
    creation. Shutting down is local for gloo but may wait on a peer for NCCL, so it runs in a helper
    thread that is given ``timeout_s``: a dead peer cannot hang the exit. The groups' worker threads
    end when the last references to the group objects go (the caller collects them afterwards).
    """
    if not dist.is_available() or not dist.is_initialized():
        return True
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - reported as "not done"; the process is ending anyway
            failure.append(err)

    worker = threading.Thread(target=destroy, name="meshtron-destroy-groups", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive() and not failure


def tp_subgroup(ctx: ParallelContext, size: int) -> Optional[dist.ProcessGroup]:
    """This rank's group of ``size`` consecutive ranks inside its TP group (cached in ``ctx.later_groups``).

    Used for key/value heads replicated over TP ranks when TP exceeds the number of
    query groups. Every rank must call this with the same sizes in the same order.
    """
    if size == 1 or ctx.tp == 1:
        return None
    cache = ctx.later_groups.tp
    if size not in cache:
        grid = rank_grid(ctx.tp, ctx.cp, ctx.dp, ctx.pp)
        groups = [g[i:i + size] for g in _groups_varying(grid, (3,)) for i in range(0, ctx.tp, size)]
        cache[size] = _new_groups(groups, ctx.rank, None, ctx.timeout)
    return cache[size]


def context_from_config(cfg, layout: Optional[RunLayout] = None) -> ParallelContext:
    """The process groups a validated :class:`~meshtron.config.MeshtronConfig` asks for, with the loss stage of
    its resolved ``layout`` (resolved here, for the world about to be built, when the caller has none)."""
    if layout is None:
        from meshtron.run_layout import resolve_layout  # the caller skipped meshtron.validation.validate_run

        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        layout = resolve_layout(cfg, world)
    p = cfg.parallel
    return build_parallel_context(p.tensor_model_parallel_size, p.context_parallel_size,
                                  p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                                  device=cfg.train.device, backend=p.distributed_backend,
                                  timeout_minutes=p.distributed_timeout_minutes,
                                  replicas=getattr(p, "num_distributed_optimizer_instances", 1),
                                  loss_stage=layout.loss_stage)
