"""Time the per-step passes over every parameter on one GPU, to see what a fused kernel would save:
the bf16 -> fp32 copy of each first gradient (torch's copy_, foreach copy, a Triton kernel), and
torch's fused AdamW plus the fp32 -> bf16 copy of the weights against one Triton AdamW that writes
the bf16 weights as well (meshtron.optim.fused_adamw); then, with bf16 gradients (--main-grads-dtype bf16,
--grad-reduce-in-bf16), the step and the gradient norm reading them as they are against fp32 copies first.

Usage: python benchmarks/optimizer_probe.py   (times in ms for llama3-3b-sized tensors; PROBE_LAYERS=N takes N of
its 28 layers, e.g. 14 on a GPU under 100 GB)
"""

import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from meshtron.optim.fused_adamw import adamw_step_

SHAPES = ([(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)] * int(os.environ.get("PROBE_LAYERS", "28"))
          + [(128256, 3072)] * 2)


@triton.jit
def _widen(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)


def main() -> None:
    dev = "cuda"
    src = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in SHAPES]
    dst = [torch.empty(s, device=dev) for s in SHAPES]
    n = sum(t.numel() for t in src)
    print(f"{n / 1e9:.2f}B parameters")

    def widen_all():
        for a, b in zip(src, dst):
            _widen[(triton.cdiv(a.numel(), 4096),)](a, b, a.numel(), BLOCK=4096)

    for name, fn in (("copy_", lambda: [b.copy_(a) for a, b in zip(src, dst)]),
                     ("_foreach_copy_", lambda: torch._foreach_copy_(dst, src)),
                     ("triton widen", widen_all)):
        print(f"first-gradient copy {name:>16s} {do_bench(fn, warmup=5, rep=50):7.2f} ms")
    src.clear()  # free the bf16 gradients before the optimizer tensors are made
    masters = [torch.randn(s, device=dev) for s in SHAPES]
    grads = dst
    params = [m.to(torch.bfloat16) for m in masters]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=True)
    for m, g in zip(masters, grads):
        m.grad = g

    def torch_step():
        opt.step()
        torch._foreach_copy_(params, masters)

    ms = [torch.zeros_like(m) for m in masters]
    vs = [torch.zeros_like(m) for m in masters]

    def triton_step():
        for p, g, m, v, o in zip(masters, grads, ms, vs, params):
            adamw_step_(p, g, m, v, o, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)

    print(f"AdamW fused + bf16 copy {do_bench(torch_step, warmup=3, rep=30):7.2f} ms")
    print(f"AdamW fused alone        {do_bench(opt.step, warmup=3, rep=30):7.2f} ms")
    print(f"AdamW triton (with bf16) {do_bench(triton_step, warmup=3, rep=30):7.2f} ms")
    print(f"grad norm (_foreach_norm) {do_bench(lambda: torch._foreach_norm(grads), warmup=3, rep=30):7.2f} ms")

    opt.state.clear()
    del opt
    half = [g.bfloat16() for g in grads]
    grads.clear()

    def step_from(gs):
        for p, g, m, v, o in zip(masters, gs, ms, vs, params):
            adamw_step_(p, g, m, v, o, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)

    print(f"bf16 grads: fp32 copies, then the step {do_bench(lambda: step_from([g.float() for g in half]), warmup=3, rep=30):7.2f} ms")
    print(f"bf16 grads: the step reads them        {do_bench(lambda: step_from(half), warmup=3, rep=30):7.2f} ms")
    print(f"bf16 grads: norm of fp32 copies        "
          f"{do_bench(lambda: torch._foreach_norm([g.float() for g in half]), warmup=3, rep=30):7.2f} ms")
    print(f"bf16 grads: norm read as they are      "
          f"{do_bench(lambda: torch._foreach_norm(half, 2, dtype=torch.float32), warmup=3, rep=30):7.2f} ms")


if __name__ == "__main__":
    main()
