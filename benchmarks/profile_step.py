"""Profile a few training steps of one configuration; print the top CUDA kernels of rank 0.

Usage: python benchmarks/profile_step.py [train flags...]   (e.g. --model llama3-1b --micro-batch-size 8)
       torchrun --nproc-per-node 2 benchmarks/profile_step.py --tensor-model-parallel-size 2 ...
With PROFILE_TRACE=path.json set, rank 0 also writes the Chrome trace of the profiled steps (one stream
per row: where the compute stream waits, what overlaps what). PROFILE_CPU=1 records the host's operators
too (and Python calls, in the trace), to see where a host-bound step spends its host time. PROFILE_STEPS=N profiles
N steps (default 2). PROFILE_ROWS=N prints the top N kernels (default 30).
"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv):
    from meshtron.bench import RandomTokens
    from meshtron.cli import build_config
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer
    from meshtron.validation import validate_config

    cfg = build_config(["--mock-data", "--eval-interval", "0", "--train-iters", "100"] + argv)
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = context_from_config(cfg)
    t = cfg.train
    data = RandomTokens(cfg.model.vocab_size, cfg.model.seq_length, t.micro_batch_size,
                        t.global_batch_size // (t.micro_batch_size * ctx.dp), 0)
    trainer = Trainer(cfg, ctx, data=data)
    batches = next(data.train_batches())
    for i in range(4):
        trainer.train_step(batches, i + 1)
    torch.cuda.synchronize()
    host = os.environ.get("PROFILE_CPU") == "1"
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=activities, with_stack=host) as prof:
        for i in range(int(os.environ.get("PROFILE_STEPS", "2"))):
            trainer.train_step(batches, 10 + i)
        torch.cuda.synchronize()
    if ctx.rank == 0:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", "30")),
                                           max_name_column_width=110)
        print(table)
        print_categories(prof)
        if host:
            print_host_time(prof)
        if os.environ.get("PROFILE_TRACE"):
            prof.export_chrome_trace(os.environ["PROFILE_TRACE"])


def print_host_time(prof) -> None:
    """The host operators by their own CPU time: where a host-bound step spends the time between its kernel
    launches (the Chrome trace of PROFILE_TRACE shows the Python calls around them)."""
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))


#: Kernel-name fragments -> category, first match wins (matmul kernels: cuBLAS/cuBLASLt/CUTLASS names).
CATEGORIES = (("nccl", "communication"), ("fmha", "attention"), ("flash", "attention"), ("cudnn", "attention"),
              ("attn", "attention"), ("gemm", "matmul"), ("nvjet", "matmul"), ("cutlass", "matmul"),
              ("triton_red", "triton reduction"), ("triton_per", "triton reduction"),
              ("triton_poi", "triton pointwise"), ("triton", "triton other"), ("elementwise", "aten elementwise"),
              ("reduce", "aten reduction"), ("Memcpy", "copies"), ("Memset", "copies"), ("copy", "copies"))


def print_categories(prof) -> None:
    """GPU kernel time per category over the profiled steps, to see what is not matmul."""
    from torch.autograd import DeviceType

    totals: dict = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        name = e.name.lower()
        cat = next((c for frag, c in CATEGORIES if frag.lower() in name), "other")
        totals[cat] = totals.get(cat, 0.0) + (e.time_range.end - e.time_range.start)
    whole = sum(totals.values()) or 1.0
    for cat, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{cat:>20s} {us / 1e3:10.1f} ms {us / whole:7.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
