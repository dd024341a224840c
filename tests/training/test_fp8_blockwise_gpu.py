"""FP8 blockwise on CUDA (Hopper): cuBLASLt's blockwise scaled matmul equals the CPU emulation of the same
e4m3 operands up to accumulation order and the output's bf16 rounding, for 128-multiples and for shapes
that the path zero-pads; the linear built on it, eager and compiled; and a tiny model's training run."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.fp8 import fp8_linear
from meshtron.layers.fp8.blockwise import blockwise_mm, gpu_support_error, quantize_blocks, quantize_tiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_this_gpu_runs_the_blockwise_scaled_matmul():
    assert gpu_support_error() is None


@pytest.mark.parametrize("p,k,q", [(256, 512, 384), (4096, 2048, 1024), (300, 200, 130), (64, 1000, 520)])
@pytest.mark.parametrize("b_blocks", [True, False], ids=["1x128-128x128", "1x128-1x128"])
def test_cuda_blockwise_mm_equals_the_emulation(p, k, q, b_blocks):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(p, k, generator=g) * torch.logspace(-2, 2, k)  # tiles of different magnitudes
    b = torch.randn(q, k, generator=g)
    aq, a_inv = quantize_tiles(a)
    bq, b_inv = (quantize_blocks if b_blocks else quantize_tiles)(b)
    want = blockwise_mm(aq, a_inv, bq, b_inv, b_blocks, torch.float32)  # CPU: emulated, fp32 output
    got = blockwise_mm(aq.cuda(), a_inv.cuda(), bq.cuda(), b_inv.cuda(), b_blocks, torch.bfloat16)
    assert got.shape == (p, q) and got.dtype == torch.bfloat16
    assert rel(got.cpu(), want) < 4e-3  # bf16 rounding of the output; a misplaced scale is off by far more


def _inputs(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 512, 640, generator=g).to(torch.bfloat16)
    w = (torch.randn(384, 640, generator=g) * 0.05).to(torch.bfloat16)
    grad = torch.randn(4, 512, 384, generator=g).to(torch.bfloat16)
    return x.to(device), w.to(device), grad.to(device)


def _run(fn, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(grad)
    return y, x.grad, w.grad


def _linear(x, w):
    return fp8_linear(x, w, None, "e4m3", "blockwise")


def test_cuda_blockwise_linear_follows_the_cpu_emulation_eager_and_compiled():
    cpu = _run(_linear, *_inputs("cpu"))
    eager = _run(_linear, *_inputs("cuda"))
    torch._dynamo.reset()
    compiled = _run(torch.compile(_linear, fullgraph=True), *_inputs("cuda"))
    for c, e, k in zip(cpu, eager, compiled):
        assert rel(e.cpu(), c) < 5e-3
        assert rel(k.cpu(), c) < 5e-3


def test_tiny_model_trains_with_blockwise_fp8_on_cuda():
    from meshtron.cli import build_config
    from meshtron.training.trainer import run_training

    args = ["--model", "tiny", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "5", "--eval-interval", "30",
            "--eval-iters", "2", "--log-interval", "10", "--no-generate-sample", "--bf16", "--device", "cuda"]
    bf16 = run_training(build_config(args))
    fp8 = run_training(build_config(args + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]))
    assert fp8.train_losses[30] < fp8.train_losses[10] - 0.5
    assert fp8.train_losses[30] == pytest.approx(bf16.train_losses[30], rel=0.03)
