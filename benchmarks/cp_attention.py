"""Context-parallel attention alone: ring (p2p) versus all-gather, against one GPU's full attention.

Run with ``torchrun --nproc-per-node CP benchmarks/cp_attention.py [--seq 32768,65536]``
(GPUs: bf16, the fused kernels; CPU: ``--device cpu``, fp32, gloo, the math kernel).
Prints one row per (sequence length, comm type): forward+backward time per layer,
achieved attention TFLOP/s per GPU (causal: half of 4 S^2 heads d per forward, backward
2.5 x forward), and peak memory, plus the one-device time of the same full sequence.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.parallel.context_parallel.attention import COMM_TYPES, context_parallel_attention, context_parallel_inputs
from meshtron.parallel.context import build_groups


def _timed(fn, warmup: int, steps: int, device: torch.device, together: bool = True) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if together:  # every rank starts the timed steps at once
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def _tensors(batch, heads, groups, seq, dim, device, dtype):
    q = torch.randn(batch, seq, heads, dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, groups, dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(batch, seq, groups, dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="16384,32768,65536,131072", help="comma-separated full sequence lengths")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    cp = dist.get_world_size()
    ctx = build_groups(1, cp, 1, 1, device)
    dtype = torch.bfloat16 if cuda else torch.float32
    h, g, d, b = args.heads, args.groups, args.head_dim, args.batch
    if ctx.rank == 0:
        print(f"CP={cp} heads={h} groups={g} head_dim={d} batch={b} {dtype} on {device.type}")
        print(f"{'seq':>8} {'comm':>10} {'ms/layer':>10} {'TFLOP/s/GPU':>12} {'peak GiB':>9}")
    for seq in (int(s) for s in args.seq.split(",")):
        flops = 3.5 * 2 * b * h * d * seq * seq  # causal forward = 2 b h d S^2; forward + backward = 3.5 x
        for comm in COMM_TYPES:
            q, k, v = _tensors(b, h, g, seq // cp, d, device, dtype)
            inputs = context_parallel_inputs(ctx, comm)
            grad = torch.randn_like(q)

            def step():
                out = context_parallel_attention(q, k, v, inputs)
                out.backward(grad)

            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = _timed(step, args.warmup, args.steps, device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
            if ctx.rank == 0:
                print(f"{seq:>8} {comm:>10} {t * 1e3:>10.2f} {flops / cp / t / 1e12:>12.1f} {peak:>9.2f}", flush=True)
            del q, k, v, grad
        if ctx.rank == 0:  # the same sequence on one device, fused SDPA
            q, k, v = _tensors(b, h, g, seq, d, device, dtype)
            grad = torch.randn_like(q)

            def full():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = _timed(full, args.warmup, args.steps, device, together=False)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
            print(f"{seq:>8} {'1 device':>10} {t * 1e3:>10.2f} {flops / t / 1e12:>12.1f} {peak:>9.2f}", flush=True)
            del q, k, v, grad
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
