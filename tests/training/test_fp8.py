"""FP8 linear layers (tensorwise current scaling through torch._scaled_mm, which also runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from meshtron.cli import build_config
from meshtron.config import ConfigError
from meshtron.layers.fp8 import E4M3, E5M2, fp8_linear, tensor_scale
from meshtron.layers.fp8.cast import cast_transpose, scaled_cast
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.training.trainer import run_training
from meshtron.validation import validate_config


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_tensor_scale_maps_the_amax_to_the_format_range():
    x = torch.randn(64, 32) * 7
    for dtype in (E4M3, E5M2):
        scale, inv = tensor_scale(x, dtype)
        q = scaled_cast(x, scale, dtype)
        assert q.dtype == dtype
        assert q.float().abs().max().item() == torch.finfo(dtype).max  # the amax lands on the format's max
        assert rel(q.float() * inv, x) < (0.04 if dtype == E4M3 else 0.08)


def test_cast_transpose_of_an_empty_matrix():
    q, q_t = cast_transpose(torch.zeros(0, 8, dtype=torch.bfloat16), torch.tensor(1.0), E4M3)
    assert q.shape == (0, 8) and q_t.shape == (8, 0)


def test_cast_transpose_of_a_3d_tensor_keeps_its_shape_and_transposes_its_matrix():
    x = torch.randn(6, 2, 16, dtype=torch.bfloat16)
    scale = torch.tensor(5.0)
    q, q_t = cast_transpose(x, scale, E4M3)
    want = scaled_cast(x, scale, E4M3)
    assert q.shape == x.shape and torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    want_t = want.reshape(12, 16).t().contiguous()
    assert q_t.shape == (16, 12) and torch.equal(q_t.view(torch.uint8), want_t.view(torch.uint8))


def test_cast_transpose_writes_the_cast_in_both_layouts():
    x = torch.randn(40, 24, dtype=torch.bfloat16) * 300  # beyond e4m3's 448 after scaling: saturates
    scale = torch.tensor(2.0)
    for dtype in (E4M3, E5M2):
        q, q_t = cast_transpose(x, scale, dtype)
        want = (x.float() * 2.0).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        assert q.dtype == q_t.dtype == dtype and q_t.is_contiguous() and q_t.shape == (24, 40)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(q_t.view(torch.uint8), want.t().contiguous().view(torch.uint8))


def test_compiled_fp8_linear_equals_eager():
    """Under torch.compile the cast-and-transpose operator is one opaque node; the values must not change."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 64, generator=g) * 0.05).to(torch.bfloat16)
    grad = torch.randn(2, 32, 48, generator=g).to(torch.bfloat16)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(grad)
        return y, xi.grad, wi.grad

    def layer(a, b):
        return fp8_linear(torch.nn.functional.silu(a), b, None, "hybrid") * 2

    torch._dynamo.reset()
    for eager, compiled in zip(run(layer), run(torch.compile(layer, fullgraph=True))):
        assert torch.equal(eager, compiled)


