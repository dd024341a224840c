"""Run a function in N local processes joined by a gloo process group over a FileStore, with a timeout."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the results by rank.

    ``fn`` must be importable (defined at module level). A rank that does not finish within
    ``timeout`` seconds fails the test instead of hanging it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store, tmp, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
