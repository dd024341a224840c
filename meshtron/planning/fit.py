"""Fit a device profile's efficiencies to measured rows: ``python -m meshtron.planning.fit``.

The step-time model (:mod:`meshtron.planning.step_time`) has a few physically meaningful free
constants (attention rate, memory-bound efficiency, per-layer and per-step overheads, optimizer
bytes per parameter, FP8 and MoE GEMM factors, effective NVLink bandwidth, the share of SP
communication async TP hides). This fits them to every timed row of ``benchmarks/measured.jsonl``
by coordinate search on the worst relative step-time error (then the mean squared log error), each
within physical bounds. The measured matmul rate is not fitted. The result is what the built-in
H200 profile (:data:`meshtron.planning.profiles.H200`) records; rerun after new rows are measured.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Sequence

from meshtron.planning.measured import load_records, step_errors
from meshtron.planning.profiles import H200, DeviceProfile

#: The fitted constants and the range each may take.
BOUNDS: dict[str, tuple[float, float]] = {
    "attention_tflops": (200.0, 700.0), "hbm_efficiency": (0.3, 1.0), "layer_overhead_us": (0.0, 2000.0),
    "step_overhead_ms": (0.0, 100.0), "optimizer_bytes_per_param": (16.0, 80.0),
    "fp8_matmul_speedup": (1.2, 1.9), "eager_elementwise_factor": (1.0, 6.0), "moe_gemm_efficiency": (0.2, 1.0),
    "nvlink_gbps": (50.0, 450.0), "attention_half_seq": (0.0, 8192.0), "attention_tflops_d64": (200.0, 700.0),
    "attention_half_seq_d64": (0.0, 8192.0), "overlap_cost": (0.0, 0.8), "async_tp_hidden": (0.0, 1.0),
    "matmul_half_gflop": (0.1, 50.0),
}
DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "measured.jsonl")


def objective(profile: DeviceProfile, records: list[dict], configs: dict, minimax: bool) -> tuple[float, float]:
    """(mean squared log ratio, worst |relative error|) of the step-time model on the records, or the
    reverse with ``minimax``."""
    errors = step_errors(records, profile, configs)
    logs = [math.log(e.predicted_s / e.measured_s) for e in errors]
    mean, worst = sum(x * x for x in logs) / len(logs), max(abs(e.relative) for e in errors)
    return (worst, mean) if minimax else (mean, worst)


def fit(records: list[dict], start: DeviceProfile = H200, names: Sequence[str] = tuple(BOUNDS),
        rounds: int = 6, verbose: bool = False) -> DeviceProfile:
    """Coordinate search over ``names``: least squares of the log ratios, then the worst error."""
    configs: dict = {}
    best = _search(records, start, names, rounds, verbose, configs, minimax=False)
    return _search(records, best, names, max(2, rounds // 2), verbose, configs, minimax=True)


def _search(records: list[dict], best: DeviceProfile, names: Sequence[str], rounds: int, verbose: bool,
            configs: dict, minimax: bool) -> DeviceProfile:
    score = objective(best, records, configs, minimax)
    step = 0.25
    for _ in range(rounds):
        for name in names:
            lo, hi = BOUNDS[name]
            improved = True
            while improved:
                improved = False
                value = getattr(best, name)
                for candidate in (value * (1 + step), value / (1 + step), value + step * (hi - lo) * 0.1,
                                  value - step * (hi - lo) * 0.1):
                    candidate = min(hi, max(lo, candidate))
                    if candidate == value:
                        continue
                    trial = best.with_(**{name: candidate})
                    s = objective(trial, records, configs, minimax)
                    if s < score:
                        best, score, improved = trial, s, True
                        break
        if verbose:
            print(f"{'minimax' if minimax else 'least squares'} step {step:.3f}: {score}")
        step /= 2
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtron.planning.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default=DEFAULT_PATH)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    records = load_records(args.records)
    best = fit(records, rounds=args.rounds, verbose=True)
    for name in BOUNDS:
        print(f"{name}={getattr(best, name):.4g},")
    errors = step_errors(records, best)
    bad = max(errors, key=lambda e: abs(e.relative))
    print(f"{len(errors)} rows, worst {bad.id} {bad.relative:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
