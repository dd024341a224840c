"""Emulation against reality: re-run recorded one-GPU rows of benchmarks/measured.jsonl as emulated rank 0 of a
world of one, and compare the emulated peak memory and step time with the measured ones.

    python benchmarks/emulation_accuracy.py --device-kind nvidia-h100-x1 [--ids h146,h147] [--max-step-s 5]
        [--limit N] [--out $OUT/accuracy.jsonl]

Only rows measured on this device's kind are compared for time (the same GPU model); memory is compared for
every chosen row (the allocator's peak does not depend on the GPU's speed). For each distinct command line the
latest row counts. Two-GPU rows have no recorded command line in the file: benchmarks/emulate_user_guide.sh runs
them (cases row-*) and docs/emulation.md compares them by hand.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def chosen_rows(path: Path, device_kind: str, ids: set, max_step_s: float) -> list[dict]:
    """The latest row per command line of one GPU on ``device_kind`` (or the rows named in ``ids``)."""
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if ids and row["id"] not in ids:
            continue
        if not ids and (row.get("device_kind") != device_kind or row.get("gpu_count") != 1):
            continue
        if not row.get("argv") or not row.get("peak_mem_gib") or not row.get("step_s"):
            continue
        if row["step_s"] > max_step_s:
            continue
        latest[row["argv"]] = row
    return list(latest.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-kind", default="nvidia-h100-x1")
    parser.add_argument("--ids", default="", help="comma-separated row ids (default: every row of the kind)")
    parser.add_argument("--max-step-s", type=float, default=5.0, help="skip rows whose step took longer")
    parser.add_argument("--limit", type=int, default=0, help="only the N most recent rows")
    parser.add_argument("--measured", default=str(ROOT / "benchmarks" / "measured.jsonl"))
    parser.add_argument("--out", default=None, help="append one JSON line per row")
    args = parser.parse_args()

    import torch

    from meshtron.emulation.runner import emulate_rank

    ids = {i for i in args.ids.split(",") if i}
    rows = chosen_rows(Path(args.measured), args.device_kind, ids, args.max_step_s)
    rows = rows[-args.limit:] if args.limit else rows
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    same_gpu = ("H200" in gpu) == ("h200" in args.device_kind.lower())
    print(f"{len(rows)} rows of {args.device_kind}; this device: {gpu} (time compared: {same_gpu})")
    print("| row | command | measured peak GiB | emulated | error | measured step s | emulated | error |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        try:
            em = emulate_rank(shlex.split(row["argv"]), 1, 0, warmup=2, steps=3, split_repeats=1)
        except Exception as err:  # a row today's code no longer runs is reported, not fatal
            print(f"| {row['id']} | {row['argv'][:60]} | failed: {type(err).__name__}: {str(err)[:120]} |||||")
            continue
        mem_err = em.peak_mem_gib / row["peak_mem_gib"] - 1 if em.peak_mem_gib else None
        time_err = em.step_s / row["step_s"] - 1 if same_gpu else None
        rec = {"row": row["id"], "row_commit": row.get("commit"), "argv": row["argv"],
               "measured_peak_gib": row["peak_mem_gib"], "emulated_peak_gib": em.peak_mem_gib,
               "peak_error": mem_err, "measured_step_s": row["step_s"], "emulated_step_s": em.step_s,
               "step_error": time_err, "emulated_compute_s": em.forward_s + em.backward_s + em.optimizer_s,
               "emulated_reserved_gib": em.peak_reserved_gib, "emulated_alloc_retries": em.alloc_retries,
               "measured_reserved_gib": row.get("peak_reserved_gib"), "measured_alloc_retries": row.get("alloc_retries"),
               "device": gpu}
        fmt = (lambda v: "n/a" if v is None else f"{v:+.2%}")
        print(f"| {row['id']} | {row['argv'][:60]} | {row['peak_mem_gib']:.2f} | {em.peak_mem_gib or 0:.2f} | "
              f"{fmt(mem_err)} | {row['step_s']:.3f} | {em.step_s:.3f} | {fmt(time_err)} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
