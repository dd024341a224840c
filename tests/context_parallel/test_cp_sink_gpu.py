"""Context-parallel attention with sinks on the GPU, in bf16: the fused per-block kernels (cuDNN without a mask,
flex attention with the block mask of the window and documents) under ``p2p`` and ``allgather``, and the compiled
flex sink kernel after the ``a2a`` exchange, against fp32 attention with sinks on one GPU (output and the gradients
of q, k, v and the sinks). Two ranks over NCCL, or on one GPU through the staged group."""

from __future__ import annotations

import pytest
import torch

from meshtron.parallel.context import build_groups
from meshtron.parallel.context_parallel.attention import context_parallel_attention, context_parallel_inputs
from meshtron.parallel.context_parallel.split import gather_sequence, split_sequence
from tests.distributed.launch import rank_device, run_distributed
from tests.layers.test_sink_attention import allowed_pairs, dense_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (ranks share one GPU where there are fewer)")]

B, SEQ, HEADS, GROUPS, DIM = 2, 2048, 8, 2, 64
# (comm type, window, documents): the window (128, and 600 > a chunk of 512) crosses chunk and rank boundaries
CASES = [("p2p", None, False), ("p2p", 128, False), ("allgather", None, False), ("allgather", 600, True),
         ("a2a", 128, True), ("a2a", None, False)]


def _inputs(documents: bool, device):
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(B, n, SEQ, DIM, generator=g) for n in (HEADS, GROUPS, GROUPS, HEADS))
    sinks = torch.randn(HEADS, generator=g)
    docs = None
    if documents:
        starts = (torch.rand(B, SEQ, generator=g) < 0.002).int()
        starts[:, 0] = 0
        docs = starts.cumsum(1).int().to(device)
    return [t.to(device, torch.bfloat16) for t in (q, k, v, dout)], sinks.to(device), docs


def _case(ctx, comm: str, window, documents: bool, device):
    (q, k, v, dout), sinks, docs = _inputs(documents, device)
    split = lambda t: split_sequence(t, ctx.cp, ctx.cp_rank, dim=2)  # noqa: E731
    q, k, v = (split(t).clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_()
    local_docs = None if docs is None else split_sequence(docs, ctx.cp, ctx.cp_rank, dim=1)
    out = context_parallel_attention(q, k, v, context_parallel_inputs(ctx, comm, local_docs), sinks=sinks,
                                     window=window)
    out.backward(split(dout))
    full = lambda t: gather_sequence(t.detach(), ctx.cp_group, dim=2).float().cpu()  # noqa: E731
    dsinks = sinks.grad.clone()
    torch.distributed.all_reduce(dsinks, group=ctx.cp_group)
    return full(out), full(q.grad), full(k.grad), full(v.grad), dsinks.cpu()


def _worker(rank: int, world: int) -> list:
    device = rank_device(rank)
    ctx = build_groups(1, world, 1, 1, device)
    return [_case(ctx, *case, device) for case in CASES]


def _reference(window, documents: bool):
    device = torch.device("cuda", 0)
    (q, k, v, dout), sinks, docs = _inputs(documents, device)
    inputs = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    out = dense_reference(*inputs, allowed_pairs(SEQ, window, None if docs is None else docs.cpu()).to(device))
    out.backward(dout.float())
    return [out.detach().cpu()] + [t.grad.cpu() for t in inputs]


def test_cp_sink_attention_on_the_gpu_matches_one_gpu():
    results = run_distributed(_worker, 2, backend="nccl", timeout=300)
    for i, (comm, window, documents) in enumerate(CASES):
        ref = _reference(window, documents)
        for rank in range(2):
            for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), results[rank][i], ref):
                err = ((got - want).norm() / want.norm()).item()  # bf16 inputs and outputs
                assert err < 1e-2, f"{comm} window={window} documents={documents} rank {rank} {name}: {err:.2e}"
