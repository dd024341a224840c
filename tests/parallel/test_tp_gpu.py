"""Compiled layers in parallel layouts over NCCL on two GPUs (the cases of test_compiled_parallel.py):
tensor + sequence parallel with the backward overlap on and off, and mixture of experts with expert or
tensor parallelism, give the one-GPU losses and gradients. On two GPUs over NCCL, or with both ranks
on one GPU through the staged group (tests/distributed/staged_group.py) where there is one."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_compiled_parallel import compiled_layout_failures
from tests.pipeline.pipeline_helpers import model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")]


def test_compiled_parallel_layouts_over_nccl_match_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = compiled_layout_failures("cuda", "nccl", rtol=1e-4, atol=1e-5)
    assert not failures, "\n".join(failures)


def test_async_tensor_parallel_over_nccl_matches_one_gpu():
    """--async-tensor-parallel (the compiler's micro-pipelined all-gather/matmul pairs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = {"tp2-sp-async": (model_config(tied=False), dict(tp=2, sp=True, async_tensor_parallel=True), True)}
    failures = compiled_layout_failures("cuda", "nccl", rtol=1e-4, atol=1e-5, cases_by_name=cases)
    assert not failures, "\n".join(failures)
