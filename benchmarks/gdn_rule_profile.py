"""The gated delta rule's cost on one GPU, forward + backward, compiled as the layer runs it: meshtron's chunked
rule keeping every intermediate for its backward against the training path that keeps only its inputs and runs
the chunks again (meshtron.layers.gated_deltanet.chunk_rule_keeping_inputs); time and peak memory of each.

    python3 benchmarks/gdn_rule_profile.py --batch 1 --seq 4096 --heads 32 --dk 128 --dv 128
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from meshtron.layers.gated_deltanet import chunk_gated_delta_rule, chunk_rule_keeping_inputs


def inputs(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seq, args.heads)
    q = F.normalize(torch.randn(*shape, args.dk, device="cuda", generator=g), dim=-1) * args.dk ** -0.5
    k = F.normalize(torch.randn(*shape, args.dk, device="cuda", generator=g), dim=-1)
    v = torch.randn(*shape, args.dv, device="cuda", generator=g).bfloat16()
    decay = -torch.rand(*shape, device="cuda", generator=g) * 3
    beta = torch.rand(*shape, device="cuda", generator=g).bfloat16()
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch}, seq {args.seq}, "
          f"heads {args.heads}, dk {args.dk}, dv {args.dv}")
    ins = inputs(args)
    grad = torch.randn(args.batch, args.seq, args.heads, args.dv, device="cuda").bfloat16()
    for name, rule in (("keeps everything", chunk_gated_delta_rule), ("keeps its inputs", chunk_rule_keeping_inputs)):
        fn = torch.compile(lambda *t, rule=rule: rule(*t)[0])
        for _ in range(3):
            fn(*ins).backward(grad)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn(*ins).backward(grad)
        end.record()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{name:18s} {start.elapsed_time(end) / 10:8.2f} ms forward+backward, {peak:6.2f} GiB above the inputs")


if __name__ == "__main__":
    main()
