"""The bf16 GEMM rate at the per-rank shapes of the emulated rows, beside the planner's rate for them.

The planner charges a GEMM of F FLOPs ``matmul_tflops * F / (F + matmul_half_gflop)`` (meshtron.planning.profiles);
the emulated ranks of the 405B and million-token layouts measured their passes 13-19% slower than the planner's
compute. This times each linear's three GEMMs (forward, input gradient, weight gradient) at those shapes, each
for a sustained stretch (clocks settle under load as in a step of tens of seconds), and prints measured against
modelled.

    python benchmarks/gemm_shapes.py [--seconds S] [--gpu H100]      (on a GPU)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (case, tokens per rank, in features, out features) of each linear of a layer on one rank.
CASES = (
    # llama3-405b, TP=8 (hidden 16384, 128 heads / 8 groups of 128, ffn 53248), 2,048 and 4,096 tokens per rank
    *[(f"405b tp8 T={t}", t, i, o) for t in (2048, 4096)
      for i, o in ((16384, 2304), (2048, 16384), (16384, 13312), (6656, 16384))],
    # llama3-8b without TP (hidden 4096, 32 heads / 8 groups, ffn 14336) at 32,768 tokens per rank (1M over CP=32)
    *[("8b T=32768", 32768, i, o) for i, o in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))],
    ("cube 8192", 8192, 8192, 8192),
)


def main() -> int:
    import torch

    from meshtron.planning.profiles import builtin_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="sustained time per GEMM")
    ap.add_argument("--gpu", default="H100", help="the built-in profile to compare with")
    a = ap.parse_args()
    prof = builtin_profile(a.gpu)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; planner profile {prof.name}: "
          f"{prof.matmul_tflops:.0f} TFLOP/s, half at {prof.matmul_half_gflop:.2f} GFLOP")
    print("| case | GEMM (M x K -> N) | GFLOP | measured TFLOP/s | planner TFLOP/s | planner / measured |")
    print("|---|---|---|---|---|---|")
    total_measured = total_modelled = 0.0
    for case, t, i, o in CASES:
        x = torch.randn(t, i, device=dev, dtype=torch.bfloat16)
        w = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
        g = torch.randn(t, o, device=dev, dtype=torch.bfloat16)
        for name, fn, (m, k, n) in (("fwd", lambda: x @ w.t(), (t, i, o)), ("dgrad", lambda: g @ w, (t, o, i)),
                                    ("wgrad", lambda: g.t() @ x, (o, t, i))):
            flop = 2.0 * m * k * n
            fn()
            torch.cuda.synchronize()
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < a.seconds:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                calls += 10
            seconds = (time.perf_counter() - start) / calls
            measured = flop / seconds / 1e12
            modelled = prof.matmul_tflops * flop / (flop + prof.matmul_half_gflop * 1e9)
            total_measured += seconds
            total_modelled += flop / (modelled * 1e12)
            print(f"| {case} | {name} {m} x {k} -> {n} | {flop / 1e9:.0f} | {measured:.0f} | {modelled:.0f} | "
                  f"{modelled / measured:.3f} |", flush=True)
    print(f"all GEMMs once: measured {total_measured * 1e3:.1f} ms, planner {total_modelled * 1e3:.1f} ms "
          f"({total_modelled / total_measured - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
