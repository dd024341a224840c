"""The optimizer seam: what each ``--optimizer`` is, for the code that builds, shards, saves and plans it.

An entry (:class:`OptimizerKind`) declares:

- its **state names** per parameter: ``"master"`` (the fp32 master weights every meshtron optimizer
  keeps) plus its own (AdamW's ``exp_avg`` and ``exp_avg_sq``, Muon's ``momentum_buffer``). They name
  the checkpoint keys (``optim.<state>.<canonical tensor>``, :mod:`meshtron.checkpoint.pieces`) and the
  memory report. A parameter's states depend only on its canonical pieces (names, full shapes), never
  on the layout, so a checkpoint written under one layout loads under any other;
- its **state bytes** per parameter element besides the master, for the static memory report, the
  memory model and the planner;
- its **layout need**: :data:`ELEMENTS` (a rank may own any contiguous range of the flat buffers, as
  AdamW's elementwise update allows) or :data:`WHOLE` (every parameter owned whole by one rank of its
  bucket's group, as an update that looks at a whole matrix needs); the bucket placement honours it
  (:func:`meshtron.optim.buckets.place_buckets`);
- how to **build** the optimizer over every parameter of a rank (no data-parallel sharding of the
  state), and the **partitions** the distributed optimizer steps this rank's owned segments with
  (:class:`meshtron.optim.distributed_optimizer.DistributedOptimizer`);
- optionally its **checks** of the configuration and the **extra work of its step** (matmul FLOPs and
  tensor-parallel gathers) for the step-time model.

Entries are modules of :mod:`meshtron.optim.kinds`, each defining ``KIND``; they are found when first
asked for, so a new optimizer is one new module there (plus its flags).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

#: Layout needs.
ELEMENTS = "elements"
WHOLE = "whole"


@dataclass(frozen=True)
class StepWork:
    """Work an optimizer's step does beyond streaming its state through memory, on one rank."""

    matmul_flops: float = 0.0  # e.g. Newton-Schulz iterations
    matmul_rate: float = 1.0  # their rate as a fraction of the bf16 matmul rate (fp32 operands: TF32 or fp32)
    gather_bytes: float = 0.0  # bytes all-gathered over the tensor-parallel group
    gathers: int = 0  # all-gather calls over the tensor-parallel group


@dataclass(frozen=True)
class OptimizerKind:
    """One ``--optimizer`` choice (see the module docstring).

    state_names(pieces) -> ("master", ...): the states of a parameter cut from ``pieces``
        (:class:`meshtron.parallel.sharding.Piece`).
    state_bytes(optim_cfg, pieces) -> bytes of state per element besides the master.
    build(params, optim_cfg, ctx) -> a TrainingOptimizer over every parameter (no sharded state).
    partitions(segments, params, grad_data, param_data, optim_cfg, ctx, host) -> the parts that step
        ``segments`` (:class:`meshtron.optim.offload.Segment`) for the distributed optimizer; each part has
        SegmentAdamW's interface.
    check(cfg): raise ConfigError for settings this optimizer does not support.
    step_work(cfg, tp, dp, pp) -> StepWork: per rank, for the step-time model.
    """

    name: str
    layout: str
    state_names: Callable
    state_bytes: Callable
    build: Callable
    partitions: Callable
    check: Optional[Callable] = None
    step_work: Optional[Callable] = None
    description: str = ""


_KINDS: dict[str, OptimizerKind] = {}


def _discover() -> None:
    if _KINDS:
        return
    from meshtron.optim import kinds

    for info in sorted(pkgutil.iter_modules(kinds.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{kinds.__name__}.{info.name}")
        kind = getattr(module, "KIND", None)
        if isinstance(kind, OptimizerKind):
            if kind.layout not in (ELEMENTS, WHOLE):
                raise ValueError(f"optimizer {kind.name!r}: layout must be {ELEMENTS!r} or {WHOLE!r}")
            _KINDS[kind.name] = kind


def optimizer_names() -> tuple[str, ...]:
    """Every registered ``--optimizer`` value."""
    _discover()
    return tuple(sorted(_KINDS))


def optimizer_kind(name: str) -> OptimizerKind:
    """The entry of ``--optimizer name``."""
    _discover()
    if name not in _KINDS:
        raise ValueError(f"unknown optimizer {name!r} (valid: {', '.join(sorted(_KINDS))})")
    return _KINDS[name]


def kind_of(cfg) -> OptimizerKind:
    """The entry of a run's configuration (a MeshtronConfig or its OptimConfig)."""
    optim = getattr(cfg, "optim", cfg)
    return optimizer_kind(optim.optimizer)


def param_state_names(kind: OptimizerKind, param) -> tuple[str, ...]:
    """The states ``kind`` keeps for a model parameter (by its ShardSpec's pieces)."""
    from meshtron.parallel.sharding import spec_of

    return tuple(kind.state_names(spec_of(param).pieces))


def param_state_bytes(kind: OptimizerKind, cfg, param) -> int:
    """Bytes per element of the states besides the master that ``kind`` keeps for ``param``."""
    from meshtron.parallel.sharding import spec_of

    return int(kind.state_bytes(getattr(cfg, "optim", cfg), spec_of(param).pieces))


def matrix_state_bytes(cfg) -> int:
    """Bytes per element of the states besides the master that the run's optimizer keeps for a hidden
    weight matrix (the bulk of a model's parameters): the analytic memory model's rate per parameter."""
    from meshtron.parallel.sharding import Piece

    return int(kind_of(cfg).state_bytes(getattr(cfg, "optim", cfg), (Piece("layers.0.mlp.up.weight", (2, 2), 0, 0, 2),)))


def whole_layout(cfg) -> bool:
    """Whether the run's optimizer needs whole parameters per owner."""
    return kind_of(cfg).layout == WHOLE


def check(cfg) -> None:
    """The run optimizer's own checks of ``cfg``."""
    kind = kind_of(cfg)
    if kind.check is not None:
        kind.check(cfg)


def describe(pieces: Sequence) -> str:
    return ", ".join(p.name for p in pieces)
