"""FP8 blockwise recipe (meshtron.layers.fp8.blockwise) on CPU: the emulated scaled matmuls against fp32,
the axes each operand is tiled along, the point of fine-grained scales (outlier channels), and training."""

from __future__ import annotations

import pytest
import torch

from meshtron.cli import build_config
from meshtron.config import ConfigError
from meshtron.layers.fp8 import fp8_linear
from meshtron.layers.fp8.blockwise import E4M3, dequantize, quantize_blocks, quantize_tiles
from meshtron.training.trainer import run_training
from meshtron.validation import validate_config


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_quantize(x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """The e4m3 rounding of ``x`` [R, C] with one scale per ``tile_rows`` x 128 tile, tile by tile (a plain
    restatement of the recipe, independent of the module's reshapes), dequantised to fp32."""
    out = torch.empty(x.shape)
    for r in range(0, x.shape[0], tile_rows):
        for c in range(0, x.shape[1], 128):
            tile = x[r:r + tile_rows, c:c + 128].float()
            scale = 448.0 / tile.abs().max().clamp(min=1e-12)
            out[r:r + tile_rows, c:c + 128] = (tile * scale).to(E4M3).float() / scale
    return out


@pytest.mark.parametrize("shape", [(3, 256), (5, 200), (130, 70)])
def test_tiles_and_blocks_take_their_own_maximum(shape):
    """One scale per 1x128 tile (per 128x128 block), the last one shorter where the dimension is not a multiple
    of 128; each tile's maximum lands on e4m3's largest value; dequantised values equal the tile-by-tile
    reference (up to fp32 rounding of the scale and its inverse)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])  # tiles of very different magnitudes
    for blocks, quantize, tile_rows in ((False, quantize_tiles, 1), (True, quantize_blocks, 128)):
        q, inv = quantize(x)
        assert q.dtype == E4M3 and q.shape == x.shape and inv.dtype == torch.float32
        assert inv.shape == (-(-shape[0] // tile_rows), -(-shape[1] // 128))
        last_tile = x[(inv.shape[0] - 1) * tile_rows:, (inv.shape[1] - 1) * 128:]  # the shorter one at the corner
        assert inv[-1, -1].item() == pytest.approx(last_tile.abs().max().item() / 448, rel=1e-6)
        assert q.float().abs().max().item() == 448.0
        torch.testing.assert_close(dequantize(q, inv, blocks), reference_quantize(x, tile_rows), rtol=1e-6, atol=0)


def _inputs(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(m, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(m, generator=g).to(torch.bfloat16)
    grad = torch.randn(n, m, generator=g)
    return x, w, b, grad


def _run(x, w, b, grad, recipe: str):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, "e4m3", recipe)
    y.backward(grad.to(y.dtype))
    return y, x.grad, w.grad, b.grad


def _fp32(x, w, b, grad):
    x, w, b = (t.detach().float().requires_grad_() for t in (x, w, b))
    y = x @ w.t() + b
    y.backward(grad.float())
    return y.detach(), x.grad, w.grad, b.grad


def test_each_matmul_tiles_its_operands_along_its_contraction_dimension():
    """Forward, input gradient and weight gradient equal fp32 products of the reference-quantised operands:
    x per token along K and W in blocks (forward); g per token along M and the same W blocks (input gradient);
    g and x along the tokens (weight gradient)."""
    x, w, b, grad = _inputs(200, 300, 140)
    y, gx, gw, gb = _run(x, w, b, grad, "blockwise")
    g = grad.to(torch.bfloat16)
    wq = reference_quantize(w, 128)
    want_y = (reference_quantize(x, 1) @ wq.t()).to(torch.bfloat16) + b  # the bias added in bf16, as the layer does
    want_gx = (reference_quantize(g, 1) @ wq).to(torch.bfloat16)
    want_gw = (reference_quantize(g.t(), 1) @ reference_quantize(x.t(), 1).t()).to(torch.bfloat16)
    for got, want in ((y, want_y), (gx, want_gx), (gw, want_gw)):
        assert got.dtype == torch.bfloat16
        # Measured 3e-6 to 2e-5: fp32 summation order and scale rounding flip a few bf16 roundings of the output.
        assert rel(got, want) < 1e-4
    assert rel(gb, g.float().sum(0)) < 1e-2  # the bias gradient is not quantised
    # A wrong axis (x tiled along K for the weight gradient) is off by far more than that.
    wrong = (reference_quantize(g.t(), 1) @ reference_quantize(x, 1)).to(torch.bfloat16)
    assert rel(wrong, want_gw) > 1e-2


# Measured (relative Frobenius error against fp32, seed 0): output 1.9-2.5%, input and weight gradients 3.5-3.7%,
# for all three shapes; the bounds are about twice that.
@pytest.mark.parametrize("shape", [(64, 128, 96), (70, 200, 130), (256, 384, 256)])
def test_blockwise_linear_follows_the_fp32_product(shape):
    x, w, b, grad = _inputs(*shape)
    y, gx, gw, gb = _run(x, w, b, grad, "blockwise")
    ry, rgx, rgw, rgb = _fp32(x, w, b, grad)
    assert rel(y, ry) < 0.05
    assert rel(gx, rgx) < 0.075 and rel(gw, rgw) < 0.075
    assert rel(gb, rgb) < 0.01
    assert rel(gx, rgx) > 1e-3  # it really ran in FP8


def test_blockwise_beats_tensorwise_and_rowwise_on_an_outlier_channel():
    """An outlier channel (feature 5 of 1024, 1e5 times the others), as LLM activations have: one scale per
    tensor or per token pushes every other feature towards e4m3's subnormals; with 1x128 tiles only the 127
    features that share the outlier's tile lose precision. The weight's column for the outlier is zero, so the
    output measures what happens to the other features (the outlier's own products would be exact anyway)."""
    x, w, b, grad = _inputs(64, 1024, 96, seed=1)
    x = x.float()
    x[:, 5] *= 1e5
    x = x.to(torch.bfloat16)
    w[:, 5] = 0
    ry, _, _, _ = _fp32(x, w, b, grad)
    errors = {recipe: rel(_run(x, w, b, grad, recipe)[0], ry) for recipe in ("blockwise", "rowwise", "tensorwise")}
    # Measured: blockwise 4.8% (2.5% without the outlier), rowwise 10.9%, tensorwise 30.8%.
    assert errors["blockwise"] < 0.08
    assert errors["rowwise"] > 1.8 * errors["blockwise"] and errors["tensorwise"] > 4 * errors["blockwise"]


def test_a_small_model_follows_fp32():
    """A SwiGLU MLP block of the tiny model (its column- and row-parallel linears) with blockwise FP8 linears:
    output, input gradient and both weights' gradients against the same block in fp32 (measured 6.2-6.5%
    for each, through two e4m3 linears, as tensorwise's 6.5-6.6% and rowwise's 6.3-6.6%; bound twice that)."""
    import meshtron.layers.mlp as mlp_module
    from meshtron.config import ModelConfig
    from meshtron.layers.linear import enable_fp8
    from meshtron.parallel.context import ParallelContext
    from meshtron.presets import apply_preset

    m = ModelConfig()
    apply_preset(m, "tiny")
    torch.manual_seed(0)
    block = mlp_module.MLP(m, ParallelContext(), "mlp", sequence_parallel=False).to_empty(device="cpu")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(32, 2, m.hidden_size)
    grad = torch.randn(32, 2, m.hidden_size)

    def run():
        block.zero_grad()
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(grad)
        return [y.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()]

    want = run()
    assert enable_fp8(block, "e4m3", "blockwise") == 2
    got = run()
    # The parameters (what checkpoints hold) keep their dtype: only the matmul operands are FP8.
    assert all(t.dtype == torch.float32 for t in block.state_dict().values())
    for a, b in zip(got, want):
        assert 1e-3 < rel(a, b) < 0.13


def test_blockwise_flags_are_checked():
    with pytest.raises(ConfigError, match="--fp8-recipe blockwise takes --fp8-format e4m3"):
        validate_config(build_config(["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--bf16",
                                      "--device", "cpu"]), 1)
    cfg = build_config(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--bf16", "--device", "cpu"])
    validate_config(cfg, 1)
    assert cfg.train.fp8_recipe == "blockwise"


ARGS = ["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "5", "--eval-interval", "30", "--eval-iters", "2",
        "--log-interval", "10", "--no-generate-sample", "--bf16", "--device", "cpu"]


@pytest.mark.slow  # tests/parallel/test_fp8_blockwise_tp.py's TP=2 + SP run is this recipe's fast trainer run
def test_blockwise_fp8_training_follows_bf16():
    """30 iterations of the tiny model (bf16 with blockwise FP8 linears, including the partial tiles of its
    352-wide MLP) against bf16: the loss falls and ends within 3% of the bf16 run's, the other recipes' bound
    (measured: 6.5335 against 6.5219, +0.18%)."""
    bf16 = run_training(build_config(ARGS))
    fp8 = run_training(build_config(ARGS + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]))
    assert fp8.train_losses[30] < fp8.train_losses[10] - 0.5
    assert fp8.train_losses[30] == pytest.approx(bf16.train_losses[30], rel=0.03)
    assert fp8.train_losses[30] != bf16.train_losses[30]


def test_the_memory_estimate_counts_blockwise_as_rowwise():
    """Both recipes save their linears' bf16 inputs and keep no FP8 copies: the same estimate, with and without
    TP + SP, and not the tensorwise one."""
    from meshtron.memory import estimate_memory

    for layout, world in (([], 1), (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)):
        totals = {}
        for recipe in ("tensorwise", "rowwise", "blockwise"):
            cfg = build_config(["--model", "llama3-1b", "--bf16", "--device", "cuda", "--mock-data",
                                "--fp8-format", "e4m3", "--fp8-recipe", recipe] + layout)
            totals[recipe] = estimate_memory(cfg, 128256, world_size=world).total
        assert totals["blockwise"] == totals["rowwise"] != totals["tensorwise"]


class _Store:
    """A stand-in for the zero-bubble weight-gradient store: keeps what a backward defers."""

    def __init__(self):
        self.deferred = []

    def defer(self, param, weight_grad):
        self.deferred.append((param, weight_grad))


def test_deferred_weight_gradient_equals_the_immediate_one():
    """Zero-bubble schedules: backward computes the input gradient and hands the weight gradient's blockwise GEMM
    to the store; run later, it equals the one computed at once."""
    x, w, b, grad = _inputs(96, 256, 128)
    y, gx, gw, gb = _run(x, w, b, grad, "blockwise")
    store = _Store()
    xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
    y2 = fp8_linear(xi, wi, bi, "e4m3", "blockwise", deferral=(store, wi))
    y2.backward(grad.to(torch.bfloat16))
    assert wi.grad is None and len(store.deferred) == 1 and store.deferred[0][0] is wi
    assert torch.equal(y2, y) and torch.equal(xi.grad, gx) and torch.equal(bi.grad, gb)
    assert torch.equal(store.deferred[0][1](), gw)


def test_recomputed_and_compiled_blockwise_linear_equal_eager():
    """Activation checkpointing replays the forward (the function keeps no state between passes), and the compiler
    traces the function whole: both give the eager values."""
    x, w, b, grad = _inputs(64, 256, 128)
    want = _run(x, w, b, grad, "blockwise")

    def layer(a, c, d):
        return fp8_linear(a, c, d, "e4m3", "blockwise")

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = fn(*leaves)
        y.backward(grad.to(torch.bfloat16))
        return [y] + [t.grad for t in leaves]

    recomputed = run(lambda *a: torch.utils.checkpoint.checkpoint(layer, *a, use_reentrant=False))
    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True))
    for a, r in zip(want, recomputed):
        assert torch.equal(a, r)
    # Compiled: the gradients bit for bit; the output within 2.3e-3 (measured; the compiler adds the bias to the
    # fp32 product before one bf16 rounding, eager rounds twice).
    assert rel(compiled[0], want[0]) < 1e-2
    for a, c in zip(want[1:], compiled[1:]):
        assert torch.equal(a, c)


