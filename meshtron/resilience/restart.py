"""Automatic restart: which attempt of the job this process belongs to, and where it resumes.

torchrun (``--max-restarts N``) restarts every worker of a job after one of them fails
and tells the new workers their attempt in ``TORCHELASTIC_RESTART_COUNT``; a SLURM
requeue says it in ``SLURM_RESTART_COUNT``. A restarted attempt resumes from the latest
complete checkpoint: when ``--load`` is not given, from ``--save``.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

#: Environment variables that carry the restart attempt (0 for the first attempt), in the order read.
RESTART_COUNT_VARIABLES: tuple[str, ...] = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's restart attempt: 0 in the first attempt, k after the k-th automatic restart."""
    env = os.environ if environ is None else environ
    for name in RESTART_COUNT_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            try:
                return max(0, int(value))
            except ValueError:
                continue
    return 0


def is_restarted_attempt(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in an attempt that an automatic restart started."""
    return restart_count(environ) > 0


def resume_directory(load: Optional[str], save: Optional[str], attempt: int) -> Optional[str]:
    """Where this attempt loads its checkpoint from: ``--load``, else ``--save`` on a restarted attempt."""
    if load:
        return load
    if attempt > 0 and save:
        return save
    return None


def restart_event(attempt: int, resumed_from: int) -> dict:
    """The metrics-file event of a restarted attempt (DESIGN section 6)."""
    return {"type": "restart", "attempt": attempt, "iteration": resumed_from}
