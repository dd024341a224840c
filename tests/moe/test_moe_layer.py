"""The MoE layer (one process) equals a per-token computation from its own weights: outputs and gradients;
grouped GEMM equals the expert loop; buffers survive materialisation; which layers are MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.layer_kinds.pattern import is_moe_layer
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.router import select_experts
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters, spec_of

H = 32


def moe_cfg(**kw) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                      normalization="RMSNorm", swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
                      attention_dropout=0.0, num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def build(cfg: ModelConfig, seed: int = 11, **kw) -> MoELayer:
    with torch.device("meta"):
        layer = MoELayer(cfg, ParallelContext(), 0, False, **kw)
    initialize_parameters(layer, seed, torch.device("cpu"), torch.float32)
    return layer


def _mlp(x, w1, b1, w2, b2, swiglu):
    h = F.linear(x, w1, b1)
    if swiglu:
        g, u = h.chunk(2, -1)
        h = F.silu(g) * u
    else:
        h = F.gelu(h, approximate="tanh")
    return F.linear(h, w2, b2)


def reference(layer: MoELayer, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over the chosen experts of weight x expert(token), plus the shared expert."""
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    logits = F.linear(tokens, layer.router.weight)
    groups = (cfg.moe_router_num_groups, cfg.moe_router_group_topk) if cfg.moe_router_num_groups else None
    probs, idx = select_experts(logits, cfg.moe_router_topk, cfg.moe_router_score_function,
                                cfg.moe_router_pre_softmax, layer.router.expert_bias, groups)
    probs = probs * (cfg.moe_router_topk_scaling_factor or 1.0)
    ex = layer.experts
    E = cfg.num_experts
    w1, w2 = ex.fc1_weight.view(E, -1, h), ex.fc2_weight.view(E, h, -1)
    b1 = ex.fc1_bias.view(E, -1) if ex.fc1_bias is not None else [None] * E
    b2 = ex.fc2_bias.view(E, -1) if ex.fc2_bias is not None else [None] * E
    keep = layer.router(tokens, b).keep
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(h)
        for j in range(cfg.moe_router_topk):
            if keep is not None and not keep[t, j]:
                continue
            e = int(idx[t, j])
            acc = acc + probs[t, j] * _mlp(tokens[t], w1[e], b1[e], w2[e], b2[e], cfg.swiglu)
        rows.append(acc)
    out = torch.stack(rows)
    if layer.shared_experts is not None:
        sh = layer.shared_experts
        out = out + _mlp(tokens, sh.fc1.weight, sh.fc1.bias, sh.fc2.weight, sh.fc2.bias, cfg.swiglu)
    return out.view(s, b, h)


CASES = {
    "swiglu-top2": {},
    "gelu-bias-shared": dict(swiglu=False, disable_bias_linear=False, moe_shared_expert_intermediate_size=16),
    "sigmoid-top3-bias": dict(moe_router_score_function="sigmoid", moe_router_topk=3,
                              moe_router_enable_expert_bias=True),
    "pre-softmax-capacity": dict(moe_router_pre_softmax=True, moe_expert_capacity_factor=0.5),
    # Every expert's input padded to its capacity: the zero rows (which meet the biases here) must not
    # reach any output or gradient.
    "capacity-padded-gelu-bias": dict(swiglu=False, disable_bias_linear=False, moe_expert_capacity_factor=0.5,
                                      moe_pad_expert_input_to_capacity=True),
    # DeepSeek-V3 routing: sigmoid, expert bias, 2 groups of 2 experts with one group per token, scaled weights.
    "sigmoid-group-limited-scaled": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                         moe_router_num_groups=2, moe_router_group_topk=1,
                                         moe_router_topk_scaling_factor=2.5),
    "capacity-padded-top3": dict(moe_router_topk=3, moe_expert_capacity_factor=1.0,
                                 moe_pad_expert_input_to_capacity=True),
}


def _grouped_mm_runs_here() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 8), offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except Exception:  # noqa: BLE001 - CPU kernels exist only in some torch versions
        return False


