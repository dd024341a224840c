"""Context-parallel attention over NCCL on two GPUs with the fused kernels (cuDNN, flash, flex for
documents) in bf16: output and gradients match full attention on one GPU. On two GPUs over NCCL, or with both ranks
on one GPU through the staged group (tests/distributed/staged_group.py) where there is one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from meshtron.layers.attention import attention_mask_from_documents
from meshtron.layers.documents import PATH_ENV
from meshtron.parallel.context_parallel.attention import context_parallel_attention, context_parallel_inputs
from meshtron.parallel.context_parallel.kernels import select_kernel
from meshtron.parallel.context import build_groups
from meshtron.parallel.context_parallel.split import gather_sequence, split_sequence
from tests.distributed.launch import rank_device, run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")]

SEQ, HEADS, GROUPS, DIM = 2048, 8, 2, 128
# (kernel, comm type, documents, micro-batch)
# documents: flex attention with block masks (the default), cuDNN with the dense masks (the reference path)
CASES = [("cudnn", "p2p", False, 1), ("cudnn", "allgather", False, 2), ("flex", "p2p", True, 2),
         ("cudnn", "allgather", True, 1), ("flex", "allgather", True, 1), ("flash", "p2p", False, 2),
         ("flash", "allgather", False, 1)]


def _inputs(batch: int, documents: bool, device):
    g = torch.Generator().manual_seed(batch)
    q, k, v, dout = (torch.randn(batch, n, SEQ, DIM, generator=g) for n in (HEADS, GROUPS, GROUPS, HEADS))
    docs = None
    if documents:
        starts = (torch.rand(batch, SEQ, generator=g) < 0.002).int()
        starts[:, 0] = 0
        docs = starts.cumsum(1).int().to(device)
    return [t.to(device, torch.bfloat16) for t in (q, k, v, dout)], docs


def _case(ctx, kernel: str, comm: str, documents: bool, batch: int, device):
    torch.backends.cuda.enable_cudnn_sdp(kernel == "cudnn")
    os.environ[PATH_ENV] = "blocks" if kernel == "flex" else "dense"
    (q, k, v, dout), docs = _inputs(batch, documents, device)
    split = lambda t: split_sequence(t, ctx.cp, ctx.cp_rank, dim=2)  # noqa: E731
    q, k, v = (split(t).clone().requires_grad_() for t in (q, k, v))
    assert select_kernel(q, documents).name == kernel
    local_docs = None if docs is None else split_sequence(docs, ctx.cp, ctx.cp_rank, dim=1)
    out = context_parallel_attention(q, k, v, context_parallel_inputs(ctx, comm, local_docs))
    out.backward(split(dout))
    full = lambda t: gather_sequence(t.detach(), ctx.cp_group, dim=2).float().cpu()  # noqa: E731
    torch.backends.cuda.enable_cudnn_sdp(True)
    return full(out), full(q.grad), full(k.grad), full(v.grad)


def _worker(rank: int, world: int) -> list:
    device = rank_device(rank)
    ctx = build_groups(1, world, 1, 1, device)
    return [_case(ctx, *case, device) for case in CASES]


def _reference(batch: int, documents: bool):
    """fp32 attention of the same bf16 inputs on one GPU."""
    device = torch.device("cuda", 0)
    (q, k, v, dout), docs = _inputs(batch, documents, device)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    mask = attention_mask_from_documents(docs) if docs is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    out.backward(dout.float())
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


def test_cp_attention_over_nccl_matches_one_gpu():
    results = run_distributed(_worker, 2, backend="nccl", timeout=300)
    for i, (kernel, comm, documents, batch) in enumerate(CASES):
        ref = _reference(batch, documents)
        for rank in range(2):
            for name, got, want in zip(("out", "dq", "dk", "dv"), results[rank][i], ref):
                # bf16 inputs and outputs: compare relative to the tensor's norm
                err = ((got - want).norm() / want.norm()).item()
                assert err < 1e-2, f"{kernel} {comm} documents={documents} rank {rank} {name}: relative error {err:.2e}"
