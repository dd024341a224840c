"""MoE on CUDA: the grouped-GEMM experts (bf16) equal the expert loop, also with empty and odd-sized
groups; expert parallelism over NCCL equals one GPU. Needs CUDA (two devices for NCCL)."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.moe.experts import GroupedExperts
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from test_expert_parallel import cfg_a, cfg_b, cfg_c, check_layouts, layouts_worker
from tests.distributed.launch import rank_device, run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_bf16_matches_expert_loop(bias):
    cfg = cfg_a()
    cfg.hidden_size, cfg.disable_bias_linear = 256, not bias
    dev = torch.device("cuda")
    modules = []
    for grouped, dtype in ((False, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)):
        with torch.device("meta"):
            m = GroupedExperts(cfg, ParallelContext(device=dev), "layers.0.mlp.experts", 0, 8, 512, grouped=grouped)
        initialize_parameters(m, 3, dev, dtype)
        modules.append(m)
    with torch.no_grad():  # the fp32 reference computes with the bf16-rounded weights
        for ref, low in zip(modules[0].parameters(), modules[1].parameters()):
            ref.copy_(low.float())
    counts = torch.tensor([0, 17, 1, 64, 0, 33, 5, 200], device=dev)  # empty and unaligned groups
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, device=dev, generator=g, dtype=torch.bfloat16)
    grad = torch.randn(x.shape, device=dev, generator=g, dtype=torch.bfloat16)
    outs = []
    for m in modules:
        dtype = next(m.parameters()).dtype
        xi = x.to(dtype, copy=True).requires_grad_()  # a fresh leaf per module (no shared .grad)
        y = m(xi, counts)
        y.backward(grad.to(dtype))
        outs.append([y.float(), xi.grad.float()] + [p.grad.float() for p in m.parameters()])
    # bf16 rounding differs between one GEMM per expert and the grouped kernel: the grouped result must
    # be as close to the fp32 result as the per-expert loop's is (within a factor), not equal to it.
    for ref, loop, grouped in zip(*outs):
        scale = ref.abs().max().clamp(min=1e-6)
        loop_err = ((loop - ref).abs().max() / scale).item()
        grouped_err = ((grouped - ref).abs().max() / scale).item()
        assert grouped_err < max(2 * loop_err, 1e-2), (grouped_err, loop_err)


def _cuda_layouts_worker(rank: int, world: int, layouts: list) -> list:
    return layouts_worker(rank, world, layouts, rank_device(rank))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")
def test_expert_parallel_over_nccl_equals_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    world = 2
    layouts = [("ep2-a", cfg_a, 1, 1, 2, False), ("ep2-b", cfg_b, 1, 1, 2, False),
               ("ep2-capacity-padded", cfg_c, 1, 1, 2, False)]
    results = run_distributed(_cuda_layouts_worker, world, layouts, backend="nccl", timeout=300)
    check_layouts(results, layouts, world, torch.device("cuda", 0))


def test_weighted_activation_bf16_is_as_close_to_fp32_as_the_weighted_combine(monkeypatch):
    """On CUDA in bf16 the experts that weigh each row inside the (fused, compiled) SwiGLU give the fp32
    layer's output and gradients as closely as the weighted combine does."""
    from meshtron.layers.moe import MoELayer

    cfg = cfg_a()
    cfg.hidden_size, cfg.disable_bias_linear, cfg.swiglu, cfg.moe_ffn_hidden_size = 256, True, True, 512
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(64, 4, 256, device=dev, generator=g)
    r = torch.randn(64, 4, 256, device=dev, generator=g)

    def run(dtype, weighted, grouped):
        monkeypatch.setattr(GroupedExperts, "weights_in_activation", property(lambda self: weighted))
        with torch.device("meta"):
            layer = MoELayer(cfg, ParallelContext(device=dev), 0, False, grouped_gemm=grouped)
        initialize_parameters(layer, 3, dev, dtype)
        layer.eval()
        xi = x.to(dtype).requires_grad_()
        y = layer(xi)
        grads = torch.autograd.grad((y.float() * r).sum(), [xi] + list(layer.parameters()))
        return [y.float()] + [t.float() for t in grads]

    ref = run(torch.float32, False, False)
    combine, weighted = run(torch.bfloat16, False, True), run(torch.bfloat16, True, True)
    for want, c, w in zip(ref, combine, weighted):
        scale = want.abs().max().clamp(min=1e-6)
        c_err, w_err = ((c - want).abs().max() / scale).item(), ((w - want).abs().max() / scale).item()
        assert w_err < max(1.5 * c_err, 1e-2), (w_err, c_err)


def test_slot_sum_kernel_equals_the_torch_sum():
    """The Triton combine (each token's sum over its k rows of the aligned buffer) equals the torch gather and
    fp32 reduction, for a width that is not a multiple of the block."""
    from meshtron.layers.moe.slots import slots_to_tokens, slots_to_tokens_torch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    for width in (2048, 1400):
        rows = torch.randn(1000, width, device=dev, generator=g, dtype=torch.bfloat16)
        slot = torch.randperm(1000, device=dev, generator=g)[:120 * 8]
        got, want = slots_to_tokens(rows, slot, 8), slots_to_tokens_torch(rows, slot, 8)
        assert got.shape == (120, width) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
