"""FP8 expert GEMMs on CUDA (Hopper): ``torch._scaled_grouped_mm`` (tensorwise, rowwise) and the per-expert
blockwise scaled matmul equal the CPU emulation of the same e4m3 operands up to accumulation order and the
output's bf16 rounding, for each product on random data with empty and unaligned groups; the experts' forward
and gradients likewise; and a tiny MoE model's training run with each recipe."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.fp8.grouped import (GROUP_ALIGN, ExpertGroups, GroupedFP8Products, fp8_grouped_linear,
                                         forward_product, grouped_support_error, input_grad_product,
                                         weight_grad_product)
from meshtron.layers.moe.experts import GroupedExperts, aligned_layout
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from tests.moe.test_expert_parallel import cfg_a, cfg_b

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RECIPES = ["tensorwise", "rowwise", "blockwise"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def _buffer(counts: torch.Tensor, width: int, g: torch.Generator, scale_columns: bool = False):
    """Rows grouped by expert, copied into the FP8 experts' aligned buffer (zero padding), bf16 on CPU."""
    rows = int(counts.sum())
    offs, dest, expert_of_row, total = aligned_layout(counts, rows, GROUP_ALIGN, GROUP_ALIGN)
    x = torch.randn(rows, width, generator=g)
    if scale_columns:
        x = x * torch.logspace(-1, 1, width)  # columns of different magnitudes
    buf = torch.zeros(total, width).index_copy(0, dest, x).to(torch.bfloat16)
    return buf, offs, expert_of_row


@pytest.mark.parametrize("recipe", RECIPES)
def test_this_gpu_runs_the_fp8_experts(recipe):
    assert grouped_support_error(256, 512, recipe) is None


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("k,n", [(256, 512), (1024, 384), (2048, 768)])
def test_grouped_products_equal_the_cpu_emulation(recipe, k, n):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 17, 1, 64, 0, 33, 5, 300])  # empty and unaligned groups
    x, offs, expert_of_row = _buffer(counts, k, g, scale_columns=True)
    grad, _, _ = _buffer(counts, n, g)
    w = (torch.randn(len(counts), n, k, generator=g) * 0.05).to(torch.bfloat16)
    cpu = ExpertGroups(offs, expert_of_row)
    dev = ExpertGroups(offs.cuda(), expert_of_row.cuda())
    want = [forward_product(x, w, cpu, recipe), input_grad_product(grad, w, cpu, recipe),
            weight_grad_product(grad, x, cpu, recipe)]
    got = [forward_product(x.cuda(), w.cuda(), dev, recipe), input_grad_product(grad.cuda(), w.cuda(), dev, recipe),
           weight_grad_product(grad.cuda(), x.cuda(), dev, recipe)]
    for name, a, b in zip(("forward", "input grad", "weight grad"), got, want):
        assert a.shape == b.shape and a.dtype == torch.bfloat16, name
        # bf16 output and accumulation order (fast accumulation in the forward); a misplaced scale or group is
        # off by far more.
        assert rel(a, b) < 1e-2, (name, rel(a, b))


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_gradients_equal_the_cpu_emulation(recipe):
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([40, 0, 7, 129])
    x, offs, expert_of_row = _buffer(counts, 256, g)
    w = (torch.randn(4, 384, 256, generator=g) * 0.05).to(torch.bfloat16)
    grad = torch.randn(x.shape[0], 384, generator=g).to(torch.bfloat16)
    outs = []
    for device in ("cpu", "cuda"):
        # detach: the first round makes x a leaf that requires grad, and .to() of it would not be a leaf
        xi, wi = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        products = GroupedFP8Products(ExpertGroups(offs.to(device), expert_of_row.to(device)), recipe)
        y = fp8_grouped_linear(xi, wi, products)
        y.backward(grad.to(device))
        outs.append((y, xi.grad, wi.grad))
    for a, b in zip(outs[1], outs[0]):
        assert rel(a, b) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("make_cfg", [cfg_a, cfg_b], ids=["swiglu", "gelu-bias"])
def test_fp8_experts_on_cuda_follow_the_cpu_emulation(recipe, make_cfg):
    cfg = make_cfg()
    cfg.hidden_size = 256
    modules = []
    for device in ("cpu", "cuda"):
        with torch.device("meta"):
            m = GroupedExperts(cfg, ParallelContext(device=torch.device(device)), "layers.0.mlp.experts", 0, 8, 512)
        initialize_parameters(m, 3, torch.device(device), torch.bfloat16)
        if modules:  # CUDA's generator draws other numbers than the CPU's: the same weights on both
            m.load_state_dict(modules[0].state_dict())
        m.set_fp8("e4m3", recipe)
        modules.append(m)
    counts = torch.tensor([0, 17, 1, 64, 0, 33, 5, 200])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, generator=g).to(torch.bfloat16)
    grad = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    outs = []
    for m in modules:
        device = next(m.parameters()).device
        xi = x.detach().to(device).requires_grad_()
        y = m(xi, counts.to(device))
        y.backward(grad.to(device))
        outs.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(outs[1], outs[0]):
        if b.abs().max() > 0:
            assert rel(a, b) < 2e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_moe_model_trains_with_fp8_experts_on_cuda(recipe):
    from meshtron.cli import build_config
    from meshtron.training.trainer import run_training

    args = ["--model", "tiny", "--num-experts", "8", "--moe-ffn-hidden-size", "128", "--moe-router-topk", "2",
            "--moe-aux-loss-coeff", "0.01", "--seq-length", "128", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "5",
            "--eval-interval", "30", "--eval-iters", "2", "--log-interval", "10", "--no-generate-sample", "--bf16",
            "--device", "cuda"]
    bf16 = run_training(build_config(args))
    fp8 = run_training(build_config(args + ["--fp8-format", "e4m3", "--fp8-recipe", recipe, "--fp8-experts"]))
    assert fp8.train_losses[30] < fp8.train_losses[10] - 0.5
    assert fp8.train_losses[30] == pytest.approx(bf16.train_losses[30], rel=0.03)
