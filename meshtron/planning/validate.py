"""The configuration check of a plan: a run for GPUs that this machine need not have.

Read by ``meshtron plan`` (:mod:`meshtron.planning.cli`), the layout search (:mod:`meshtron.planning.search`) and
the measured records (:mod:`meshtron.planning.measured`); it sits below all three so that none imports a command.
"""

from __future__ import annotations

import copy

from meshtron.config import MeshtronConfig
from meshtron.validation import check, check_cuda_graphs, resolve


def validate_for_plan(cfg: MeshtronConfig, world_size: int) -> MeshtronConfig:
    """Resolve and check ``cfg`` for ``world_size`` GPUs that this machine need not have.

    The checks run on a copy that says ``--device cpu`` where the configuration says cuda: the only
    rules that differ are the ones asking for CUDA on this machine, and the flags that need it.
    """
    if cfg.train.device is None:
        cfg.train.device = "cuda"
    resolve(cfg, world_size)
    probe = copy.deepcopy(cfg)
    if probe.train.device == "cuda":
        probe.train.device = "cpu"
        probe.parallel.async_tensor_parallel = False
        probe.log.record_memory_history = False
        probe.train.enable_cuda_graph = False  # checked below on the configuration itself
        if probe.parallel.distributed_backend == "nccl":
            probe.parallel.distributed_backend = "gloo"
    check(probe, world_size)
    check_cuda_graphs(cfg)
    return cfg
