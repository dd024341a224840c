"""The hand formula of presets.count_parameters agrees with the model as built: every preset, and
multi-latent attention variants, counted from the canonical tensors of a meta-device build."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.build import built_parameter_count
from meshtron.config import MeshtronConfig, ModelConfig, num_kv_heads
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


# ------------------------------------------------------------------ presets vs Hugging Face (MoE, Qwen3.5)
def _yarn(mscale: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32.0, "beta_slow": 1.0}


_QWEN3_MOE = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})

#: preset -> (transformers class name, the published config.json's values)
HF_SHAPES = {
    "deepseek-v3": ("DeepseekV3", dict(rope_parameters=_yarn(1.0), max_position_embeddings=163840,
                                       aux_loss_alpha=0.0001, seq_aux=True)),  # the class defaults are V3's
    "deepseek-v2-lite": ("DeepseekV2", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=False, rope_parameters=_yarn(0.707), max_position_embeddings=163840,
        rms_norm_eps=1e-6, aux_loss_alpha=0.001, seq_aux=True)),
    "qwen3-30b-a3b": ("Qwen3Moe", dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                       num_attention_heads=32, moe_intermediate_size=768)),
    "qwen3-235b-a22b": ("Qwen3Moe", dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                         num_attention_heads=64, moe_intermediate_size=1536)),
    # the class defaults are gpt-oss-20b's, but for the published router loss coefficient
    "gpt-oss-20b": ("GptOss", dict(num_hidden_layers=24, num_local_experts=32, router_aux_loss_coef=0.9)),
    "gpt-oss-120b": ("GptOss", dict(num_hidden_layers=36, num_local_experts=128, router_aux_loss_coef=0.9)),
    "qwen3.5-35b-a3b": ("Qwen3_5Moe", {}),  # the text config's defaults are Qwen3.5-35B-A3B's
    "qwen3.5-9b": ("Qwen3_5", {}),  # the dense text config's defaults, documented as the Qwen3.5-9B style one
}
#: families whose config class is not ``<family>Config`` (Qwen3.5's is the multimodal one; its text config's)
_CONFIG_CLASS = {"Qwen3_5Moe": "Qwen3_5MoeTextConfig", "Qwen3_5": "Qwen3_5TextConfig"}
#: the ModelConfig fields a preset must share with the model converted from its Hugging Face config
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                 "kv_channels", "vocab_size", "norm_epsilon", "rotary_base", "max_position_embeddings",
                 "untie_embeddings_and_output_weights", "qk_layernorm", "multi_latent_attention", "q_lora_rank",
                 "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                 "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
                 "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
                 "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_num_groups",
                 "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                 "moe_first_dense_layers", "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                 "layer_pattern", "disable_bias_linear", "sliding_window_size", "yarn_truncate", "yarn_beta_fast",
                 "yarn_beta_slow", "swiglu_clamp_limit", "swiglu_clamp_alpha", "zero_centred_norm", "rotary_percent",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")


@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_preset_equals_the_hugging_face_model(name):
    """The preset is the published config.json converted (every shape and routing field), and its parameter count
    is that of transformers' model built from that config on the meta device (no memory)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from meshtron.checkpoint.hf import config_from_hf

    family, values = HF_SHAPES[name]
    hf_cfg = getattr(transformers, _CONFIG_CLASS.get(family, f"{family}Config"))(**values)
    converted = config_from_hf(hf_cfg.to_dict(), []).model
    m = ModelConfig()
    apply_preset(m, name)
    assert {f: getattr(m, f) for f in _SHAPE_FIELDS} == {f: getattr(converted, f) for f in _SHAPE_FIELDS}
    if name.startswith("qwen3-"):
        assert num_kv_heads(m) == num_kv_heads(converted) == 4
    with torch.device("meta"):
        hf_model = getattr(transformers, f"{family}ForCausalLM")(hf_cfg)
    hf_count = sum(p.numel() for p in hf_model.parameters())  # not buffers (V3's expert bias is one)
    assert count_parameters(m)["total"] == hf_count == PRESETS[name][1]
