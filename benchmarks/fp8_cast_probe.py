"""Time the FP8 cast of one operand in both layouts on one GPU: meshtron's Triton cast-and-transpose
against the same cast and transposed copy left to torch.compile, beside the memory-bound ideal.

Usage: python benchmarks/fp8_cast_probe.py   (prints one line per shape, times in microseconds)
"""

import torch
from triton.testing import do_bench

from meshtron.layers.fp8 import E4M3
from meshtron.layers.fp8.cast import cast_transpose, scaled_cast

# llama3-3b at micro batch 4 x 4096 tokens: the layer inputs, the SwiGLU output, a gate/up gradient, a weight.
SHAPES = ((16384, 3072), (16384, 8192), (16384, 16384), (16384, 5120), (16384, 2048), (3072, 8192))


def compiled_both_layouts(x: torch.Tensor, scale: torch.Tensor):
    q = scaled_cast(x, scale, E4M3)
    return q, q.t().contiguous()


def main() -> None:
    inductor = torch.compile(compiled_both_layouts)
    bandwidth = 4.0e12  # bytes/s, roughly what an H200 streams in practice
    print(f"{'shape':>16s} {'triton':>9s} {'compiled':>9s} {'ideal':>9s}  (us)")
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        scale = 448.0 / x.abs().amax().float()
        ours = do_bench(lambda: cast_transpose(x, scale, E4M3)) * 1e3
        theirs = do_bench(lambda: inductor(x, scale)) * 1e3
        ideal = x.numel() * (2 + 1 + 1) / bandwidth * 1e6
        print(f"{rows:>7d} x {cols:<6d} {ours:9.1f} {theirs:9.1f} {ideal:9.1f}")


if __name__ == "__main__":
    main()
