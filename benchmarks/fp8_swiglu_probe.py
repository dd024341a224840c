"""The FP8 (tensorwise) SwiGLU block of one llama3-3b layer at 4 x 4096 tokens, forward and backward, timed as
two FP8 linears (fc1, then fc2 recomputing the product and its casts in backward: meshtron before the fused
block) and as the fused block (meshtron.layers.fp8.swiglu), both compiled, on one GPU.

Usage: python benchmarks/fp8_swiglu_probe.py   (milliseconds per forward + backward; the two Triton passes alone)
       PROBE_SHAPE=llama3-1b python benchmarks/fp8_swiglu_probe.py   (its block at 8 x 4096 tokens)
"""

import os

import torch
from triton.testing import do_bench

from meshtron.layers.fp8 import E4M3, E5M2, fp8_linear
from meshtron.layers.fp8.swiglu import fp8_swiglu_mlp, swiglu_grad_amax, swiglu_grad_cast
from meshtron.layers.linear import _swiglu_fp8_recomputed

SHAPES = {"llama3-3b": (16384, 3072, 8192, 28), "llama3-1b": (32768, 2048, 8192, 16)}  # tokens, hidden, ffn, layers
TOKENS, HIDDEN, FFN, LAYERS = SHAPES[os.environ.get("PROBE_SHAPE", "llama3-3b")]


def two_linears(x, w1, w2):
    return _swiglu_fp8_recomputed(fp8_linear(x, w1, None, "hybrid"), w2, "hybrid")


def fused(x, w1, w2):
    return fp8_swiglu_mlp(x, w1, w2, E5M2)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w1 = (torch.randn(2 * FFN, HIDDEN, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(HIDDEN, FFN, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    results = {}
    for name, fn in (("two FP8 linears", two_linears), ("fused block", fused)):
        compiled = torch.compile(fn)

        def step():
            compiled(x, w1, w2).backward(grad)

        results[name] = do_bench(step, warmup=10, rep=100)
        print(f"{name:>16s}: {results[name]:.3f} ms per forward + backward")
    saved = results["two FP8 linears"] - results["fused block"]
    print(f"saved: {saved:.3f} ms per layer, {saved * LAYERS:.1f} ms per step of {LAYERS} layers")
    gate_up = torch.randn(TOKENS, 2 * FFN, device="cuda", generator=g).to(torch.bfloat16)
    grad_p = torch.randn(TOKENS, FFN, device="cuda", generator=g).to(torch.bfloat16)
    scale = torch.tensor(10.0, device="cuda")
    amax_ms = do_bench(lambda: swiglu_grad_amax(gate_up, grad_p, scale, E4M3))
    cast_ms = do_bench(lambda: swiglu_grad_cast(gate_up, grad_p, scale, E5M2))
    # Bytes: the first pass reads gate, up and the gradient and writes the product's FP8 copy; the second reads
    # the same and writes both FP8 layouts of the gradient.
    read = (gate_up.numel() + grad_p.numel()) * 2
    print(f"maximum pass: {amax_ms * 1e3:.1f} us ({(read + grad_p.numel()) / amax_ms / 1e6:.0f} GB/s), "
          f"cast pass: {cast_ms * 1e3:.1f} us ({(read + 2 * gate_up.numel()) / cast_ms / 1e6:.0f} GB/s)")


if __name__ == "__main__":
    main()
