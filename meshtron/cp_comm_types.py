"""The values of ``--cp-comm-type`` and the head counts all-to-all context parallelism needs.

Torch-free and outside :mod:`meshtron.parallel`: checking a configuration imports neither."""

from __future__ import annotations

import math
from typing import Optional

from meshtron.config import ConfigError

COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")


def check_comm_type(comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")


def single_comm_type(value) -> str:
    """``--cp-comm-type`` as one value: Megatron takes one per layer; a list of identical values is that value,
    a mixed list is refused (meshtron uses one communication type for every layer)."""
    if isinstance(value, (list, tuple)):
        values = list(dict.fromkeys(str(v) for v in value))
        if len(values) != 1:
            raise ConfigError(f"--cp-comm-type: one type for every layer is supported, got the mixed list "
                              f"{' '.join(str(v) for v in value)}")
        value = values[0]
    check_comm_type(value)
    return value


def a2a_degree(comm_type: str, cp: int, hierarchical: Optional[list] = None) -> int:
    """How many CP ranks exchange heads for sequence: CP for ``a2a``, A of ``--hierarchical-context-parallel-sizes
    A B`` for ``a2a+p2p``, 1 (none) for the ring and the all-gather."""
    if comm_type == "a2a":
        return cp
    if comm_type == "a2a+p2p":
        return int(hierarchical[0]) if hierarchical else cp
    return 1


def a2a_kv_replicas(heads: int, groups: int, degree: int) -> int:
    """By how much all-to-all context parallelism repeats each key/value head (query group) so that the
    groups split evenly over ``degree`` ranks: ``lcm(groups, degree) / groups`` (1 when they already do)."""
    return math.lcm(groups, degree) // groups


def check_a2a_heads(heads: int, groups: int, degree: int, tp: int = 1, comm_type: str = "a2a") -> None:
    """All-to-all CP gives each of ``degree`` ranks ``heads / degree`` of the query heads of a TP rank; key/value
    heads that do not split evenly are repeated (:func:`a2a_kv_replicas`), which keeps GQA exact."""
    if degree > 1 and heads % degree:
        where = f" per tensor-parallel rank ({heads * tp} / --tensor-model-parallel-size {tp})" if tp > 1 else ""
        size = "--context-parallel-size" if comm_type == "a2a" else \
            "the a2a size of --hierarchical-context-parallel-sizes"
        raise ConfigError(f"--cp-comm-type {comm_type} needs the attention heads{where} ({heads}, key/value heads "
                          f"{groups}) divisible by {size} ({degree})")
