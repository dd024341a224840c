"""``meshtron plan``: what chosen ranks of a layout would hold, without GPUs or process groups.

``meshtron plan --model PRESET --gpus N ...`` searches layouts (:mod:`meshtron.planning.search_cli`);
``meshtron plan --calibrate --out FILE`` measures a device profile (:mod:`meshtron.planning.calibrate`).

``meshtron plan --dry-run [meshtron train flags] --world-size N [--ranks 0,last] [--json]`` builds the
model stage of each chosen global rank on the meta device and prints its exact static memory
(:mod:`meshtron.planning.static_memory`: parameters, gradient buffer or shards, optimizer state on device
and host, flat weight buffer or shards, model buffers), what the sharded strategies add during a step
(ZeRO-3's gathered layers, ZeRO-2/3's gradient buckets in reduction; :mod:`meshtron.planning.transient_memory`),
then the activation estimate of its pipeline stage from :mod:`meshtron.memory` and the estimated peak: their
sum, each part at its own largest (an upper estimate), with the gradients a released buffer
(``--release-grad-buffer``) holds at the peak as :mod:`meshtron.memory` models them. ``meshtron train
--dry-run ...`` prints the same for the run it was given and exits 0.

The plan is for GPUs: without ``--device`` it assumes ``--device cuda`` (bf16 and compiled layers,
the GPU defaults), whether or not this machine has one.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from meshtron.config import MeshtronConfig
from meshtron.errors import ConfigError
from meshtron.optim.accounting import releases_gradients
from meshtron.planning.validate import validate_for_plan
from meshtron.run_layout import sharding_strategy

GIB = 2**30


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``"0,last"``, ``"first,5"``, ``"all"`` -> sorted global ranks; ConfigError naming --ranks."""
    if text.strip() == "all":
        return list(range(world_size))
    ranks = set()
    for item in text.split(","):
        item = item.strip()
        if item in ("first", "last"):
            ranks.add(0 if item == "first" else world_size - 1)
            continue
        try:
            rank = int(item)
        except ValueError:
            raise ConfigError(f"--ranks {text!r}: expected comma-separated ranks, 'first', 'last' or 'all'") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"--ranks {text!r}: rank {rank} is outside the world of {world_size} ranks "
                              f"(--world-size {world_size})")
        ranks.add(rank)
    return sorted(ranks)


def vocab_of(cfg: MeshtronConfig) -> int:
    if not cfg.model.vocab_size:
        raise ConfigError("--vocab-size is needed to plan (the tokenizer is not read by meshtron plan)")
    return cfg.model.vocab_size


def plan_rows(cfg: MeshtronConfig, world_size: int, ranks: Sequence[int]) -> list[dict]:
    """One dict per rank: its static memory, its stage's activation estimate and their sum (bytes)."""
    from meshtron.memory import stage_estimates
    from meshtron.planning.static_memory import rank_memory

    vocab = vocab_of(cfg)
    stages = stage_estimates(cfg, vocab, world_size=world_size)
    releases = releases_gradients(sharding_strategy(cfg), cfg.parallel.release_grad_buffer)
    rows = []
    for rank in ranks:
        static = rank_memory(cfg, vocab, world_size, rank)
        stage = stages[static.coordinates["pp"]]
        # A released gradient buffer is not all there at the peak (meshtron.memory says how much is).
        grads_at_peak = min(static.gradients, stage.gradients) if releases else static.gradients
        row = static.as_dict()
        row.update(activations=stage.activations, logits=stage.logits,
                   microbatches_in_flight=stage.microbatches_in_flight, gradients_at_peak=grads_at_peak,
                   estimated_peak=static.device_total - static.gradients + grads_at_peak + static.pipeline_message
                   + static.step_transients + stage.activations + stage.logits)
        rows.append(row)
    return rows


def _gib(n: float) -> str:
    return f"{n / GIB:10.2f} GiB"


#: How each --data-parallel-sharding-strategy is named in the plan's header.
STRATEGY_NAMES = {"no_shard": "no_shard (replicated)", "optim": "optim (ZeRO-1)", "optim_grads": "optim_grads (ZeRO-2)",
                  "optim_grads_params": "optim_grads_params (ZeRO-3)"}


def _weights_detail(row: dict) -> str:
    """What the weights line holds: the flat buffer, and/or this rank's shard of it."""
    flat, shard = row["param_buffer_numel"], row.get("weight_shard_numel")
    if shard is not None and flat:  # ZeRO-2: every weight, plus the shard the optimizer writes
        return f"  flat buffer of {flat:,} elements + this rank's shard of {shard:,}"
    if shard is not None:  # ZeRO-3
        return f"  this rank's shard: {shard:,} of {row['layout_numel']:,} elements"
    return f"  flat buffer of {flat:,} elements" if flat else ""


def _gradients_detail(row: dict) -> str:
    layout = (f"({row['padding_numel']:,} padding) in {row['buckets']} buckets")
    if row.get("weight_shard_numel") is not None:
        return (f"  fp32 shard of {row['grad_buffer_numel']:,} elements of a layout of {row['layout_numel']:,} "
                + layout)
    return f"  buffer of {row['grad_buffer_numel']:,} elements " + layout