def test_fp8_linear_equals_the_scaled_matmuls_it_stands_for():
    """Forward and both gradients are exactly the three FP8 products of the recipe (e5m2 gradients)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(32, 48, generator=g).to(torch.bfloat16)
    y = fp8_linear(x, w, None, "hybrid")
    y.backward(grad)

    def q(t, dtype):
        scale, inv = tensor_scale(t, dtype)
        return scaled_cast(t, scale, dtype), inv

    (xq, xi), (wq, wi), (gq, gi) = q(x.detach(), E4M3), q(w.detach(), E4M3), q(grad, E5M2)
    mm = torch._scaled_mm
    assert torch.equal(y, mm(xq, wq.t(), scale_a=xi, scale_b=wi, out_dtype=torch.bfloat16))
    assert torch.equal(x.grad, mm(gq, wq.t().contiguous().t(), scale_a=gi, scale_b=wi, out_dtype=torch.bfloat16))
    assert torch.equal(w.grad, mm(gq.t().contiguous(), xq.t().contiguous().t(), scale_a=gi, scale_b=xi,
                                  out_dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt,bound", [("e4m3", 0.05), ("hybrid", 0.08)])
def test_fp8_linear_matches_the_fp32_product(fmt, bound):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(96, 128, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(96, generator=g).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(64, 96, generator=g)
    y = fp8_linear(x, w, b, fmt)
    y.backward(grad.to(torch.bfloat16))
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    (xr @ wr.t() + br).backward(grad)
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel(y, xr @ wr.t() + br) < 0.05  # forward operands are e4m3 in both formats
    assert rel(x.grad, xr.grad) < bound and rel(w.grad, wr.grad) < bound
    assert rel(b.grad, br.grad) < 0.01  # the bias gradient is not quantised
    assert rel(x.grad, xr.grad) > 1e-3  # it really ran in FP8


ARGS = ["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "5", "--eval-interval", "30", "--eval-iters", "2",
        "--log-interval", "10", "--no-generate-sample", "--bf16", "--device", "cpu"]


def test_fp8_training_follows_bf16():
    bf16 = run_training(build_config(ARGS))
    fp8 = run_training(build_config(ARGS + ["--fp8-format", "hybrid"]))
    assert fp8.train_losses[30] < fp8.train_losses[10] - 0.5  # it learns
    assert fp8.train_losses[30] == pytest.approx(bf16.train_losses[30], rel=0.03)
    assert fp8.train_losses[30] != bf16.train_losses[30]  # and it is not the bf16 run


def test_fp8_switches_the_layer_linears():
    from meshtron.config import ModelConfig
    from meshtron.layers.linear import enable_fp8
    from meshtron.model import GPTModel
    from meshtron.parallel.context import ParallelContext
    from meshtron.presets import apply_preset

    m = ModelConfig()
    apply_preset(m, "tiny")
    model = GPTModel(m, ParallelContext(), 300)
    n = enable_fp8(model, "e4m3")
    linears = [mod for mod in model.modules() if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))]
    assert n == len(linears) == 4 * m.num_layers and all(mod.fp8_format == "e4m3" for mod in linears)


def test_fp8_flags_are_checked():
    cases = [(["--fp8-hybrid"], "--fp8-format hybrid needs --bf16"),
             (["--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--bf16"], "--fp8-recipe delayed is not implemented"),
             (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--bf16"],
              "--fp8-recipe rowwise takes --fp8-format e4m3")]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate_config(build_config(argv + ["--device", "cpu"]), 1)


def test_rowwise_fp8_linear_matches_the_fp32_product_and_beats_tensorwise_on_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g)
    x[3] *= 1e5  # one outlier token: with one scale per tensor every other token falls to subnormal e4m3
    x = x.to(torch.bfloat16).requires_grad_()
    w = (torch.randn(96, 128, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(96, generator=g).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(64, 96, generator=g)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    (xr @ wr.t() + br).backward(grad)
    want = (xr @ wr.t() + br).detach()
    errors = {}
    for recipe in ("rowwise", "tensorwise"):
        xi, wi, bi = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = fp8_linear(xi, wi, bi, "e4m3", recipe)
        y.backward(grad.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16 and wi.grad.dtype == torch.bfloat16
        normal = torch.arange(64) != 3
        errors[recipe] = (rel(y[normal], want[normal]), rel(xi.grad, xr.grad), rel(wi.grad, wr.grad),
                          rel(bi.grad, br.grad))
    y_err, gx_err, gw_err, gb_err = errors["rowwise"]
    assert y_err < 0.05 and gx_err < 0.05 and gw_err < 0.05 and gb_err < 0.01
    assert gx_err > 1e-3  # it really ran in FP8
    assert errors["tensorwise"][0] > 3 * y_err  # the other tokens lose precision with one scale per tensor


@pytest.mark.slow  # the tensorwise recipe's run above is the fast representative
def test_rowwise_fp8_training_follows_bf16():
    bf16 = run_training(build_config(ARGS))
    fp8 = run_training(build_config(ARGS + ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]))
    assert fp8.train_losses[30] < fp8.train_losses[10] - 0.5
    assert fp8.train_losses[30] == pytest.approx(bf16.train_losses[30], rel=0.03)
    assert fp8.train_losses[30] != bf16.train_losses[30]


def _swiglu_block_inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(2 * 48, 64, generator=g) * 0.1).to(torch.bfloat16)  # gate's rows, then up's
    w2 = (torch.randn(64, 48, generator=g) * 0.1).to(torch.bfloat16)
    grad = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    return x, w1, w2, grad


def _run_block(fn, x, w1, w2, grad):
    x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = fn(x, w1, w2)
    y.backward(grad)
    return y, x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_swiglu_block_equals_the_scaled_matmuls_it_stands_for(fmt):
    """The fused FP8 SwiGLU block: forward and the three gradients are exactly the FP8 products of the recipe,
    with the gradient of gate and up formed in fp32, rounded to bf16 and cast with the scale of its maximum,
    and fc2's weight gradient taken from the product cast with the forward's scale."""
    from meshtron.layers.fp8 import gradient_dtype
    from meshtron.layers.fp8.swiglu import fp8_swiglu_mlp

    x, w1, w2, grad = _swiglu_block_inputs()
    gdt = gradient_dtype(fmt)
    y, gx, gw1, gw2 = _run_block(lambda a, b, c: fp8_swiglu_mlp(a, b, c, gdt), x, w1, w2, grad)

    def q(t, dtype):
        scale, inv = tensor_scale(t, dtype)
        return scaled_cast(t, scale, dtype), scale, inv

    def mm(a, b, sa, sb, fast=False):
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    x2, g2 = x.reshape(-1, 64), grad.reshape(-1, 64)
    (xq, _, xi), (w1q, _, w1i), (w2q, _, w2i), (gq, _, gi) = q(x2, E4M3), q(w1, E4M3), q(w2, E4M3), q(g2, gdt)
    gate_up = mm(xq, w1q.t(), xi, w1i, fast=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    product = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    pq, _, pi = q(product, E4M3)
    assert torch.equal(y.reshape(-1, 64), mm(pq, w2q.t(), pi, w2i, fast=True))
    grad_p = mm(gq, w2q, gi, w2i).float()
    sig = torch.sigmoid(gate)
    grad_gate_up = torch.cat([grad_p * up * sig * (1 + gate * (1 - sig)), grad_p * gate * sig], -1).to(torch.bfloat16)
    hq, _, hi = q(grad_gate_up, gdt)
    assert torch.equal(gw2, mm(gq.t(), pq, gi, pi))
    assert torch.equal(gx.reshape(-1, 64), mm(hq, w1q, hi, w1i))
    assert torch.equal(gw1, mm(hq.t(), xq, hi, xi))


def test_fp8_swiglu_block_follows_the_fp32_block_and_two_fp8_linears():
    """Within FP8's rounding of the fp32 block, and of the same block run as two FP8 linears (which round SiLU's
    output to bf16 before the product, so a few FP8 values round the other way); compiled equals eager."""
    from meshtron.layers.fp8 import E5M2
    from meshtron.layers.fp8.swiglu import fp8_swiglu_mlp
    from meshtron.layers.linear import swiglu

    x, w1, w2, grad = _swiglu_block_inputs(4)

    def fused(a, b, c):
        return fp8_swiglu_mlp(a, b, c, E5M2)

    def two_linears(a, b, c):
        return fp8_linear(swiglu(fp8_linear(a, b, None, "hybrid")), c, None, "hybrid")

    got = _run_block(fused, x, w1, w2, grad)
    linears = _run_block(two_linears, x, w1, w2, grad)
    fp32 = _run_block(lambda a, b, c: torch.nn.functional.linear(swiglu(a @ b.t()), c),
                      *(t.float() for t in (x, w1, w2, grad)))
    for a, b, c in zip(got, linears, fp32):
        assert rel(a, c) < 0.12 and rel(b, c) < 0.12  # hybrid: e5m2 gradients through two linears
        assert rel(a, b) < 0.03
    torch._dynamo.reset()
    for eager, compiled in zip(got, _run_block(torch.compile(fused, fullgraph=True), x, w1, w2, grad)):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_mlp_takes_the_fused_fp8_swiglu_block_where_it_applies(monkeypatch, bias):
    """SwiGLU MLPs in FP8 tensorwise without biases run the fused block; with biases (or rowwise), the two linears."""
    import meshtron.layers.mlp as mlp_module
    from meshtron.config import ModelConfig
    from meshtron.layers.linear import enable_fp8
    from meshtron.parallel.context import ParallelContext
    from meshtron.presets import apply_preset

    m = ModelConfig()
    apply_preset(m, "tiny")
    m.disable_bias_linear = not bias
    calls = []
    monkeypatch.setattr(mlp_module, "fp8_swiglu_mlp", lambda *a: calls.append(1) or torch.zeros(()))
    for recipe, fused in (("tensorwise", not bias), ("rowwise", False)):
        block = mlp_module.MLP(m, ParallelContext(), "mlp", sequence_parallel=False).to_empty(device="cpu")
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        enable_fp8(block, "e4m3", recipe)
        calls.clear()
        block(torch.randn(16, 2, m.hidden_size))
        assert calls == ([1] if fused else []), (recipe, bias)
