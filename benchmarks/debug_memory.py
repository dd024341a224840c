"""Memory and kernel-selection probe for one configuration on one GPU (diagnostics, not a benchmark)."""

import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def gib(x):
    return f"{x / 2**30:.1f} GiB"


def strided_sdpa_probe():
    s, b, n, kv, d = 4096, 2, 32, 8, 64
    q = torch.randn(s, b, n, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    k = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    v = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        for contig in (False, True):
            qq, kk, vv = (t.contiguous() for t in (q, k, v)) if contig else (q, k, v)
            try:
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                print(f"sdpa {name} contiguous={contig}: ok")
            except Exception as e:  # noqa: BLE001
                print(f"sdpa {name} contiguous={contig}: FAILS {str(e).splitlines()[0][:100]}")


def main(argv):
    from meshtron.bench import RandomTokens
    from meshtron.cli import build_config
    from meshtron.parallel.context import build_parallel_context
    from meshtron.training.trainer import Trainer
    from meshtron.validation import validate_config

    strided_sdpa_probe()
    cfg = build_config(["--mock-data", "--eval-interval", "0"] + argv)
    validate_config(cfg, 1)
    ctx = build_parallel_context(device="cuda")
    t = cfg.train
    data = RandomTokens(cfg.model.vocab_size, cfg.model.seq_length, t.micro_batch_size, 1, 0)
    trainer = Trainer(cfg, ctx, data=data)
    print("after build:", gib(torch.cuda.memory_allocated()))
    mbs = trainer._prepare(next(data.train_batches()))
    torch.cuda.reset_peak_memory_stats()
    try:
        loss, _ = trainer.model_chunks[0](tokens=mbs[0]["tokens"], labels=mbs[0]["labels"],
                                          loss_weight=mbs[0]["loss_weight"])
        print("after forward:", gib(torch.cuda.memory_allocated()), "peak", gib(torch.cuda.max_memory_allocated()))
        loss.backward()
        print("after backward:", gib(torch.cuda.memory_allocated()), "peak", gib(torch.cuda.max_memory_allocated()))
        trainer.train_step(next(data.train_batches()), 1)
        print("after step:", gib(torch.cuda.memory_allocated()), "peak", gib(torch.cuda.max_memory_allocated()))
    except torch.OutOfMemoryError:
        traceback.print_exc(limit=-6)
        print(torch.cuda.memory_summary(abbreviated=True)[:3000])


if __name__ == "__main__" and "--layout-probe" not in sys.argv:
    main(sys.argv[1:])


def model_layout_probe():
    """SDPA on tensors laid out exactly as SelfAttention makes them, each backend forced."""
    s, b, nq, ng, d = 4096, 2, 32, 8, 64
    qkv = torch.randn(s, b, (nq + 2 * ng) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = torch.split(qkv, [nq * d, ng * d, ng * d], dim=-1)
    q, k, v = q.reshape(s, b, nq, d) * 1.0, k.reshape(s, b, ng, d) * 1.0, v.view(s, b, ng, d)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        for fix in (False, True):
            vv = v.contiguous() if fix else v
            try:
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=True).sum().backward()
                print(f"model-layout sdpa {name} v_contiguous={fix}: ok")
            except Exception as e:  # noqa: BLE001
                print(f"model-layout sdpa {name} v_contiguous={fix}: FAILS {str(e).splitlines()[0][:100]}")


if __name__ == "__main__" and "--layout-probe" in sys.argv:
    model_layout_probe()
