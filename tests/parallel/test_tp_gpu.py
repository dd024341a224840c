"""Tensor and sequence parallelism over NCCL on two GPUs, with torch.compile'd layers: every path
through the column/row-parallel layers (backward overlap on and off) gives the one-GPU losses and
gradients. The CPU tests run eagerly; this is where the compiled backward of the communication
functions is checked. Needs two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from meshtron.parallel.context import ParallelContext
from tests.distributed.launch import run_distributed
from tests.pipeline.pipeline_helpers import layout_worker, model_config, run_config, train_and_collect

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

CASES = {
    "eager-overlap": dict(compile=False, tp_comm_overlap=True),
    "compiled-overlap": dict(compile=True, tp_comm_overlap=True),
    "compiled-no-overlap": dict(compile=True, tp_comm_overlap=False),
}


def test_compiled_tensor_parallel_over_nccl_matches_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [run_config(model_config(tied=False), tp=2, sp=True, global_batch=4, device="cuda", **kw)
             for kw in CASES.values()]
    results = run_distributed(layout_worker, 2, cases, "cuda", backend="nccl", timeout=400)
    one = run_config(model_config(tied=False), global_batch=4, device="cuda")
    ref = train_and_collect(one, ParallelContext(device=torch.device("cuda", 0)))
    failures = []
    for i, name in enumerate(CASES):
        for rank, per_case in enumerate(results):
            out = per_case[i]
            if not torch.allclose(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5):
                failures.append(f"{name} rank {rank}: losses {out['losses']} != {ref['losses']}")
            for key in ref["grads"]:
                got, want = out["grads"][key], ref["grads"][key]
                if not torch.allclose(got, want, rtol=1e-3, atol=1e-5):
                    failures.append(f"{name} rank {rank}: grad {key} off by {(got - want).abs().max():.3g} "
                                    f"(norm {got.norm():.4g} vs {want.norm():.4g})")
    assert not failures, "\n".join(failures)
