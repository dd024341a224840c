"""FP8 under sequence parallelism (meshtron.layers.fp8.sequence_parallel) casts each sequence shard with
the scale of the gathered tensor and all-gathers FP8: outputs and gradients must equal, bit for bit, a
plain FP8 linear on the gathered bf16 tensor with its collectives around it (the path that casts after
the all-gather). Two gloo ranks on CPU; two NCCL ranks on GPU, where the compiled layers with
--async-tensor-parallel must also fuse the FP8 all-gather and reduce-scatter with their matmuls."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.fp8 import E4M3, E5M2, fp8_linear
from meshtron.layers.fp8.sequence_parallel import column_sequence_parallel_fp8, row_sequence_parallel_fp8
from meshtron.parallel import comm
from tests.distributed.launch import rank_device, run_distributed

SEQ, BATCH, HIDDEN, FFN = 16, 2, 32, 48  # FFN is this rank's shard of the column outputs / row inputs


def _inputs(rank: int, world: int, device: torch.device):
    """The full input, this rank's weights and bias, and upstream gradients (same on every rank where full)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 3
    w1 = torch.randn(world, FFN, HIDDEN, generator=g) * 0.2
    b1 = torch.randn(world, FFN, generator=g)
    w2 = torch.randn(world, HIDDEN, FFN, generator=g) * 0.2
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x[3, 1, 5] = 40.0  # the gathered maximum lies on rank 0's shard: rank 1 must take it as well
    cast = dict(device=device, dtype=torch.bfloat16)
    return x.to(**cast), w1[rank].to(**cast), b1[rank].to(**cast), w2[rank].to(**cast), grad.to(**cast)


def _mlp(x_shard, w1, b1, w2, group, grad_dtype, fused: bool):
    """Column layer -> GELU -> row layer on this rank's shard of the sequence."""
    if fused:
        h = column_sequence_parallel_fp8(x_shard, w1, b1, group, grad_dtype)
        return row_sequence_parallel_fp8(torch.nn.functional.gelu(h), w2, group, grad_dtype)
    fmt = "hybrid" if grad_dtype == E5M2 else "e4m3"
    h = fp8_linear(comm.gather_from_sequence(x_shard, group), w1, b1, fmt)
    return comm.reduce_scatter_to_sequence(fp8_linear(torch.nn.functional.gelu(h), w2, None, fmt), group)


def _run(x_shard, w1, b1, w2, grad_shard, group, grad_dtype, fused, compiled=False):
    leaves = [t.clone().requires_grad_() for t in (x_shard, w1, b1, w2)]
    fn = torch.compile(_mlp, fullgraph=True) if compiled else _mlp
    y = fn(*leaves, group, grad_dtype, fused)
    y.backward(grad_shard)
    return [y.detach()] + [t.grad for t in leaves]


def _worker(rank: int, world: int, device_kind: str) -> dict:
    import torch.distributed as dist

    device = rank_device(rank) if device_kind == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    x, w1, b1, w2, grad = _inputs(rank, world, device)
    x_shard, grad_shard = comm.split_dim0(x, group), comm.split_dim0(grad, group)
    diffs = {}
    for name, dtype in (("e4m3", E4M3), ("hybrid", E5M2)):
        want = _run(x_shard, w1, b1, w2, grad_shard, group, dtype, fused=False)
        got = _run(x_shard, w1, b1, w2, grad_shard, group, dtype, fused=True)
        for label, a, b in zip(("y", "x", "w1", "b1", "w2"), got, want):
            diffs[f"{name} {label}"] = (a.float() - b.float()).abs().max().item()
    if device_kind == "cuda":  # compiled, with the FP8 collectives fused into their matmuls
        from torch._inductor.utils import run_and_get_code

        # The fused collective matmuls use symmetric memory across devices: with ranks sharing one GPU (the
        # staged group) the compiled layers run without them.
        async_tp = torch.cuda.device_count() >= world
        comm.set_micro_pipelined_tp(async_tp, group)
        try:
            want = _run(x_shard, w1, b1, w2, grad_shard, group, E4M3, fused=True)
            got, code = run_and_get_code(_run, x_shard, w1, b1, w2, grad_shard, group, E4M3, True, True)
        finally:
            comm.set_micro_pipelined_tp(False, group)
        code = "\n".join(code)
        if async_tp:
            diffs["fused ops"] = [op for op in ("fused_all_gather_scaled_matmul", "fused_scaled_matmul_reduce_scatter")
                                  if op not in code]
        for label, a, b in zip(("y", "x", "w1", "b1", "w2"), got, want):
            diffs[f"compiled {label}"] = ((a.float() - b.float()).norm() / b.float().norm()).item()
    return diffs


def _check(results: list[dict]) -> None:
    for rank, diffs in enumerate(results):
        missing = diffs.pop("fused ops", [])
        assert not missing, f"rank {rank}: the compiled graph lacks {missing}"
        for key, diff in diffs.items():
            # Eager: bit-identical. Compiled: the compiler's GELU rounds differently in bf16, which flips
            # some FP8 roundings downstream (measured 4e-3 relative in the output on two H200s); a wrong
            # scale or token order is off by tens of percent.
            tol = 2e-2 if key.startswith("compiled") else 0.0
            assert diff <= tol, (rank, key, diff)


def test_cast_before_gather_equals_cast_after_gather_on_gloo():
    _check(run_distributed(_worker, 2, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")
def test_cast_before_gather_over_nccl_and_fused_by_async_tp():
    _check(run_distributed(_worker, 2, "cuda", backend="nccl", timeout=600))
