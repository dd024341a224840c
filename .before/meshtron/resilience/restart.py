"""Automatic restart: which attempt of the job this process belongs to, and where it resumes.

torchrun (``--max-restarts N``) restarts every worker of a job after one of them fails
and tells the new workers their attempt in ``TORCHELASTIC_RESTART_COUNT``; a SLURM
requeue says it in ``SLURM_RESTART_COUNT``. A restarted attempt resumes from the latest
complete checkpoint: when ``--load`` is not given, from ``--save``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Mapping, Optional

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


def resume_candidates(load: Optional[str], save: Optional[str], attempt: int) -> list[tuple[str, bool]]:
    """The checkpoint directories this attempt tries, in order, each with whether it is the user's
    ``--load`` (where ``--finetune`` applies): a restarted attempt first tries ``--save``, where this
    job's own progress is."""
    out: list[tuple[str, bool]] = []
    if attempt > 0 and save:
        out.append((save, False))
    if load and not (attempt > 0 and load == save):
        out.append((load, True))
    return out


def restart_event(attempt: int, resumed_from: int) -> dict:
    """The metrics-file event of a restarted attempt (DESIGN section 6)."""
    return {"type": "restart", "attempt": attempt, "iteration": resumed_from}


def attempt_store_options(timeout: datetime.timedelta,
                          environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """``init_process_group`` arguments that keep a restarted attempt's keys apart from the last one's.

    torchrun's static rendezvous keeps one store (in the launcher's agent) across restarts,
    so a restarted worker would read the dead attempt's addresses (gloo: "connection refused").
    On a restarted attempt under that agent store, this is ``store`` (the agent's store under a
    per-attempt prefix), ``rank`` and ``world_size``; otherwise empty (the usual ``env://``).
    """
    env = os.environ if environ is None else environ
    attempt = restart_count(env)
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    import torch.distributed as dist

    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                           is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"meshtron/attempt_{attempt}", client), "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"])}