# The grouped GEMM takes the layer's assignments straight into its aligned buffer when nothing is dropped
# (MoELayer's local path) and the dispatcher's permutation otherwise: both against the reference.
@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device"))])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_equals_per_token_reference(name, grouped):
    cfg = moe_cfg(**CASES[name])
    layer = build(cfg, grouped_gemm=grouped)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(6, 3, H, generator=torch.Generator().manual_seed(5))
    r = torch.randn(6, 3, H, generator=torch.Generator().manual_seed(6))
    layer.eval()  # no router losses: compare the token path alone
    params = [p for p in layer.parameters()]
    got = layer(x)
    grads = torch.autograd.grad((got * r).sum(), params)
    want = reference(layer, cfg, x)
    want_grads = torch.autograd.grad((want * r).sum(), params, allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, _), g, w in zip(layer.named_parameters(), grads, want_grads):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device")
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_equals_expert_loop(bias):
    cfg = moe_cfg(disable_bias_linear=not bias, moe_ffn_hidden_size=16)
    loop, grouped = build(cfg, grouped_gemm=False), build(cfg, grouped_gemm=True)
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(7))
    outs = []
    for layer in (loop, grouped):
        layer.train()
        y = layer(x)
        (y.square().sum()).backward()
        outs.append((y.detach(), [p.grad for p in layer.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device")
def test_grouped_gemm_with_empty_and_unaligned_groups():
    from meshtron.layers.moe.experts import GroupedExperts

    cfg = moe_cfg(disable_bias_linear=False)
    modules = []
    for grouped in (False, True):
        with torch.device("meta"):
            m = GroupedExperts(cfg, ParallelContext(), "layers.0.mlp.experts", 0, 5, 16, grouped=grouped)
        initialize_parameters(m, 3, torch.device("cpu"), torch.float32)
        modules.append(m)
    counts = torch.tensor([0, 9, 1, 0, 13])
    g = torch.Generator().manual_seed(8)
    x = torch.randn(int(counts.sum()), H, generator=g)
    grad = torch.randn(x.shape, generator=g)
    results = []
    for m in modules:
        xi = x.clone().requires_grad_()
        y = m(xi, counts)
        y.backward(grad)
        results.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_buffers_stay_fp32_zero_and_keep_their_spec_in_bf16():
    cfg = moe_cfg(moe_router_enable_expert_bias=True)
    with torch.device("meta"):
        layer = MoELayer(cfg, ParallelContext(), 3, False)
    initialize_parameters(layer, 1, torch.device("cpu"), torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    for name, buf in layer.named_buffers():
        assert buf.dtype == torch.float32 and not buf.any(), name
    assert spec_of(layer.router.expert_bias).pieces[0].name == "layers.3.mlp.router.expert_bias"
    layer.router.expert_bias.fill_(1e-3 / 3)
    value = layer.router.expert_bias.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.router.expert_bias, value)  # not rounded through bf16


def test_expert_parameters_are_marked_and_named():
    layer = build(moe_cfg(moe_shared_expert_intermediate_size=16))
    expert = {n for n, p in layer.named_parameters() if spec_of(p).expert}
    assert expert == {"experts.fc1_weight", "experts.fc2_weight"}
    names = [piece.name for piece in spec_of(layer.experts.fc1_weight).pieces]
    assert names[:3] == ["layers.0.mlp.experts.0.gate.weight", "layers.0.mlp.experts.0.up.weight",
                         "layers.0.mlp.experts.1.gate.weight"]
    assert spec_of(layer.router.weight).tp_replicated


def test_which_layers_are_moe():
    cfg = moe_cfg(num_layers=6, moe_layer_freq=2)
    assert [is_moe_layer(cfg, i) for i in range(6)] == [True, False, True, False, True, False]
    cfg.moe_first_dense_layers = 1
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, False, True, False, True, False]
    cfg.moe_layer_freq = 1
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, True, True, True, True]
    from meshtron.layers.moe import make_moe_mlp

    model = GPTModel(cfg, ParallelContext(), 64, make_mlp=make_moe_mlp)
    assert [isinstance(layer.mlp, MoELayer) for layer in model.layers.values()] == [False] + [True] * 5
    assert not is_moe_layer(moe_cfg(num_experts=None), 0)


def test_recomputed_layers_give_the_same_gradients_and_metrics():
    from meshtron.layers.moe import MoETrainingHooks, make_moe_mlp
    from meshtron.parallel.sharding import gather_canonical

    cfg = moe_cfg(position_embedding_type="rope", make_vocab_size_divisible_by=8, moe_aux_loss_coeff=0.1,
                  moe_z_loss_coeff=0.01, moe_router_enable_expert_bias=True)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(9))
    results = []
    for recompute in ((), (0, 1)):
        model = GPTModel(cfg, ParallelContext(), 50, recompute_layers=recompute, make_mlp=make_moe_mlp)
        initialize_parameters(model, 4, torch.device("cpu"), torch.float32)
        model.train()
        hooks = MoETrainingHooks([model], ParallelContext(), 1, cfg)
        total, _ = model(tokens, labels=tokens, loss_weight=torch.full((2, 8), 1 / 16))
        total.backward()
        metrics = hooks.metrics()
        hooks.after_step(True)
        biases = [m.router.expert_bias.clone() for m in hooks.layers]
        results.append((gather_canonical([model], "grad"), metrics, biases))
    (g0, m0, b0), (g1, m1, b1) = results
    assert g0.keys() == g1.keys()
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    assert m1 == pytest.approx(m0, rel=1e-6) and m0["aux_loss"] > 0
    assert all(torch.equal(a, b) for a, b in zip(b0, b1)) and sum(float(a.abs().sum()) for a in b0) > 0


