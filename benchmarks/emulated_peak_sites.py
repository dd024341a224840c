"""Where an emulated rank's GPU memory peaks: run ``steps`` training steps of one emulated rank with the
allocator's history on, then print the peak, the stack of the allocation that reached it, and the live blocks
at that moment grouped by allocation site (meshtron.memory_report) and by kind (weights, gradient buffer,
optimizer state, activations/other), beside meshtron's memory model of that stage.

    PEAK_STEPS=N python benchmarks/emulated_peak_sites.py WORLD RANK [train flags...]   (on a GPU; 3 steps by default)
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _kind(frames: list[dict]) -> str:
    names = " ".join(f.get("filename", "") + ":" + f.get("name", "") for f in frames)
    for key, kind in (("grad_buffer.py", "gradient buffer"), ("sharded_grads.py", "gradient shards"),
                      ("param_buffer.py", "weights"), ("initialize_parameters", "weights"),
                      ("optimizer.py", "optimizer state"), ("distributed_optimizer.py", "optimizer state"),
                      ("fused_adamw.py", "optimizer state"), ("cross_entropy.py", "loss")):
        if key in names:
            return kind
    if "autograd/__init__.py:backward" in names or "_tensor.py:backward" in names:
        return "backward"
    return "forward/other"


def main() -> int:
    import torch

    from meshtron.bench import RandomTokens
    from meshtron.emulation.runner import _config, _enter_world, _leave_world, hold_optimizer_state
    from meshtron.memory import stage_estimates
    from meshtron.memory_report import allocation_site, trace_peak
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    world, rank, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    steps = int(os.environ.get("PEAK_STEPS", "3"))  # the optimizer's state is made at the end of the first
    _enter_world(world, rank)
    try:
        cfg = _config(argv, world, steps)
        ctx = context_from_config(cfg)
        t = cfg.train
        n_micro = t.global_batch_size // (t.micro_batch_size * ctx.dp)
        data = RandomTokens(cfg.model.vocab_size or 32000, cfg.model.seq_length, t.micro_batch_size, n_micro, t.seed)
        # PEAK_CONTEXT=none records the events without their stacks (the live blocks then by size only)
        context = os.environ.get("PEAK_CONTEXT", "all")
        torch.cuda.memory._record_memory_history("all", context=None if context == "none" else context,
                                                  stacks="python", max_entries=3_000_000)
        trainer = Trainer(cfg, ctx, data=data)
        hold_optimizer_state(trainer)  # as meshtron emulate does: the moments are made though steps may be skipped
        batches = next(data.train_batches())
        for it in range(1, steps + 1):
            start = time.perf_counter()
            trainer.train_step(batches, it)
            torch.cuda.synchronize()
            print(f"step {it}: max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
                  f"{time.perf_counter() - start:.1f} s (allocator history on)", flush=True)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        events = snap["device_traces"][torch.cuda.current_device()]
        peak, index = trace_peak(events)
        print(f"peak in the trace {peak / 2**30:.2f} GiB (event {index} of {len(events)}); allocator peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        frames = [f for f in events[index].get("frames", []) if "meshtron/" in f.get("filename", "")
                  or "autograd" in f.get("filename", "")]
        print("the peak allocation:", events[index]["size"] / 2**20, "MiB at")
        for f in frames[:14]:
            print(f"    {f['filename'].split('/')[-2:]}:{f['line']} {f['name']}")
        alive: dict[int, tuple[int, str, str]] = {}
        for event in events[: index + 1]:
            action, addr = event.get("action"), event.get("addr")
            if action == "alloc":
                fr = event.get("frames", [])
                alive[addr] = (event["size"], allocation_site(fr), _kind(fr))
            elif action in ("free_requested", "free_completed"):
                alive.pop(addr, None)
        by_site, by_kind, by_size = defaultdict(int), defaultdict(int), defaultdict(int)
        for size, site, kind in alive.values():
            by_site[site] += size
            by_kind[kind] += size
            by_size[size] += 1
        print("live blocks at the peak by size (MiB x count):",
              ", ".join(f"{size / 2**20:.0f} x {n}" for size, n in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:20]))
        for kind, size in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<18} {size / 2**30:8.3f} GiB")
        for site, size in sorted(by_site.items(), key=lambda kv: -kv[1])[:25]:
            print(f"      {site:<70} {size / 2**30:8.3f} GiB")
        est = stage_estimates(cfg, cfg.model.vocab_size, world_size=world)[ctx.pp_rank]
        print("model:", {k: round(v / 2**30, 3) if isinstance(v, int) else v for k, v in est.as_dict().items()})
        trainer.close()
    finally:
        _leave_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
