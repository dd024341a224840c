"""What delayed FP8 scaling could save: one operand's producer plus its FP8 casts, timed two ways on one GPU.

- current: the producer (a norm, SwiGLU, a gradient's element-wise backward), the operand's absolute maximum,
  then the Triton cast-and-transpose reading the bf16 result (meshtron's tensorwise recipe today);
- delayed: the scale is known before the producer runs (from earlier steps), so the compiled producer writes the
  FP8 operand itself and records its maximum, and the transposed copy is made from the one-byte result.

Usage: python benchmarks/fp8_delayed_probe.py   (one line per operand of a llama3-3b layer at 4 x 4096 tokens,
times in microseconds, then the per-step total over the model's 28 layers)
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from meshtron.layers.fp8 import E4M3, E5M2, tensor_amax
from meshtron.layers.fp8.cast import cast_transpose, cast_transposed, scaled_cast

TOKENS, HIDDEN, FFN, QKV, LAYERS = 16384, 3072, 8192, 5120, 28


def rmsnorm(h, w):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * w


def swiglu(gate_up, _):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(gate_up, grad):
    """The gradient of gate and up from the product's gradient (what fc1's output gradient is)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    g = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, g * gate * sig], dim=-1).to(grad.dtype)


def plus(a, b):
    return a + b


def current(producer, dtype):
    def fn(a, b):
        y = producer(a, b)
        scale = torch.finfo(dtype).max / tensor_amax(y).float().clamp(min=1e-12)
        return cast_transpose(y, scale, dtype)
    return torch.compile(fn)


def delayed(producer, dtype):
    def fn(a, b, scale, one):
        y = producer(a, b)
        q = scaled_cast(y, scale, dtype)
        return q, cast_transposed(q, one, dtype), tensor_amax(y)
    return torch.compile(fn)


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    # (name, producer, inputs, FP8 dtype, uses per layer)
    cases = [
        ("norm -> qkv / fc1 input", rmsnorm, (r(TOKENS, HIDDEN), r(HIDDEN)), E4M3, 2),
        ("attention out -> o input", plus, (r(TOKENS, HIDDEN), torch.zeros((), device=dev, dtype=bf)), E4M3, 1),
        ("swiglu -> fc2 input", swiglu, (r(TOKENS, 2 * FFN), None), E4M3, 1),
        ("residual grad -> fc2/o grad", plus, (r(TOKENS, HIDDEN), r(TOKENS, HIDDEN)), E5M2, 2),
        ("swiglu backward -> fc1 grad", swiglu_backward, (r(TOKENS, 2 * FFN), r(TOKENS, FFN)), E5M2, 1),
        ("rope backward -> qkv grad", plus, (r(TOKENS, QKV), r(TOKENS, QKV)), E5M2, 1),
    ]
    one = torch.ones((), device=dev)
    total_cur = total_del = 0.0
    print(f"{'operand':>30s} {'current':>9s} {'delayed':>9s}  (us)")
    for name, producer, (a, b), dtype, uses in cases:
        cur, dl = current(producer, dtype), delayed(producer, dtype)
        scale = torch.finfo(dtype).max / producer(a, b).abs().amax().float()
        t_cur = do_bench(lambda: cur(a, b)) * 1e3
        t_del = do_bench(lambda: dl(a, b, scale, one)) * 1e3
        total_cur += t_cur * uses * LAYERS
        total_del += t_del * uses * LAYERS
        print(f"{name:>30s} {t_cur:9.1f} {t_del:9.1f}")
    print(f"per step of one micro-batch, {LAYERS} layers: current {total_cur / 1e3:.1f} ms, delayed "
          f"{total_del / 1e3:.1f} ms, saved {(total_cur - total_del) / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
