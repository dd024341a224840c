"""SLURM launches with one task per GPU (``srun --ntasks-per-node 8 meshtron train ...``).

torch.distributed's ``env://`` rendezvous reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``, which torchrun sets and srun does not. When SLURM's variables are present and torchrun's are
not, :func:`torchrun_variables` derives them from SLURM's:

- ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``;
- ``MASTER_ADDR``: kept when set, else the first host of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``);
- ``MASTER_PORT``: kept when set, else ``20000 + SLURM_JOB_ID mod 20000`` (the same on every task of a job,
  and two jobs sharing a node rarely collide).

The other launch style, one task per node that starts torchrun (``srun --ntasks-per-node 1 meshtron train
--nproc-per-node 8 ...``), needs none of this: torchrun sets its own variables.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, MutableMapping, Optional

from meshtron.errors import ConfigError

#: The variables torch's env:// rendezvous reads; any of them set means another launcher is in charge.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list: ``gpu[003-008,012],cpu1`` -> ``gpu003``."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", text)
    if not text or match is None or not (match.group(1) or match.group(2)):
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host; set MASTER_ADDR to the first node's address")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first.isdigit():
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the host range [{ranges}]; set MASTER_ADDR")
    return prefix + first + suffix


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise ConfigError(f"{name} is not set, although SLURM_PROCID is: run under srun, or set RANK, WORLD_SIZE "
                          f"and LOCAL_RANK yourself")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def slurm_tasks(env: Mapping[str, str]) -> Optional[int]:
    """The number of SLURM tasks of this job step, or None outside a SLURM step."""
    if "SLURM_PROCID" not in env:
        return None
    return _integer(env, "SLURM_NTASKS")


def torchrun_variables(env: Mapping[str, str]) -> Optional[dict[str, str]]:
    """The torch.distributed variables of this SLURM task, or None when they are not needed (no SLURM step,
    a step of one task, or torchrun's variables already present). Raises ConfigError naming the variable when
    SLURM's variables contradict each other."""
    if "SLURM_PROCID" not in env:
        return None
    present = [name for name in TORCHRUN_VARIABLES if name in env]
    if present:
        if len(present) < len(TORCHRUN_VARIABLES):
            missing = [name for name in TORCHRUN_VARIABLES if name not in env]
            raise ConfigError(f"{', '.join(present)} set but {', '.join(missing)} not: set all of "
                              f"{', '.join(TORCHRUN_VARIABLES)} (or none, and SLURM's are used)")
        return None
    rank, tasks, local_rank = (_integer(env, "SLURM_PROCID"), _integer(env, "SLURM_NTASKS"),
                               _integer(env, "SLURM_LOCALID"))
    if tasks < 1 or not 0 <= rank < tasks:
        raise ConfigError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={tasks}")
    if tasks == 1:
        return None  # one task: a plain process, no process group needed
    if local_rank < 0 or local_rank > rank:
        raise ConfigError(f"SLURM_LOCALID={local_rank} does not fit SLURM_PROCID={rank} (it must lie in 0..{rank})")
    out = {"RANK": str(rank), "WORLD_SIZE": str(tasks), "LOCAL_RANK": str(local_rank)}
    if "SLURM_NTASKS_PER_NODE" in env:
        per_node = env["SLURM_NTASKS_PER_NODE"].split("(")[0]
        if per_node.isdigit():
            if local_rank >= int(per_node):
                raise ConfigError(f"SLURM_LOCALID={local_rank} is not below SLURM_NTASKS_PER_NODE={per_node}")
            out["LOCAL_WORLD_SIZE"] = per_node
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: export MASTER_ADDR=<first node>")
        out["MASTER_ADDR"] = first_host(nodelist)
    if "MASTER_PORT" not in env:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if job is None or not job.isdigit():
            raise ConfigError("MASTER_PORT is not set and SLURM_JOB_ID gives no port: export MASTER_PORT=<free port>")
        out["MASTER_PORT"] = str(20000 + int(job) % 20000)
    return out


def adopt_slurm_environment(env: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set torch.distributed's variables from SLURM's in ``env`` (default: this process's environment);
    True when it did. See :func:`torchrun_variables`."""
    env = os.environ if env is None else env
    derived = torchrun_variables(env)
    if derived is None:
        return False
    env.update(derived)
    return True


def check_not_doubly_launched(env: Mapping[str, str], nproc_per_node: int) -> None:
    """``--nproc-per-node`` starts torchrun on each SLURM task: refuse it when srun already started one task per
    GPU (several tasks on a node), which would start ``nproc_per_node`` workers per task."""
    tasks = slurm_tasks(env)
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if tasks is None or nodes is None or not nodes.isdigit():
        return
    if tasks > int(nodes):
        raise ConfigError(f"srun started {tasks} tasks on {nodes} node(s) and --nproc-per-node {nproc_per_node} "
                          f"asks each to start its own workers: use srun --ntasks-per-node 1 with --nproc-per-node, "
                          f"or one task per GPU without it")
