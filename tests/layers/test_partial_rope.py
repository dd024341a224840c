"""--rotary-percent in gqa layers (Megatron-LM's partial RoPE): the first int(head_dim x percent) dimensions of each
query/key head turn, the rest do not; the kinds that rotate the whole head refuse it. Against megatron-core's own
model: tests/checkpoint/test_megatron_variants.py (``rope_partial_interleaved_tp2``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.hf import check_exportable
from meshtron.config import ConfigError, ModelConfig
from meshtron.layer_kinds.pattern import check_pattern, layer_kinds
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters


def _small(**kw) -> ModelConfig:
    base = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                       group_query_attention=True, kv_channels=8, ffn_hidden_size=32, seq_length=12,
                       normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True, rotary_percent=0.5)
    return dataclasses.replace(base, **kw)


def _logits_at(model: GPTModel, tokens: torch.Tensor, spacing: int) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, position_ids=torch.arange(tokens.shape[1]) * spacing)


@pytest.mark.parametrize("zeroed,moves", [("rotated", False), ("unrotated", True)])
def test_only_the_first_dimensions_of_a_head_turn(zeroed, moves):
    """--rotary-percent 0.5 with heads of 8: with the query rows of each head's first 4 dimensions zeroed, no score
    depends on positions (the last 4 do not turn), so spreading the positions apart changes no logit; with the last
    4 zeroed instead, the rotated ones remain and the logits move."""
    m = _small()
    assert layer_kinds(m)[0].mixer.rope_dim(m) == 4
    model = GPTModel(m, ParallelContext(), 64)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    model.eval()
    rows = torch.arange(4 * 8).reshape(4, 8)  # query heads x head dim: the first rows of the fused projection
    pick = rows[:, :4] if zeroed == "rotated" else rows[:, 4:]
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.qkv.weight[pick.flatten()] = 0.0
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    diff = (_logits_at(model, tokens, 1) - _logits_at(model, tokens, 3)).abs().max()
    assert (diff > 1e-4) == moves, diff


def test_rotary_percent_checked_per_kind():
    """gqa needs an even number of rotated dimensions; sink attention rotates the whole head (refused); MLA
    ignores it."""
    check_pattern(_small())
    with pytest.raises(ConfigError, match="gqa layers need --rotary-percent .* got 0.2"):
        check_pattern(_small(rotary_percent=0.2))  # 1 of 8 dimensions
    with pytest.raises(ConfigError, match="sink layers rotate the whole head"):
        check_pattern(_small(layer_pattern="sink+dense*2"))
    assert layer_kinds(_small(rotary_percent=1.0))[0].mixer.rope_dim(_small(rotary_percent=1.0)) == 8


def test_hugging_face_llama_configs_refuse_partial_rope():
    with pytest.raises(CheckpointError) as err:
        check_exportable(_small(), "llama")
    assert any("--rotary-percent 0.5" in line for line in err.value.differences)
    check_exportable(_small(rotary_percent=1.0), "llama")
