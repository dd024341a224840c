"""Checks of the resilience flags (called by validation; no torch needed)."""

from __future__ import annotations

from typing import Any, Optional

from meshtron.config import ConfigError
from meshtron.resilience.fault_specs import check_faults


def check_resilience(cfg: Any, world_size: Optional[int]) -> None:
    """``--inject-fault``, ``--hang-timeout-seconds``, ``--hang-startup-timeout-seconds`` and
    ``--max-restarts``; raises ConfigError naming the flag."""
    t, p = cfg.train, cfg.parallel
    if t.inject_fault:
        check_faults(t.inject_fault, world_size if world_size is not None else 1 << 62, t.train_iters,
                     p.pipeline_model_parallel_size)
    for flag, value in (("--hang-timeout-seconds", t.hang_timeout_seconds),
                        ("--hang-startup-timeout-seconds", t.hang_startup_timeout_seconds),
                        ("--max-restarts", cfg.launcher.max_restarts)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value:g}")
    collective_timeout = 60.0 * p.distributed_timeout_minutes
    if t.hang_timeout_seconds and t.hang_timeout_seconds >= collective_timeout:
        raise ConfigError(f"--hang-timeout-seconds ({t.hang_timeout_seconds:g}) must be below "
                          f"--distributed-timeout-minutes ({p.distributed_timeout_minutes:g} min = "
                          f"{collective_timeout:g} s), so that a stuck collective is reported before it times out")
