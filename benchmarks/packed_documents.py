"""Packed documents at flash speed: one Llama-3-8B attention layer, forward + backward, with document
masks (flex attention with meshtron's block mask) against unmasked causal attention (cuDNN/flash).

Run on one GPU: ``python benchmarks/packed_documents.py [--seq 8192,32768,131072] [--dense]``.
Documents of 500-4,000 tokens (uniform, seeded) fill each sample. Per sequence length it prints the
forward+backward time of causal attention, of the document path (and with ``--dense`` of the
dense-mask reference, only up to 32K: its mask is S^2 bytes), the time to build the block mask (once
per micro-batch, shared by every layer), the ratio to causal and the peak memory. Target (issue
#41): within 10% of causal at 8K, no slower at 32K and 128K.

Shapes: 32 query heads, 8 key/value heads, head dim 128, bf16, micro-batch 1 (``--heads``,
``--groups``, ``--dim``, ``--batch`` change them); ``--mla`` uses DeepSeek-V3's head dims (query/key
192, value 128, 128 heads).
"""

from __future__ import annotations

import argparse
import time

import torch

from meshtron.layers.sdpa import core_attention
from meshtron.layers.documents import DocumentMask


def documents(batch: int, seq: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """Document ids [batch, seq] of documents with uniform lengths in [lo, hi]."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
        rows.append(ids)
    return torch.stack(rows).to(torch.int32)


def visible_pairs(docs: torch.Tensor) -> float:
    """Visible query-key pairs (causal within documents), summed over the batch."""
    total = 0
    for row in docs:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        total += int((counts * (counts + 1) // 2).sum())
    return float(total)


def timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="8192,32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--mla", action="store_true", help="query/key head dim 192, value 128, 128 heads")
    ap.add_argument("--doc-min", type=int, default=500)
    ap.add_argument("--doc-max", type=int, default=4000)
    ap.add_argument("--dense", action="store_true", help="also the dense-mask reference (up to 32K)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, groups, dqk, dv = args.heads, args.groups, args.dim, args.dim
    if args.mla:
        heads = groups = 128
        dqk, dv = 192, 128
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; heads {heads}, groups {groups}, "
          f"head dims {dqk}/{dv}, batch {args.batch}, bf16, documents {args.doc_min}-{args.doc_max} tokens")
    header = (f"{'seq':>7} {'docs':>5} {'path':>8} {'fwd+bwd ms':>11} {'vs causal':>9} {'TFLOP/s':>8} "
              f"{'mask ms':>8} {'peak GiB':>9}")
    print(header)
    print("-" * len(header))
    for seq in (int(s) for s in args.seq.split(",")):
        q = torch.randn(args.batch, heads, seq, dqk, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(args.batch, groups, seq, dqk, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(args.batch, groups, seq, dv, device=dev, dtype=dtype, requires_grad=True)
        dout = torch.randn(args.batch, heads, seq, dv, device=dev, dtype=dtype)
        docs = documents(args.batch, seq, args.doc_min, args.doc_max, gen).to(dev)
        n_docs = int(docs[:, -1].max()) + 1

        def build(path: str) -> DocumentMask:
            m = DocumentMask.causal(docs, path=path)
            if path == "blocks":
                m.block_mask()
            return m

        mask_ms = timed(lambda: build("blocks"), 2, 5) * 1e3
        paths = [("causal", None), ("flex", build("blocks"))]
        if args.dense and seq <= 32768:
            paths.append(("dense", build("dense")))
        causal_s = None
        for name, mask in paths:
            def step():
                q.grad = k.grad = v.grad = None
                core_attention(q, k, v, mask, 0.0).backward(dout)

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            sec = timed(step, args.warmup, args.steps)
            peak = torch.cuda.max_memory_allocated() / 2**30
            pairs = args.batch * seq * (seq + 1) / 2 if mask is None else visible_pairs(docs.cpu())
            flops = pairs * heads * 2 * (dqk + dv) * 3.5  # forward 2 matmuls, backward 2.5x
            causal_s = sec if mask is None else causal_s
            print(f"{seq:>7} {n_docs:>5} {name:>8} {sec * 1e3:>11.2f} {sec / causal_s:>9.2f} "
                  f"{flops / sec / 1e12:>8.0f} {mask_ms if name == 'flex' else 0:>8.2f} {peak:>9.2f}")
        del q, k, v, dout


if __name__ == "__main__":
    main()
