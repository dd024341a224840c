"""Time SDPA backends for Llama-shaped attention (GQA native vs. repeated KV) on the current GPU."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def probe(b=8, nq=32, nkv=8, s=4096, d=64):
    q = torch.randn(b, nq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, nkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, nkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 4 * b * nq * s * s * d / 2 * 3.5  # causal fwd+bwd (bwd ~2.5x fwd)
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        for gqa in (True, False):
            def run():
                kk, vv = (k, v) if gqa else (k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1))
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                out.sum().backward()
            try:
                ms = do_bench(run, warmup=50, rep=200)
                print(f"sdpa {name:9s} gqa={'native' if gqa else 'repeat'} b={b} nq={nq} s={s} d={d}: "
                      f"{ms:.2f} ms fwd+bwd, {flops / ms / 1e9:.0f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"sdpa {name:9s} gqa={'native' if gqa else 'repeat'}: unavailable ({str(e).splitlines()[0][:80]})")


if __name__ == "__main__":
    probe(d=64)
    probe(b=4, nq=24, nkv=8, d=128)
