"""MoE presets: published totals and activated parameters, and the layers the model builds."""

from __future__ import annotations

import pytest

from meshtron.config import ModelConfig
from meshtron.layer_kinds.pattern import is_moe_layer
from meshtron.presets import apply_preset, count_parameters


def preset(name: str) -> ModelConfig:
    m = ModelConfig()
    apply_preset(m, name)
    return m


def test_deepseek_moe_16b_counts():
    m = preset("deepseek-moe-16b")
    counts = count_parameters(m)
    assert counts["total"] == pytest.approx(16.4e9, rel=0.005)  # "16.4B" (DeepSeekMoE paper)
    # Activated per token: 2.8B in the paper (input embedding included; FLOPs exclude it).
    assert counts["matmul"] + counts["embedding"] == pytest.approx(2.8e9, rel=0.02)
    assert [is_moe_layer(m, i) for i in range(m.num_layers)] == [False] + [True] * 27


def test_active_experts_only_in_flops_count():
    m = preset("mixtral-8x7b")
    dense_like = count_parameters(m)
    m.moe_router_topk = 1
    one = count_parameters(m)
    H, F = m.hidden_size, m.ffn_hidden_size
    assert dense_like["matmul"] - one["matmul"] == m.num_layers * 3 * H * F  # one expert fewer per layer
    assert dense_like["total"] == one["total"]
