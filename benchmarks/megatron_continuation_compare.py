"""Compare the losses of iterations 11-20 after a hand-over between Megatron-LM and meshtron.

Reads the logs and metrics files that benchmarks/megatron_continuation.sh leaves in its work directory:
Megatron's ``lm loss`` per iteration from its log, meshtron's ``loss`` per iteration from its metrics file.
Prints one line per case (largest relative difference, target below 1e-2 for bf16) and writes one JSON row per
case to ``--out``.

    python benchmarks/megatron_continuation_compare.py /tmp/migration --out rows.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
from pathlib import Path

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?lm loss:\s*([0-9.eE+-]+)")

#: (case, the run that did not change hands, the run that continued the other's checkpoint)
CASES = (
    ("megatron torch_dist dp_reshardable -> meshtron", "mg_dense_dist.log", "ms_from_dense_dist.jsonl"),
    ("megatron torch_dist fully_reshardable -> meshtron", "mg_dense_full.log", "ms_from_dense_full.jsonl"),
    ("megatron legacy (distrib_optim.pt) -> meshtron", "mg_dense_legacy.log", "ms_from_dense_legacy.jsonl"),
    ("megatron MoE torch_dist dp_reshardable -> meshtron", "mg_moe_dist.log", "ms_from_moe_dist.jsonl"),
    ("megatron MoE torch_dist fully_reshardable -> meshtron", "mg_moe_full.log", "ms_from_moe_full.jsonl"),
    ("megatron MoE legacy (distrib_optim.pt) -> meshtron", "mg_moe_legacy.log", "ms_from_moe_legacy.jsonl"),
    ("meshtron export -> megatron", "ms_dense_self.jsonl", "mg_from_ms.log"),
    ("meshtron MoE export -> megatron", "ms_moe_self.jsonl", "mg_from_ms_moe.log"),
)


def losses(path: Path) -> dict[int, float]:
    """Loss by iteration: a Megatron log's ``lm loss`` or a meshtron metrics file's train records."""
    if not path.is_file():
        return {}
    text = path.read_text(errors="replace")
    if path.suffix == ".jsonl":
        rows = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
        return {r["iteration"]: float(r["loss"]) for r in rows if r.get("type") == "train"}
    logged = {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(text)}
    first = min(logged, default=None)
    if first is not None and first + 1 in logged:
        # Megatron-LM logs a run's first iteration without resetting its sums (training_log's
        # is_first_iteration), so its next line (--log-interval 1) is the mean of both iterations: undone here.
        # It matters for a resumed run, whose first iterations are compared.
        logged[first + 1] = 2 * logged[first + 1] - logged[first]
    return logged


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return ""


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--first", type=int, default=11)
    ap.add_argument("--last", type=int, default=20)
    args = ap.parse_args()
    iterations = list(range(args.first, args.last + 1))
    rows = []
    for case, ref_file, cont_file in CASES:
        ref, cont = losses(args.workdir / ref_file), losses(args.workdir / cont_file)
        missing = [i for i in iterations if i not in ref or i not in cont]
        row = {"date": datetime.date.today().isoformat(), "device": _device(), "commit": _commit(), "case": case,
               "iterations": iterations, "reference": [ref.get(i) for i in iterations],
               "continued": [cont.get(i) for i in iterations]}
        if missing:
            row["missing_iterations"] = missing
            print(f"{case}: iterations {missing} missing ({ref_file}: {len(ref)}, {cont_file}: {len(cont)} logged)")
        else:
            rel = [abs(cont[i] - ref[i]) / abs(ref[i]) for i in iterations]
            row["max_rel_diff"] = max(rel)
            row["within_1e-2"] = max(rel) < 1e-2
            print(f"{case}: max relative difference {max(rel):.2e} over iterations {args.first}-{args.last} "
                  f"(loss {ref[args.first]:.4f} -> {ref[args.last]:.4f}; continued {cont[args.first]:.4f} -> "
                  f"{cont[args.last]:.4f})")
        rows.append(row)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
