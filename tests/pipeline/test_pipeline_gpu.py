"""Pipeline parallelism over NCCL on two GPUs: the point-to-point plans run without deadlock under
NCCL's blocking groups, and 1F1B / interleaved 1F1B (also with compiled layers, whose sent outputs
are freed) give the one-GPU losses, gradients and weights. On two GPUs over NCCL, or with both ranks
on one GPU through the staged group (tests/distributed/staged_group.py) where there is one."""

from __future__ import annotations

import pytest
import torch

from meshtron.parallel.context import ParallelContext
from pipeline_helpers import layout_worker, model_config, run_config, train_and_collect
from tests.distributed.launch import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")]


def gpu_cases() -> list:
    """The pipeline schedules on the GPU (ZeRO-3's prefetch: tests/optim/test_sharding_strategies.py)."""
    return [run_config(model_config(tied=True), pp=2, device="cuda"),
            run_config(model_config(tied=True), pp=2, vpp=2, device="cuda"),
            run_config(model_config(tied=False), pp=2, vpp=2, device="cuda", compile=True),
            run_config(model_config(tied=True), pp=2, vpp=2, device="cuda", overlap_p2p_comm=True),
            run_config(model_config(tied=True), pp=2, device="cuda", pipeline_schedule="zero-bubble-h1")]


def test_pipeline_over_nccl_matches_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = gpu_cases()
    results = run_distributed(layout_worker, 2, cases, "cuda", backend="nccl", timeout=300)
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