def test_expert_bias_gradient_is_summed_in_fp32():
    """The grouped path's bias: forward values, and a bias gradient within one bf16 rounding of the fp32
    sum over thousands of rows (on CUDA, bf16 atomics of plain index_select autograd are not; the GPU
    test compares against fp32 there)."""
    from meshtron.layers.moe.experts import add_expert_bias

    g = torch.Generator().manual_seed(0)
    expert_of_row = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 4000, 700]))
    rows = torch.randn(expert_of_row.numel(), 16, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(3, 16, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(rows.shape, generator=g).bfloat16()
    out = add_expert_bias(rows, bias, expert_of_row, 0.5)
    torch.testing.assert_close(out, rows + bias[expert_of_row] * 0.5)
    out.backward(grad)
    want = torch.zeros(3, 16).index_add_(0, expert_of_row, grad.float()) * 0.5
    torch.testing.assert_close(bias.grad.float(), want, rtol=8e-3, atol=1e-3)  # one bf16 rounding of the sum
    assert torch.equal(rows.grad, grad)


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device")
def test_weights_in_the_activation_keep_no_output_rows(monkeypatch):
    """SwiGLU experts on the direct grouped-GEMM path weigh each row inside the activation: the same output and
    gradients as the weighted combine, while backward keeps no output rows ([T * k, H])."""
    from meshtron.layers.moe.experts import GroupedExperts
    from tests.layers.saved_tensors import saved_storages

    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(3))
    r = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(4))
    results = {}
    for weighted in (True, False):
        if not weighted:
            monkeypatch.setattr(GroupedExperts, "weights_in_activation", property(lambda self: False))
        layer = build(moe_cfg(), grouped_gemm=True)
        layer.eval()  # no router losses
        xin = x.clone().requires_grad_()
        y, saved = saved_storages(layer, xin, params=list(layer.parameters()))
        grads = torch.autograd.grad((y * r).sum(), [xin] + list(layer.parameters()))
        results[weighted] = (y.detach(), grads, sum(saved.values()))
    (y_w, g_w, bytes_w), (y_c, g_c, bytes_c) = results[True], results[False]
    torch.testing.assert_close(y_w, y_c, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_w, g_c):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    T, k = 16, 2
    assert bytes_c - bytes_w == 4 * T * k * H


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device")
@pytest.mark.parametrize("weighted", [False, True])
def test_grouped_swiglu_experts_keep_only_their_input_and_fc1_output(weighted):
    """The grouped SwiGLU experts keep, per row of the aligned buffer, fc1's input and output and one fp32
    weight: SiLU's output and the product are recomputed by the down projection's backward (through the
    dispatcher, weights 1: the combine weighs)."""
    from meshtron.layers.moe.experts import GroupedExperts, aligned_layout
    from tests.layers.saved_tensors import saved_storages

    cfg = moe_cfg()
    fe, E = cfg.moe_ffn_hidden_size, cfg.num_experts
    with torch.device("meta"):
        experts = GroupedExperts(cfg, ParallelContext(), "layers.0.mlp.experts", 0, E, fe, grouped=True)
    initialize_parameters(experts, 5, torch.device("cpu"), torch.float32)
    counts = torch.tensor([3, 0, 9, 5])
    offs, _, expert_of_row, rows = aligned_layout(counts, int(counts.sum()))
    padded = torch.randn(rows, H, generator=torch.Generator().manual_seed(6), requires_grad=True)
    weights = torch.rand(rows, generator=torch.Generator().manual_seed(7)) if weighted else None
    w1, w2 = experts.fc1_weight.view(E, -1, H), experts.fc2_weight.view(E, H, -1)
    y, saved = saved_storages(experts._grouped_mlp, padded, w1, w2, offs, expert_of_row, weights,
                              params=list(experts.parameters()))
    assert sum(saved.values()) == 4 * rows * (H + 2 * fe + 1) + offs.numel() * 4
    want = []
    start = 0
    for e, end in enumerate(offs.tolist()):
        h = padded[start:end] @ w1[e].t()
        g, u = h.chunk(2, -1)
        a = F.silu(g) * u * (weights[start:end, None] if weighted else 1)
        want.append(a @ w2[e].t())
        start = end
    torch.testing.assert_close(y, torch.cat(want), rtol=1e-5, atol=1e-6)


