"""The hand formula of presets.count_parameters agrees with the model as built: every preset, and
multi-latent attention variants, counted from the canonical tensors of a meta-device build."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.build import built_parameter_count
from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.presets import PRESETS, apply_preset, count_parameters

VOCAB = 1000  # for presets that leave the vocabulary to the tokenizer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_count_equals_the_built_model(name):
    cfg = MeshtronConfig()
    apply_preset(cfg.model, name)
    vocab = cfg.model.vocab_size or VOCAB
    assert count_parameters(cfg.model, vocab)["total"] == built_parameter_count(cfg, vocab)


def _mla(**kw) -> ModelConfig:
    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=32,
                       normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                       disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                       multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=16, qk_head_dim=6,
                       qk_pos_emb_head_dim=4, v_head_dim=5)
    return dataclasses.replace(base, **kw)


@pytest.mark.parametrize("model", [_mla(), _mla(q_lora_rank=None), _mla(disable_bias_linear=False,
                                                                        normalization="LayerNorm"),
                                   _mla(num_experts=4, moe_ffn_hidden_size=16, moe_first_dense_layers=1,
                                        moe_shared_expert_intermediate_size=16)],
                         ids=["mla", "mla-no-q-lora", "mla-bias-layernorm", "mla-moe"])
def test_multi_latent_attention_count_equals_the_built_model(model):
    cfg = MeshtronConfig()
    cfg.model = model
    assert count_parameters(model, 96)["total"] == built_parameter_count(cfg, 96)
