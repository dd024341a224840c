"""gpt-oss's clamped SwiGLU, dense MLP, experts and router equal transformers' GptOssExperts / GptOssMLP."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.gpt_oss_mlp import (BiasedTopKRouter, ClampedSwiGLUExperts, ClampedSwiGLUMLP, clamped_swiglu,
                                         deinterleave)
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import gather_canonical
from tests.layers.canonical import close, load_canonical

H, F, E, K = 16, 12, 4, 2


def _hf(num_experts=E):
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=num_experts, num_experts_per_tok=K,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    hf = GptOssMLP(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 1.5)  # large enough that both clamps act
    return hf


def _expert_tensors(experts, prefix: str) -> dict:
    """meshtron's canonical tensors of Hugging Face's GptOssExperts."""
    out = {}
    gate_w, up_w = deinterleave(experts.gate_up_proj.detach(), -1)  # [E, H, F] each
    gate_b, up_b = deinterleave(experts.gate_up_proj_bias.detach(), -1)
    for e in range(experts.num_experts):
        out.update({f"{prefix}.{e}.gate.weight": gate_w[e].T, f"{prefix}.{e}.up.weight": up_w[e].T,
                    f"{prefix}.{e}.gate.bias": gate_b[e], f"{prefix}.{e}.up.bias": up_b[e],
                    f"{prefix}.{e}.down.weight": experts.down_proj[e].detach().T,
                    f"{prefix}.{e}.down.bias": experts.down_proj_bias[e].detach()})
    return out


class _Grads:
    """The gradients of GptOssExperts under its parameters' names."""

    def __init__(self, experts):
        self.num_experts = experts.num_experts
        for n, p in experts.named_parameters():
            setattr(self, n, p.grad)


def test_clamped_swiglu_equals_transformers_activation():
    hf = _hf()
    h = torch.randn(50, 2 * F) * 6  # beyond the limit on both sides
    gate, up = deinterleave(h)
    torch.testing.assert_close(clamped_swiglu(torch.cat([gate, up], -1)), hf.experts._apply_gate(h), rtol=0, atol=0)


def test_moe_equals_transformers_gpt_oss_mlp():
    """Router (top-k of biased logits, softmax over them) and experts with biases, forward and gradients."""
    hf = _hf()
    router = BiasedTopKRouter("layers.0.mlp.router", H, E, K)
    experts = ClampedSwiGLUExperts(ParallelContext(), "layers.0.mlp.experts", H, F, 0, E)
    load_canonical(router, {"layers.0.mlp.router.weight": hf.router.weight.detach(),
                            "layers.0.mlp.router.bias": hf.router.bias.detach()})
    load_canonical(experts, _expert_tensors(hf.experts, "layers.0.mlp.experts"))
    x = torch.randn(2, 9, H)
    x_hf, x_ours = x.clone().requires_grad_(), x.reshape(-1, H).clone().requires_grad_()
    y_hf, scores_hf = hf(x_hf)

    routing = router(x_ours)
    _, idx_hf = torch.topk(hf.router(x.reshape(-1, H))[0], K, dim=-1)
    assert torch.equal(routing.indices, idx_hf)
    close(routing.probs, scores_hf, "combine weights")
    # tokens grouped by expert through the experts, weighted and summed back per token
    flat = routing.indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    rows = experts(x_ours[token], routing.tokens_per_expert)
    y = torch.zeros_like(x_ours).index_add(0, token, rows * routing.probs.reshape(-1)[order, None])
    close(y.view_as(y_hf), y_hf, "output")
    w = torch.randn_like(y_hf)
    (y_hf * w).sum().backward()
    (y * w.reshape(-1, H)).sum().backward()
    close(x_ours.grad.view_as(x_hf), x_hf.grad, "input gradient")
    grads = gather_canonical([router, experts], "grad")
    close(grads["layers.0.mlp.router.weight"], hf.router.weight.grad, "router weight")
    close(grads["layers.0.mlp.router.bias"], hf.router.bias.grad, "router bias")
    ref = _expert_tensors(_Grads(hf.experts), "layers.0.mlp.experts")
    for name, g in ref.items():
        close(grads[name], g, name)


def test_dense_mlp_equals_one_transformers_expert():
    hf = _hf(num_experts=1)
    mlp = ClampedSwiGLUMLP(ParallelContext(), "layers.0.mlp", H, F)
    tensors = _expert_tensors(hf.experts, "layers.0.mlp.experts")
    load_canonical(mlp, {k.replace("experts.0.", ""): v for k, v in tensors.items()})
    x = torch.randn(7, 3, H)
    ones = torch.ones(21, 1)
    y_hf = hf.experts(x.reshape(-1, H), torch.zeros(21, 1, dtype=torch.long), ones)
    close(mlp(x).reshape(-1, H), y_hf, "output")
