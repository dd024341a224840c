"""Where the FP8 experts' time goes on one GPU: the MoE experts of one layer (forward and backward on a buffer of
routed rows, balanced over the experts) in bf16 and in each FP8 recipe, then torch.profiler's heaviest CUDA kernels
of the FP8 recipe named by --profile.

    python3 benchmarks/fp8_experts_profile.py --experts 128 --hidden 2048 --width 768 --rows 131072
"""

from __future__ import annotations

import argparse

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe.experts import GroupedExperts
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters


def build(args, recipe):
    cfg = ModelConfig(hidden_size=args.hidden, num_layers=2, swiglu=True, disable_bias_linear=True)
    with torch.device("meta"):
        m = GroupedExperts(cfg, ParallelContext(device=torch.device("cuda")), "layers.0.mlp.experts", 0,
                           args.experts, args.width)
    initialize_parameters(m, 0, torch.device("cuda"), torch.bfloat16)
    if recipe != "bf16":
        m.set_fp8("e4m3", recipe)
    return m


def step(m, x, counts, grad):
    y = m(x, counts)
    y.backward(grad)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--profile", default="rowwise")
    p.add_argument("--recipes", default="bf16,tensorwise,rowwise,blockwise")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.full((args.experts,), args.rows // args.experts, device="cuda")
    x = torch.randn(int(counts.sum()), args.hidden, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
    flops = 3 * 2 * x.shape[0] * args.hidden * args.width * 3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; experts {args.experts}, hidden {args.hidden}, "
          f"width {args.width}, rows {x.shape[0]}")
    for recipe in args.recipes.split(","):
        m = build(args, recipe)
        for _ in range(3):
            step(m, x, counts, grad)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step(m, x, counts, grad)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"{recipe:>10}: fwd+bwd {ms:7.2f} ms, {flops / ms / 1e9:6.1f} TFLOP/s")
        if recipe == args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(m, x, counts, grad)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