def test_weighted_swiglu_backward_equals_autograd():
    """The fused backward of the weighted SwiGLU (recomputing the product) gives autograd's gradients."""
    from meshtron.layers.moe.experts import _weighted_swiglu, _weighted_swiglu_backward

    g = torch.Generator().manual_seed(7)
    h = torch.randn(40, 2 * 24, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.rand(40, generator=g, dtype=torch.float64, requires_grad=True)
    grad_a = torch.randn(40, 24, generator=g, dtype=torch.float64)
    a = _weighted_swiglu(h, p)
    want_h, want_p = torch.autograd.grad(a, [h, p], grad_a)
    again, got_h, got_p = _weighted_swiglu_backward(h.detach(), p.detach(), grad_a)
    torch.testing.assert_close(again, a.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got_h, want_h.to(got_h.dtype), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_p, want_p.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm has no kernel for fp32 on this device")
def test_weighted_down_projection_gradient_comes_in_the_weights_layout():
    """The down projection's weight gradient is made in the weight's [El, H, F] layout (a transposed result
    would be copied with strides when accumulated)."""
    from meshtron.layers.moe.experts import _GroupedBf16Products, _WeightedSwiGLUDown

    g = torch.Generator().manual_seed(8)
    h = torch.randn(16, 2 * 8, generator=g, requires_grad=True)
    p = torch.rand(16, generator=g, requires_grad=True)
    w2 = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    y = _WeightedSwiGLUDown.apply(h, p, w2, _GroupedBf16Products(offs))
    (grad_w2,) = torch.autograd.grad(y.square().sum(), [w2])
    assert grad_w2.is_contiguous()
    gate, up = h.detach().chunk(2, -1)
    a = F.silu(gate) * up * p.detach()[:, None]
    want = torch.stack([y.detach()[:8].mul(2).t() @ a[:8], y.detach()[8:].mul(2).t() @ a[8:]])
    torch.testing.assert_close(grad_w2, want, rtol=1e-5, atol=1e-5)
