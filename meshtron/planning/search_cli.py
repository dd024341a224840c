"""``meshtron plan --model PRESET --gpus N [--gpus-per-node 8] [--gpu H100|H200|B200 | --profile FILE]
--seq-length S --global-batch-size G [--json] [--top K] [--headroom 0.1] [--no-fp8] [--compare TP=4,PP=4]``.

Runs :func:`meshtron.planning.search.search` and prints the fastest layouts that fit: memory per GPU,
tokens/s/GPU, MFU, pipeline bubble, exposed communication and the ``meshtron train`` command line of
each (one JSON object per layout with ``--json``). The flags a layout sets (parallel sizes, schedule,
sharding strategy, recomputation, offloading, FP8: :data:`LAYOUT_FLAGS`) are refused; any other
``meshtron train`` flag given is kept in the base configuration and in the printed command lines.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

from meshtron.errors import ConfigError

_COMPARE_KEYS = {"TP": "tp", "CP": "cp", "PP": "pp", "EP": "ep", "VPP": "vpp", "DP": "dp"}

#: The flags each layout of the search sets itself (meshtron.planning.search.Layout.flags): given to the search as
#: well, they would stay in the printed commands of layouts that chose otherwise.
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--context-parallel-size", "--pipeline-model-parallel-size",
                "--expert-model-parallel-size", "--virtual-pipeline-model-parallel-size",
                "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
                "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--sequence-parallel",
                "--async-tensor-parallel", "--pipeline-schedule", "--data-parallel-sharding-strategy",
                "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2",
                "--recompute-granularity", "--recompute-activations", "--offload-activations",
                "--fine-grained-activation-offloading", "--fp8-format", "--fp8-hybrid")


def check_no_layout_flags(train_argv: Sequence[str]) -> None:
    """Refuse the flags the search chooses per layout (ConfigError naming them and what to do instead)."""
    given = []
    for token in train_argv:
        name = token.split("=", 1)[0]
        plain = "--" + name[len("--no-"):] if name.startswith("--no-") else name
        if plain in LAYOUT_FLAGS and name not in given:
            given.append(name)
    if given:
        raise ConfigError(f"meshtron plan chooses {', '.join(given)} for each layout itself: leave "
                          f"{'it' if len(given) == 1 else 'them'} out (each printed command carries its layout's); "
                          "--compare TP=4,PP=4 also ranks the best layout of given sizes, --no-fp8 leaves FP8 out")


def parse_compare(text: str) -> dict:
    """``"TP=4,PP=4"`` -> ``{"tp": 4, "pp": 4}``; ConfigError naming --compare otherwise."""
    fixed = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key.upper() not in _COMPARE_KEYS or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--compare {text!r}: expected sizes like TP=4,PP=4 (keys {', '.join(_COMPARE_KEYS)})")
        fixed[_COMPARE_KEYS[key.upper()]] = int(value)
    return fixed


def search_main(args: argparse.Namespace, train_argv: Sequence[str]) -> int:
    """The search mode of ``meshtron plan``; returns the exit code."""
    from meshtron.cli import build_config
    from meshtron.planning.profiles import choose_profile
    from meshtron.planning.search import SearchSpace, format_plans, search

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {args.gpus}")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    check_no_layout_flags(train_argv)
    base = build_config(list(train_argv))
    if not base.model.model:
        raise ConfigError("--model PRESET is needed to search layouts (e.g. --model llama3-8b)")
    if not base.train.global_batch_size:
        raise ConfigError("--global-batch-size is needed to search layouts (micro batches and DP must divide it)")
    if not base.model.vocab_size:
        raise ConfigError("--vocab-size is needed to plan (the tokenizer is not read by meshtron plan)")
    profile = choose_profile(args.gpu, args.profile)
    space = SearchSpace(allow_fp8=args.fp8)
    start = time.perf_counter()
    plans, considered, fitting = search(base, list(train_argv), args.gpus, profile, args.gpus_per_node,
                                        args.headroom, args.top, space)
    compared = []
    if args.compare:
        fixed = parse_compare(args.compare)
        compared, _, _ = search(base, list(train_argv), args.gpus, profile, args.gpus_per_node, args.headroom, 1,
                                SearchSpace(allow_fp8=args.fp8, fixed=fixed))
    elapsed = time.perf_counter() - start
    if args.json:
        for rank, plan in enumerate(plans, 1):
            print(json.dumps({"rank": rank, **plan.as_dict()}))
        for plan in compared:
            print(json.dumps({"rank": "compare", **plan.as_dict()}))
        return 0
    print(f"meshtron plan: {base.model.model} on {args.gpus} x {profile.name} ({args.gpus_per_node} per node), "
          f"seq {base.model.seq_length}, global batch {base.train.global_batch_size}: {considered} layouts, "
          f"{fitting} fit, {elapsed:.1f} s")
    if not plans:
        print("no layout fits: more GPUs, a shorter sequence, or less --headroom")
        return 1
    print(format_plans(plans, profile, args.headroom))
    if getattr(args, "emulate", 0):
        print(emulate_plans(plans[:args.emulate], args.gpus, args.gpus_per_node, profile,
                            args.measure_micro_batches))
    if args.compare:
        if not compared:
            print(f"--compare {args.compare}: no layout with these sizes fits")
        else:
            c = compared[0]
            ratio = c.tokens_per_sec_per_gpu / plans[0].tokens_per_sec_per_gpu
            print(f"compare {args.compare}: best is {c.layout.describe()}, {c.memory_bytes / 2**30:.1f} GiB, "
                  f"{c.tokens_per_sec_per_gpu:,.0f} tok/s/GPU ({ratio:.1%} of the first choice)\n   "
                  + " ".join(c.command))
    return 0


def emulate_plans(plans: Sequence, gpus: int, gpus_per_node: int, profile, measure_micro_batches: int) -> str:
    """Each plan's pipeline stages emulated on this device (:mod:`meshtron.emulation`), beside the planner's figures:
    memory (the planner's estimate against the allocator's measured peak of the fullest stage) and step time."""
    from meshtron.emulation.cli import report_row
    from meshtron.emulation.runner import default_ranks, emulate_rank

    lines = ["", "planner against emulation (memory: the fullest stage; step: the slowest stage's prediction)",
             "| # | layout | planner GiB | emulated peak GiB | diff | planner tok/s/GPU | emulated tok/s/GPU | diff |",
             "|---|---|---|---|---|---|---|---|"]
    for index, plan in enumerate(plans, 1):
        argv = plan.command[2:]  # without "meshtron train"
        argv = argv[:argv.index("--nproc-per-node")] if "--nproc-per-node" in argv else argv
        rows = []
        for rank in default_ranks(gpus, plan.layout.tp, plan.layout.cp, plan.layout.pp):
            try:
                emulated = emulate_rank(argv, gpus, rank, gpus_per_node, 1, 2, None, measure_micro_batches)
            except Exception as err:  # noqa: BLE001 - an out-of-memory stage is an answer, reported in the table
                rows = [f"rank {rank}: {' '.join(str(err).split())[:120]}"]
                break
            rows.append(report_row(emulated, argv, gpus, gpus_per_node, profile))
        if rows and isinstance(rows[0], str):
            lines.append(f"| {index} | {plan.layout.describe()} | {plan.memory_bytes / 2**30:.1f} | {rows[0]} |")
            continue
        peaks = [r["measured"]["peak_mem_gib"] or r["planner"]["est_mem_gib"] for r in rows]
        speed = min(r["predicted"]["tokens_per_sec_per_gpu"] for r in rows)
        planned_gib = plan.memory_bytes / 2**30
        peak = max(peaks)
        memory_diff = f"{planned_gib / peak - 1:+.1%}" if peak > 0 else "-"
        lines.append(f"| {index} | {plan.layout.describe()} | {planned_gib:.2f} | {peak:.2f} | {memory_diff} | "
                     f"{plan.tokens_per_sec_per_gpu:,.0f} | {speed:,.0f} | "
                     f"{plan.tokens_per_sec_per_gpu / speed - 1:+.1%} |")
    lines.append("emulated: memory and compute measured on this device, communication modelled (docs/emulation.md)")
    return "\n".join(lines)