@pytest.mark.parametrize("b_blocks", [True, False], ids=["1x128-128x128", "1x128-1x128"])
def test_the_gpu_path_passes_the_scaled_matmul_layout_checks(b_blocks):
    """The CUDA path's operands and scales (zero-padded, M-major 1x128 scales, L4-padded block scales) pass the
    shape and stride checks of torch's blockwise scaled matmul, run here through its meta kernel (no GPU)."""
    from meshtron.layers.fp8.blockwise import _cuda_mm

    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    for p, k, q in ((256, 512, 384), (300, 200, 130), (64, 1000, 520)):
        aq, a_inv = quantize_tiles(torch.randn(p, k))
        bq, b_inv = (quantize_blocks if b_blocks else quantize_tiles)(torch.randn(q, k))
        out = _cuda_mm(*(t.to("meta") for t in (aq, a_inv, bq, b_inv)), b_blocks, torch.bfloat16)
        assert out.shape == (p, q) and out.dtype == torch.bfloat16


def test_an_empty_batch_gives_empty_outputs_and_a_zero_weight_gradient():
    x = torch.zeros(0, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x, w, None, "e4m3", "blockwise")
    y.sum().backward()
    assert y.shape == (0, 128) and x.grad.shape == (0, 256) and not w.grad.any()


def test_the_blockwise_matmul_is_one_well_formed_operator():
    """``meshtron::fp8_blockwise_mm`` (what torch.compile sees instead of the untraceable scaled matmul): its fake
    kernel and dynamic-shape tracing, by torch.library.opcheck (its schema check cannot multiply e4m3 on the CPU)."""
    aq, a_inv = quantize_tiles(torch.randn(130, 256))
    bq, b_inv = quantize_blocks(torch.randn(200, 256))
    torch.library.opcheck(torch.ops.meshtron.fp8_blockwise_mm.default, (aq, a_inv, bq, b_inv, True, torch.bfloat16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
