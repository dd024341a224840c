"""Pipeline parallelism over NCCL on two GPUs: the point-to-point plans run without deadlock under
NCCL's blocking groups, and 1F1B / interleaved 1F1B (also with compiled layers, whose sent outputs
are freed) give the one-GPU losses, gradients and weights. Needs two CUDA devices."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtron.parallel.context import ParallelContext
from pipeline_helpers import layout_worker, model_config, run_config, train_and_collect

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]


def _nccl_worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        result = ("ok", layout_worker(rank, world, cases, "cuda"))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_nccl(cases: list, world: int = 2, timeout: float = 300.0) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_nccl_worker, args=(r, world, port, out_dir, cases)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} hung (a point-to-point deadlock?)"
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            assert status == "ok", f"rank {r}:\n{value}"
            results.append(value)
        return results


def test_pipeline_over_nccl_matches_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [run_config(model_config(tied=True), pp=2, device="cuda"),
             run_config(model_config(tied=True), pp=2, vpp=2, device="cuda"),
             run_config(model_config(tied=False), pp=2, vpp=2, device="cuda", compile=True),
             run_config(model_config(tied=True), pp=2, vpp=2, device="cuda", overlap_p2p_comm=True)]
    results = _run_nccl(cases)
    for i, cfg in enumerate(cases):
        one = run_config(cfg.model, micro_batch=cfg.train.micro_batch_size, global_batch=cfg.train.global_batch_size,
                         device="cuda")
        ref = train_and_collect(one, ParallelContext(device=torch.device("cuda", 0)))
        for rank, per_case in enumerate(results):
            out = per_case[i]
            torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out["eval_loss"], ref["eval_loss"], rtol=1e-4, atol=1e-5)
            for name in ref["grads"]:
                torch.testing.assert_close(out["grads"][name], ref["grads"][name], rtol=1e-3, atol=1e-5,
                                           msg=lambda m: f"case {i} rank {rank} {name}: {m}")
