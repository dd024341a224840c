"""The ``--inject-fault KIND:RANK:ITERATION[:ARG]`` values: parsing and checks (no torch needed).

:mod:`meshtron.resilience.faults` says what each kind does; validation calls
:func:`check_faults` so that a bad spec fails before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from meshtron.config import ConfigError

FLAG = "--inject-fault"
FORM = "KIND:RANK:ITERATION[:ARG]"
FAULT_KINDS: tuple[str, ...] = ("crash", "hang", "hang-send", "slow", "nan", "nan-persistent", "bitflip")


@dataclass(frozen=True)
class FaultSpec:
    """One ``--inject-fault`` entry."""

    kind: str
    rank: int
    iteration: int
    arg: Optional[float] = None

    def __str__(self) -> str:
        tail = "" if self.arg is None else f":{self.arg:g}"
        return f"{self.kind}:{self.rank}:{self.iteration}{tail}"


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(f"{FLAG} {text!r}: {why}; expected {FORM} with KIND one of {', '.join(FAULT_KINDS)} "
                       f"(e.g. {FLAG} crash:1:5 or {FLAG} slow:0:3:0.5)")


def parse_fault(text: str) -> FaultSpec:
    """Parse one ``KIND:RANK:ITERATION[:ARG]``. Raises ConfigError naming ``--inject-fault``."""
    parts = str(text).strip().split(":")
    if len(parts) not in (3, 4):
        raise _bad(text, "wrong number of fields")
    kind = parts[0].strip().lower()
    if kind not in FAULT_KINDS:
        raise _bad(text, f"unknown kind {parts[0]!r}")
    try:
        rank, iteration = int(parts[1]), int(parts[2])
    except ValueError:
        raise _bad(text, "RANK and ITERATION must be integers") from None
    if rank < 0 or iteration < 1:
        raise _bad(text, "RANK must be >= 0 and ITERATION >= 1")
    arg: Optional[float] = None
    if len(parts) == 4:
        try:
            arg = float(parts[3])
        except ValueError:
            raise _bad(text, "ARG must be a number") from None
    if kind == "slow" and (arg is None or not arg > 0):
        raise _bad(text, "slow needs ARG, the seconds to sleep per iteration (> 0)")
    if kind == "bitflip" and arg is not None and (not float(arg).is_integer() or not 0 <= arg < 32):
        raise _bad(text, "bitflip's ARG is the bit to flip, an integer in 0..31")
    if kind not in ("slow", "bitflip") and arg is not None:
        raise _bad(text, f"{kind} takes no ARG")
    return FaultSpec(kind, rank, iteration, arg)


def parse_faults(texts: Iterable[str]) -> list[FaultSpec]:
    """Parse every ``--inject-fault`` value (ConfigError on the first bad one)."""
    return [parse_fault(t) for t in texts]


def check_faults(texts: Iterable[str], world_size: int, train_iters: Optional[int] = None,
                 pipeline_stages: int = 1) -> list[FaultSpec]:
    """Parse and check the specs against the job: RANK below the world size; ``hang-send`` only with
    pipeline parallelism. Raises ConfigError."""
    specs = parse_faults(texts)
    for spec in specs:
        if spec.kind == "hang-send" and pipeline_stages < 2:
            raise ConfigError(f"{FLAG} {spec}: hang-send stops a pipeline send and needs "
                              f"--pipeline-model-parallel-size > 1; use hang for a collective")
        if spec.rank >= world_size:
            raise ConfigError(f"{FLAG} {spec}: rank {spec.rank} does not exist in a world of {world_size} "
                              f"process(es); expected {FORM}")
        if train_iters is not None and spec.iteration > train_iters:
            raise ConfigError(f"{FLAG} {spec}: iteration {spec.iteration} is after the last one "
                              f"(--train-iters {train_iters}); expected {FORM}")
    return specs
