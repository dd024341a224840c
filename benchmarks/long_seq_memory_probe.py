"""Where the peak of a long-sequence step with full recomputation comes from (one GPU; diagnostics).

Two measurements of one configuration (default: llama3-1b, micro batch 1, full uniform recomputation of
one layer per chunk, the GPU defaults: bf16, compiled layers, SDPA flash/cuDNN attention, fused loss):

1. ``step``: a training step (after a warm-up step that compiles) under the allocator's history. Prints the
   peak (``torch.cuda.max_memory_allocated``), what was allocated when the step began, the phase of the peak
   (forward or backward, from the allocating stack) and the largest blocks alive at the peak, each with its
   allocating frame and that frame's source line (inductor's generated code is read while it still exists).
2. ``layer``: one of the run's compiled layers, forward and backward at the same sequence, with and without
   its recomputation: bytes kept after the forward, and the backward's peak above what was live before it,
   per token. ``meshtron.memory`` models the kept bytes as ``layer_activation_bytes`` and the recomputed
   layer's backward as its full activations plus the gradients it works on (``backward_working_bytes``).

Usage (on the GPU machine, repository root, ``PYTHONPATH=$PWD``)::

    python3 benchmarks/long_seq_memory_probe.py --seq 131072 [--out DIR] [-- more meshtron train flags]

Prints a table and writes ``probe_<seq>.json`` to ``--out`` (default: $OUT or the working directory).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys

import torch

from meshtron.memory_report import trace_peak

GIB = 2**30
_FREES = ("free_requested", "free_completed")


def _config(model: str, seq: int, extra: list[str]):
    from meshtron.cli import build_config
    from meshtron.validation import validate_config

    flags = ["--mock-data", "--eval-interval", "0", "--model", model, "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    cfg = build_config(flags + extra)
    validate_config(cfg, 1)
    return cfg


def _frame_text(frame: dict) -> str:
    name = frame.get("filename", "?")
    line = frame.get("line", 0)
    source = linecache.getline(name, line).strip() if line else ""
    return f"{name.rsplit('/', 2)[-1]}:{line} {frame.get('name', '?')}: {source[:140]}"


def _blocks_at_peak(trace: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak bytes above the recording's start, index of the peak event, blocks alive then, largest first)."""
    peak, peak_index = trace_peak(trace)
    alive: dict[int, dict] = {}
    for event in trace[: peak_index + 1]:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            alive[addr] = event
        elif action in _FREES:
            alive.pop(addr, None)
    blocks = sorted(alive.values(), key=lambda e: -e["size"])
    return peak, peak_index, blocks


def _in_backward(frames: list[dict]) -> bool:
    return any("backward" in f.get("name", "") or "backward" in f.get("filename", "") for f in frames)


def probe_step(trainer, data, tokens: int) -> dict:
    """Peak of the second step, the blocks alive at it, and the phase it falls in."""
    batches = next(data.train_batches())
    trainer.train_step(batches, 1)  # compiles
    torch.cuda.synchronize()
    first_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=1_000_000)
    trainer.train_step(batches, 2)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    rise, index, blocks = _blocks_at_peak(trace)
    frames = trace[index].get("frames", []) if index >= 0 else []
    rows = [{"gib": b["size"] / GIB, "bytes_per_token": b["size"] / tokens,
             "where": [_frame_text(f) for f in b.get("frames", [])[:3]],
             "backward": _in_backward(b.get("frames", []))} for b in blocks[:30]]
    return {"first_step_peak_gib": first_peak / GIB, "peak_gib": peak / GIB, "allocated_at_start_gib": start / GIB,
            "replayed_rise_gib": rise / GIB, "peak_in_backward": _in_backward(frames),
            "peak_event": [_frame_text(f) for f in frames[:4]], "blocks": rows}


def probe_layer(trainer, cfg, tokens: int) -> dict:
    """One compiled layer's kept bytes and backward working set, with and without full recomputation."""
    chunk = trainer.model_chunks[0]
    layer = next(iter(chunk.layers.values()))
    m = cfg.model
    dtype = torch.bfloat16
    out: dict = {}
    for mode in ("full", None):
        layer.recompute = mode
        x = torch.randn(cfg.model.seq_length, 1, m.hidden_size, device="cuda", dtype=dtype, requires_grad=True)
        rope = chunk._rope(cfg.model.seq_length, None, x.device, dtype)
        for attempt in range(2):  # the first call compiles
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = layer(x, rope, None)
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before  # the output and what the layer saved
            forward_peak = torch.cuda.max_memory_allocated() - before
            grad = torch.randn_like(y)
            torch.cuda.synchronize()
            before_backward = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y.backward(grad)
            torch.cuda.synchronize()
            backward_peak = torch.cuda.max_memory_allocated() - before_backward
            del y, grad
            x.grad = None
            for p in layer.parameters():
                p.grad = None
        out[mode or "none"] = {
            "kept_bytes_per_token": kept / tokens, "forward_peak_bytes_per_token": forward_peak / tokens,
            "backward_rise_bytes_per_token": backward_peak / tokens,
            "backward_rise_gib": backward_peak / GIB}
    layer.recompute = "full"
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--model", default="llama3-1b")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-layer", action="store_true", help="only the training step")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    from meshtron.bench import RandomTokens
    from meshtron.memory import estimate_memory
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    cfg = _config(args.model, args.seq, extra)
    ctx = context_from_config(cfg)
    data = RandomTokens(cfg.model.vocab_size, cfg.model.seq_length, 1, 1, cfg.train.seed)
    trainer = Trainer(cfg, ctx, data=data)
    tokens = args.seq
    est = estimate_memory(cfg, cfg.model.vocab_size, world_size=1)
    result = {"model": args.model, "seq": args.seq, "flags": extra, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "estimate_gib": {k: v / GIB for k, v in est.as_dict().items()
                                                           if k not in ("stage", "microbatches_in_flight")}}
    result["step"] = probe_step(trainer, data, tokens)
    if not args.skip_layer:
        result["layer"] = probe_layer(trainer, cfg, tokens)
    step = result["step"]
    print(f"{args.model} seq {args.seq} on {result['device']}: peak {step['peak_gib']:.2f} GiB (first step "
          f"{step['first_step_peak_gib']:.2f}), estimate {result['estimate_gib']['total']:.2f} GiB, allocated at "
          f"the step's start {step['allocated_at_start_gib']:.2f} GiB; peak in backward: {step['peak_in_backward']}")
    print("  peak event:", *step["peak_event"], sep="\n    ")
    for b in step["blocks"][:20]:
        print(f"  {b['gib']:7.3f} GiB {b['bytes_per_token']:9.0f} B/token {'bwd' if b['backward'] else 'fwd'} "
              f"{b['where'][0] if b['where'] else '?'}")
    for mode, row in result.get("layer", {}).items():
        print(f"  layer (recompute {mode}): kept {row['kept_bytes_per_token']:.0f} B/token, backward rise "
              f"{row['backward_rise_bytes_per_token']:.0f} B/token ({row['backward_rise_gib']:.2f} GiB)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"probe_{args.seq}.json"), "w") as f:
        json.dump(result, f, indent=1)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
