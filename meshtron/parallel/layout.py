"""The integer rules of the rank layout, below the process groups and layers that follow them (torch-free).

The world of ``TP x CP x DP x PP`` ranks, the expert ranks over ``DP x CP`` and sequence parallelism over the
tensor-parallel ranks: the layers, the process groups
(:mod:`meshtron.parallel.context`), the planner's fake groups (:mod:`meshtron.planning.fake_context`) and the
configuration check (:mod:`meshtron.validation`) all call these, so each rule is said once and its message names
the flags.
"""

from __future__ import annotations

from meshtron.errors import ConfigError


def _require_positive(items: list[tuple[str, int]]) -> None:
    for flag, value in items:
        if value is None or not value > 0:
            raise ConfigError(f"{flag} must be positive, got {value}")


def data_parallel_size_of(world_size: int, tp: int, cp: int, pp: int) -> int:
    """DP = world / (TP x CP x PP); ConfigError naming the flags when the world size does not factor."""
    _require_positive([("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
                       ("--pipeline-model-parallel-size", pp)])
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    if world_size % (tp * cp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by TP({tp}) x CP({cp}) x PP({pp}) = {tp * cp * pp}: "
            f"choose --tensor-model-parallel-size, --context-parallel-size and --pipeline-model-parallel-size "
            f"whose product divides {world_size}")
    return world_size // (tp * cp * pp)


def check_expert_ranks(ep: int, dp: int, cp: int) -> None:
    """Experts split the DP x CP ranks of a pipeline stage: EP must divide DP x CP."""
    _require_positive([("--expert-model-parallel-size", ep)])
    if (dp * cp) % ep:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) must divide data-parallel size ({dp}) x "
                          f"--context-parallel-size ({cp}) = {dp * cp}")


def sequence_parallel_in_effect(requested: bool, tp: int) -> bool:
    """Sequence parallelism splits the sequence over the tensor-parallel ranks, so it is in effect only with
    TP > 1 (validation refuses ``--sequence-parallel`` with TP 1; a layer built alone may still be asked)."""
    return bool(requested) and tp > 1