def format_row(row: dict) -> str:
    """A small human table of one rank's plan."""
    c, opt = row["coordinates"], row["optimizer"]
    lines = [f"rank {row['rank']} (tp {c['tp']}, cp {c['cp']}, dp {c['dp']}, pp {c['pp']}, ep {c['ep']})",
             f"  parameters        {row['parameters']:>16,} (experts {row['expert_parameters']:,})",
             f"  weights         {_gib(row['weights'])}" + _weights_detail(row),
             f"  gradients       {_gib(row['gradients'])}" + _gradients_detail(row),
             f"  optimizer state {_gib(opt['device_bytes'])}  on the device, {opt['host_bytes'] / GIB:.2f} GiB on "
             f"the host (masters and moments of {opt['master_numel']:,} elements)",
             f"  model buffers   {_gib(row['model_buffers'])}",
             f"  static total    {_gib(row['device_total'])}  (exact)"]
    if row["pipeline_message"]:
        lines.append(f"  pipeline message{_gib(row['pipeline_message'])}  per transfer")
    if row.get("gathered_weights"):
        lines.append(f"  gathered layers {_gib(row['gathered_weights'])}  during a step (the root unit and the two "
                     "largest neighbouring layers)")
    if row.get("reduction_buckets"):
        lines.append(f"  gradient buckets{_gib(row['reduction_buckets'])}  during backward (full buckets being "
                     "filled or reduce-scattered)")
    if row.get("gradients_at_peak", row["gradients"]) != row["gradients"]:
        lines.append(f"  gradients at the peak{row['gradients_at_peak'] / GIB:6.2f} GiB  (the buffer is released "
                     "between steps; estimate)")
    lines += [f"  activations     {_gib(row['activations'])}  (estimate; micro-batches in flight: "
              f"{row['microbatches_in_flight']:g})",
              f"  loss            {_gib(row['logits'])}  (estimate)",
              f"  estimated peak  {_gib(row['estimated_peak'])}  (each part at its largest)"]
    return "\n".join(lines)


def print_plan(cfg: MeshtronConfig, world_size: int, ranks: Sequence[int], as_json: bool = False) -> None:
    rows = plan_rows(cfg, world_size, ranks)
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    p = cfg.parallel
    dp = world_size // (p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size)
    print(f"meshtron plan: {cfg.model.model or 'custom model'} on {world_size} ranks: "
          f"TP={p.tensor_model_parallel_size} CP={p.context_parallel_size} DP={dp} "
          f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size}, "
          f"{STRATEGY_NAMES[sharding_strategy(cfg)]}, {'bf16' if cfg.train.bf16 else 'fp32'}")
    for row in rows:
        print(format_row(row))


def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtron plan", allow_abbrev=False,
        description="Plan a run without GPUs. With --gpus N: search every layout of the model on N GPUs and print "
                    "the fastest that fit, with their `meshtron train` command lines. Without it (--dry-run): "
                    "static memory of chosen ranks of the layout the train flags describe (exact, from "
                    "meta-device stages) and their activation estimate. --calibrate: measure this device's "
                    "rates into a profile. Takes every `meshtron train` flag.")
    parser.add_argument("--dry-run", action="store_true",
                        help="plan the layout the train flags describe (the default without --gpus)")
    parser.add_argument("--gpus", type=int, default=None, help="search the layouts of the model on this many GPUs")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink in one node (search)")
    parser.add_argument("--gpu", default=None, help="built-in device profile: H100 (default), H200 or B200")
    parser.add_argument("--profile", default=None, metavar="FILE", help="device profile JSON (from --calibrate)")
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="fraction of device memory kept free beyond the estimate (search; default 0.1)")
    parser.add_argument("--top", type=int, default=5, help="layouts to print (search)")
    parser.add_argument("--emulate", type=int, default=0, metavar="K",
                        help="re-measure the first K layouts of the search by emulation on this device (every "
                             "pipeline stage's first rank, meshtron emulate) and print planner and emulation side "
                             "by side")
    parser.add_argument("--measure-micro-batches", type=int, default=4, metavar="M",
                        help="with --emulate: steps of M micro-batches, scaled to the job's")
    parser.add_argument("--no-fp8", dest="fp8", action="store_false", help="search bf16 layouts only")
    parser.add_argument("--compare", default=None, metavar="TP=a,PP=b,...",
                        help="also show the best layout with these sizes (TP, CP, PP, EP, VPP) and how it compares")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this device's matmul, attention, bandwidth and collective rates into a profile")
    parser.add_argument("--out", default=None, metavar="FILE", help="where --calibrate writes its profile JSON")
    parser.add_argument("--world-size", type=int, default=None,
                        help="GPUs of the run (default TP x CP x PP, i.e. DP=1)")
    parser.add_argument("--ranks", default="0,last", help="global ranks to plan: 0,5,last | first | all")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank")
    return parser


def plan_main(argv: Sequence[str]) -> int:
    """``meshtron plan``: returns the exit code (ConfigError reaches the CLI: one line, exit 2)."""
    from meshtron.cli import parse_train_args

    args, train_argv = plan_parser().parse_known_args(list(argv))
    if args.calibrate:
        from meshtron.planning.calibrate import calibrate_main

        return calibrate_main(args.out, args.json)
    if args.gpus is not None:
        from meshtron.planning.search_cli import search_main

        return search_main(args, train_argv)
    cfg = parse_train_args(train_argv).config
    p = cfg.parallel
    world = (args.world_size if args.world_size is not None
             else p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size)
    if world < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world}")
    validate_for_plan(cfg, world)
    print_plan(cfg, world, parse_ranks(args.ranks, world), args.json)
    return 0


def dry_run(cfg: MeshtronConfig, world_size: Optional[int]) -> int:
    """``meshtron train --dry-run``: the plan of rank 0 and the last rank of this run; exit code 0."""
    p = cfg.parallel
    world = world_size or p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    validate_for_plan(cfg, world)
    print_plan(cfg, world, parse_ranks("0,last", world))
    return 0
