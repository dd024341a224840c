"""Measure the layouts the planner picks, beside its predictions (one launch, the GPUs of this machine).

Usage: python benchmarks/plan_check.py --top 4 --out plan_check.jsonl [--record measured.jsonl] -- <train flags>
       e.g. ... -- --model llama3-3b --seq-length 4096 --global-batch-size 8 --bf16

Runs ``meshtron plan``'s search for this machine's GPU count with the built-in H200 profile (or --profile FILE),
benches its ``--top`` layouts with ``meshtron bench``'s row runner, and prints predicted against measured
tokens/s/GPU and peak memory. Each line of ``--out`` holds both; ``--record`` appends the measured rows to the
measured-runs file as ``meshtron bench --record`` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch


def main(argv: list[str]) -> int:
    from meshtron.bench import append_record, bench_row
    from meshtron.cli import build_config
    from meshtron.planning.profiles import choose_profile
    from meshtron.planning.search import SearchSpace, search

    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--record", default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-fp8", action="store_true", help="search bf16 layouts only")
    args = parser.parse_args(argv[:split])
    train_argv = argv[split + 1:]
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    profile = choose_profile(args.gpu, args.profile)
    plans, considered, fitting = search(build_config(list(train_argv)), list(train_argv), gpus, profile,
                                        top=args.top, space=SearchSpace(allow_fp8=not args.no_fp8))
    print(f"{considered} layouts, {fitting} fit; measuring the top {len(plans)}", flush=True)
    lines = []
    for plan in plans:
        row_argv = list(train_argv) + plan.layout.flags()
        try:
            row = bench_row(row_argv, args.warmup, args.steps, False, False, False)
        except torch.OutOfMemoryError as err:
            row = {"error": "out of memory: " + " ".join(str(err).split())[:200]}
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        predicted = plan.as_dict()
        line = {"layout": plan.layout.describe(), "argv": row_argv,
                "predicted_tokens_per_sec_per_gpu": predicted["tokens_per_sec_per_gpu"],
                "predicted_mem_gib": predicted["memory_gib"],
                "measured_tokens_per_sec_per_gpu": row.get("tokens_per_sec_per_gpu"),
                "measured_peak_mem_gib": row.get("peak_mem_gib"), "error": row.get("error")}
        lines.append(line)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        if args.record and "error" not in row:
            append_record(args.record, row, row_argv)
    print("| layout | predicted tok/s | measured tok/s | error | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|")
    for line in lines:
        measured, peak = line["measured_tokens_per_sec_per_gpu"], line["measured_peak_mem_gib"]
        if measured is None:
            print(f"| {line['layout']} | {line['predicted_tokens_per_sec_per_gpu']:,.0f} | {line['error']} | | | | |")
            continue
        tok_err = line["predicted_tokens_per_sec_per_gpu"] / measured - 1
        mem_err = line["predicted_mem_gib"] / peak - 1
        print(f"| {line['layout']} | {line['predicted_tokens_per_sec_per_gpu']:,.0f} | {measured:,.0f} | "
              f"{tok_err:+.1%} | {line['predicted_mem_gib']:.1f} | {peak:.1f} | {mem_err:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
