"""Checkpoint timing on GPUs: synchronous and asynchronous save, load, bandwidth, and training paused.

Run with one process per GPU, e.g. Llama 3.1 8B over two GPUs with tensor parallelism::

    torchrun --nproc-per-node 2 benchmarks/checkpoint_io.py --model llama3-8b --tp 2 --dir /scratch/ckpt

or on CPUs (gloo, fp32), e.g. GPT-2 124M sharded ZeRO-3 over two processes::

    torchrun --nproc-per-node 2 benchmarks/checkpoint_io.py --device cpu --model gpt2-small --seq-length 128 \
        --data-parallel-sharding-strategy optim_grads_params --async-repeats 0 --dir /tmp/ckpt

It builds the model (bf16 weights, fp32 masters and Adam moments), takes a few
training steps, then measures: a synchronous save; an asynchronous save (the time
training is paused, the step times while the write runs, the time until the
checkpoint is published); the checksums (``checksum_s``: the CPU seconds the
writer threads spent hashing during a save, the slowest rank; ``verify``: checking
the published checkpoint against its manifest, as every load does); a load with
and without that check; and the single-core speed of CRC-32, SHA-256 and BLAKE2b on
this host. Each checkpoint is deleted after it is measured, so the disk needs room
for one. Rank 0 prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.build import build_stage
from meshtron.checkpoint import finalize_async_saves, last_save_timings, load_checkpoint, save_checkpoint
from meshtron.checkpoint.coordination import checkpoint_group
from meshtron.checkpoint.verify import verify_checkpoint
from meshtron.config import MeshtronConfig
from meshtron.optim.factory import build_optimization
from meshtron.parallel.context import ParallelContext, build_parallel_context
from meshtron.parallel.sharding import initialize_parameters
from meshtron.presets import apply_preset
from meshtron.training.state import TrainingState
from meshtron.validation import validate_config


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_DEVICE = "cuda"  # where the reductions of the figures run (set from --device)


def _sync() -> None:
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def _sum(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(t)
    return float(t.item())


def _max(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def hash_speeds(nbytes: int) -> dict[str, float]:
    """GB/s of one core for each checksum a checkpoint could use, over ``nbytes`` of random bytes."""
    data = os.urandom(nbytes)
    view = memoryview(data)
    block = 16 * 2**20
    speeds = {}
    for name, update in (("crc32", None), ("sha256", hashlib.sha256), ("blake2b", hashlib.blake2b)):
        start = time.perf_counter()
        if update is None:
            crc = 0
            for i in range(0, nbytes, block):
                crc = zlib.crc32(view[i:i + block], crc)
        else:
            h = update()
            for i in range(0, nbytes, block):
                h.update(view[i:i + block])
        speeds[f"{name}_gb_per_s"] = nbytes / (time.perf_counter() - start) / 1e9
    return speeds


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_config(preset: str, tp: int, seq_length: int, distributed_optimizer: bool, world: int,
                 device: str = "cuda", sharding_strategy: str | None = None) -> MeshtronConfig:
    """The validated run configuration the benchmark trains and checkpoints (mock data; bf16 on GPUs,
    fp32 on CPUs). ``sharding_strategy``: ``--data-parallel-sharding-strategy`` (e.g. ZeRO-3)."""
    cfg = MeshtronConfig()
    apply_preset(cfg.model, preset)
    for key, value in dict(seq_length=seq_length, bf16=device == "cuda", device=device, mock_data=True,
                           tensor_model_parallel_size=tp, micro_batch_size=1,
                           use_distributed_optimizer=distributed_optimizer).items():
        cfg.set(key, value)
    if sharding_strategy is not None:
        cfg.set("data_parallel_sharding_strategy", sharding_strategy)
    validate_config(cfg, world)
    return cfg


def bench_model(cfg: MeshtronConfig, ctx: ParallelContext) -> torch.nn.Module:
    """The whole model on the meta device, built as training builds it (experts for a MoE preset)."""
    return build_stage(cfg, ctx, cfg.model.vocab_size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/checkpoint_io.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dir", required=True, help="checkpoint directory (on the file system to measure)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4, help="training steps timed with and without a save in flight")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--data-parallel-sharding-strategy", default=None,
                   help="no_shard, optim, optim_grads or optim_grads_params (ZeRO-3)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo processes, fp32")
    p.add_argument("--async-repeats", type=int, default=2, help="asynchronous saves (the first allocates buffers)")
    p.add_argument("--hash-bench-gb", type=float, default=1.0, help="bytes per checksum in the hash speed test")
    args = p.parse_args(argv)

    global _DEVICE
    _DEVICE = args.device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = bench_config(args.model, args.tp, args.seq_length, args.distributed_optimizer, world, args.device,
                       args.data_parallel_sharding_strategy)
    ctx = build_parallel_context(tp=args.tp, device=args.device)
    lead = ctx.rank == 0
    model = bench_model(cfg, ctx)
    initialize_parameters(model, cfg.train.seed, ctx.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    optim = build_optimization(cfg, ctx, [model])
    optimizer = optim.optimizer
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, args.seq_length), device=ctx.device, generator=gen)
    weight = torch.full((1, args.seq_length), 1.0 / args.seq_length, device=ctx.device)

    def train_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            optim.strategy.zero()
            total, _ = model(tokens, labels=tokens, loss_weight=weight)
            total.backward()
            optim.strategy.finish()
            optimizer.step(1e-5)
            _sync()
            times.append(time.perf_counter() - start)
        return times

    def report(record: dict) -> None:
        if lead:
            print(json.dumps(record), flush=True)

    train_steps(2)  # warm-up: kernels, allocator, optimizer state
    baseline = train_steps(args.steps)
    state = TrainingState(iteration=10, consumed_samples=10)
    save_dir = Path(args.dir)
    env = {"model": args.model, "tp": args.tp, "world": world, "distributed_optimizer": args.distributed_optimizer,
           "sharding_strategy": optim.strategy.name, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"}
    report({"event": "setup", **env, "step_time_s": sum(baseline) / len(baseline)})
    if lead:
        report({"event": "hash_speed", **hash_speeds(int(args.hash_bench_gb * 1e9))})

    def published_bytes() -> float:
        size = _dir_bytes(save_dir / "iter_0000010") if lead else 0
        return _sum(size)

    def clean() -> None:
        _barrier()
        if lead and save_dir.exists():
            shutil.rmtree(save_dir)
        _barrier()

    clean()
    _barrier()
    start = time.perf_counter()
    save_checkpoint(str(save_dir), state, [model], optimizer, ctx, cfg)
    _barrier()
    elapsed = time.perf_counter() - start
    size = published_bytes()
    report({"event": "save_sync", "seconds": elapsed, "bytes": size, "gb_per_s": size / elapsed / 1e9,
            "checksum_s": _max(last_save_timings().get("checksum_s", 0.0))})

    # What every load adds: reading and hashing the whole checkpoint, spread over the ranks.
    _barrier()
    start = time.perf_counter()
    verify_checkpoint(save_dir / "iter_0000010", checkpoint_group(ctx))
    _barrier()
    elapsed = time.perf_counter() - start
    report({"event": "verify", "seconds": elapsed, "bytes": size, "gb_per_s": size / elapsed / 1e9,
            "note": "files just written: partly from the page cache"})

    for repeat in range(args.async_repeats):
        clean()
        start = time.perf_counter()
        save_checkpoint(str(save_dir), state, [model], optimizer, ctx, cfg, async_save=True)
        paused = time.perf_counter() - start
        during = train_steps(args.steps)
        finalize_async_saves()
        _barrier()
        elapsed = time.perf_counter() - start
        timings = last_save_timings()
        size = published_bytes()
        report({"event": "save_async", "repeat": repeat, "training_paused_s": paused, "seconds_to_publish": elapsed,
                "write_s": timings.get("total_s"), "bytes": size, "gb_per_s": size / timings.get("total_s", elapsed) / 1e9,
                "checksum_s": _max(timings.get("checksum_s", 0.0)),
                "step_time_during_write_s": sum(during) / len(during),
                "step_time_baseline_s": sum(baseline) / len(baseline)})

    for verify in (False, True):
        _barrier()
        start = time.perf_counter()
        loaded = load_checkpoint(str(save_dir), [model], optimizer, ctx, cfg, verify=verify)
        _sync()
        _barrier()
        elapsed = time.perf_counter() - start
        size = published_bytes()
        report({"event": "load", "verify": verify, "seconds": elapsed, "bytes": size,
                "gb_per_s": size / elapsed / 1e9, "iteration": loaded.iteration})
    clean()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
