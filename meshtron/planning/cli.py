"""``meshtron plan``: what chosen ranks of a layout would hold, without GPUs or process groups.

``meshtron plan --model PRESET --gpus N ...`` searches layouts (:mod:`meshtron.planning.search_cli`);
``meshtron plan --calibrate --out FILE`` measures a device profile (:mod:`meshtron.planning.calibrate`).

``meshtron plan --dry-run [meshtron train flags] --world-size N [--ranks 0,last] [--json]`` builds the
model stage of each chosen global rank on the meta device and prints its exact static memory
(:mod:`meshtron.planning.static_memory`: parameters, gradient buffer, optimizer state on device and
host, flat weight buffer, model buffers), then the activation estimate of its pipeline stage from
:mod:`meshtron.memory` and their sum. ``meshtron train --dry-run ...`` prints the same for the run it
was given and exits 0.

The plan is for GPUs: without ``--device`` it assumes ``--device cuda`` (bf16 and compiled layers,
the GPU defaults), whether or not this machine has one.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Optional, Sequence

from meshtron.config import MeshtronConfig
from meshtron.errors import ConfigError
from meshtron.validation import check, check_cuda_graphs, resolve

GIB = 2**30


def validate_for_plan(cfg: MeshtronConfig, world_size: int) -> MeshtronConfig:
    """Resolve and check ``cfg`` for ``world_size`` GPUs that this machine need not have.

    The checks run on a copy that says ``--device cpu`` where the configuration says cuda: the only
    rules that differ are the ones asking for CUDA on this machine, and the flags that need it.
    """
    if cfg.train.device is None:
        cfg.train.device = "cuda"
    resolve(cfg, world_size)
    probe = copy.deepcopy(cfg)
    if probe.train.device == "cuda":
        probe.train.device = "cpu"
        probe.parallel.async_tensor_parallel = False
        probe.log.record_memory_history = False
        probe.train.enable_cuda_graph = False  # checked below on the configuration itself
        if probe.parallel.distributed_backend == "nccl":
            probe.parallel.distributed_backend = "gloo"
    check(probe, world_size)
    check_cuda_graphs(cfg)
    return cfg


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
    rows = []
    for rank in ranks:
        static = rank_memory(cfg, vocab, world_size, rank)
        stage = stages[static.coordinates["pp"]]
        row = static.as_dict()
        row.update(activations=stage.activations, logits=stage.logits,
                   microbatches_in_flight=stage.microbatches_in_flight,
                   estimated_peak=static.device_total + static.pipeline_message + stage.activations + stage.logits)
        rows.append(row)
    return rows


def _gib(n: float) -> str:
    return f"{n / GIB:10.2f} GiB"


def format_row(row: dict) -> str:
    """A small human table of one rank's plan."""
    c, opt = row["coordinates"], row["optimizer"]
    flat = row["param_buffer_numel"]
    lines = [f"rank {row['rank']} (tp {c['tp']}, cp {c['cp']}, dp {c['dp']}, pp {c['pp']}, ep {c['ep']})",
             f"  parameters        {row['parameters']:>16,} (experts {row['expert_parameters']:,})",
             f"  weights         {_gib(row['weights'])}" + (f"  flat buffer of {flat:,} elements" if flat else ""),
             f"  gradients       {_gib(row['gradients'])}  buffer of {row['grad_buffer_numel']:,} elements "
             f"({row['padding_numel']:,} padding) in {row['buckets']} buckets",
             f"  optimizer state {_gib(opt['device_bytes'])}  on the device, {opt['host_bytes'] / GIB:.2f} GiB on "
             f"the host (masters and moments of {opt['master_numel']:,} elements)",
             f"  model buffers   {_gib(row['model_buffers'])}",
             f"  static total    {_gib(row['device_total'])}  (exact)"]
    if row["pipeline_message"]:
        lines.append(f"  pipeline message{_gib(row['pipeline_message'])}  per transfer")
    lines += [f"  activations     {_gib(row['activations'])}  (estimate; micro-batches in flight: "
              f"{row['microbatches_in_flight']:g})",
              f"  loss            {_gib(row['logits'])}  (estimate)",
              f"  estimated peak  {_gib(row['estimated_peak'])}"]
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
          f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size}"
          + (", distributed optimizer" if p.use_distributed_optimizer else "")
          + (f", {'bf16' if cfg.train.bf16 else 'fp32'}"))
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
