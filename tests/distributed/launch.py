"""Run a function in N local processes joined by a gloo process group (CPU tests of parallel code).

The function must be defined at module level (it is pickled into the worker processes, forked from a
server that has imported torch and meshtron once). With ``backend="nccl"`` on a machine with fewer GPUs than ranks, the ranks share the GPUs
(rank r on GPU r modulo their count) and join a group that stages every collective through host memory
(:mod:`tests.distributed.staged_group`; NCCL refuses two ranks on one device); workers take their
device from :func:`rank_device`. Each process returns a value; ``run_distributed`` returns them by
rank. A hang fails the test after ``timeout`` seconds instead of stalling CI. Each process ends
with :func:`meshtron.training.lifecycle.shutdown_distributed`, as ``meshtron train`` does.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtron.training.lifecycle import shutdown_distributed
from tests.distributed.staged_group import BACKEND as STAGED
from tests.distributed.staged_group import register_backend as register_staged_backend

#: Bound of each teardown step of a worker (as --distributed-timeout-minutes bounds it in a real run).
_TEARDOWN_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(rank: int) -> torch.device:
    """The CUDA device of ``rank`` in a GPU run of :func:`run_distributed` (shared when ranks outnumber GPUs)."""
    return torch.device("cuda", rank % torch.cuda.device_count())


#: Modules the fork server imports once, so that each worker forked from it starts in milliseconds instead of
#: importing torch and meshtron again (seconds per process, most of a short multi-process test on two cores).
_PRELOAD = ["torch", "torch.distributed", "meshtron.training.trainer", "tests.distributed.launch"]


def _context() -> mp.context.BaseContext:
    """The fork-server context, its server started with :data:`_PRELOAD` on first use (spawn where the platform
    has no fork server, or with ``MESHTRON_TEST_START_METHOD=spawn``)."""
    if "forkserver" not in mp.get_all_start_methods() or os.environ.get("MESHTRON_TEST_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple, backend: str,
            environ: dict) -> None:
    # A forked worker inherits the fork server's environment, not the test's at launch: take the test's, as a
    # spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    gpus = torch.cuda.device_count()
    local = rank % gpus if gpus and backend in ("nccl", STAGED) else rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        elif backend == STAGED:
            if gpus:
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.cuda.set_device(local)
            register_staged_backend()
            dist.init_process_group(STAGED, rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    del result  # it may hold the run's objects, and with them its process groups
    # The same teardown as `meshtron train` (no more, no less), so that an exit problem of the real
    # command also shows here.
    shutdown_distributed(_TEARDOWN_TIMEOUT_S)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (or NCCL ranks, one GPU each, with
    ``backend="nccl"``; ranks sharing GPUs through the staged group where there are fewer GPUs than ranks);
    return results by rank."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        backend = STAGED
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context()
        environ = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args, backend, environ))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        errors = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
