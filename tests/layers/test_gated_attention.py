"""Qwen3.5's gated full attention and zero-centred RMSNorm equal transformers' Qwen3_5Attention and Qwen3_5RMSNorm."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.gated_attention import GatedAttention, ZeroCentredRMSNorm
from meshtron.layers.rotary import inverse_frequencies, rope_tables
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import gather_canonical
from tests.layers.canonical import close, load_canonical

NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "q_norm": "q_norm", "k_norm": "k_norm"}


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_matches_transformers_qwen3_5_attention(rotary_dim):
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    torch.manual_seed(0)
    s, d = 20, 16
    cfg = Qwen3_5TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                            num_hidden_layers=1, layer_types=["full_attention"], vocab_size=64, rms_norm_eps=1e-6,
                            attention_bias=False)
    cfg._attn_implementation = "eager"
    hf = Qwen3_5Attention(cfg, 0).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    prefix = "layers.0.attention"
    canonical = {f"{prefix}.{NAMES[n.split('.')[0]]}.weight": p.detach() for n, p in hf.named_parameters()}
    ours = GatedAttention(ParallelContext(), prefix, 32, 4, 2, d, norm_eps=1e-6)
    load_canonical(ours, canonical)

    positions = torch.arange(s)
    cos, sin = rope_tables(positions, inverse_frequencies(rotary_dim, 10000.0, torch.device("cpu")), torch.float32)
    x = torch.randn(2, s, 32)
    causal = torch.zeros(1, 1, s, s).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    hf_tables = (cos[:, 0, 0][None].expand(2, -1, -1), sin[:, 0, 0][None].expand(2, -1, -1))
    y_hf, _ = hf(x_hf, hf_tables, causal)
    y = ours(x_ours, (cos, sin))
    close(y.transpose(0, 1), y_hf, "output")
    w = torch.randn_like(y_hf)
    (y_hf * w).sum().backward()
    (y * w.transpose(0, 1)).sum().backward()
    close(x_ours.grad.transpose(0, 1), x_hf.grad, "input gradient")
    grads = gather_canonical([ours], "grad")
    for n, p in hf.named_parameters():
        close(grads[f"{prefix}.{NAMES[n.split('.')[0]]}.weight"], p.grad, n)


def test_zero_centred_rms_norm_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    torch.manual_seed(0)
    hf = Qwen3_5RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(24) * 0.3)
    ours = ZeroCentredRMSNorm("layers.0.input_layernorm", 24, 1e-6)
    load_canonical(ours, {"layers.0.input_layernorm.weight": hf.weight.detach()})
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 24).to(dtype)
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-6, atol=1e-6)
