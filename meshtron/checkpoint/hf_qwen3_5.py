"""Hugging Face Qwen3.5 (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``) and Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``) <-> meshtron: configuration and tensors.

Each layer is a ``gdn`` mixer (``layer_types`` ``linear_attention``, tensors under ``linear_attn.``) or a
``gated_attn`` one (``full_attention``, under ``self_attn.``, named as gqa's), with a ``dense`` MLP (Qwen3.5)
or a ``moe_gated_shared`` one (Qwen3.5-MoE: router ``mlp.gate``, experts as Qwen3-MoE's, the shared expert
``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate``). The layer norms are zero-centred
(``1 + w``, --zero-centred-norm) and store ``w`` on both sides; RoPE turns ``partial_rotary_factor`` of each
head (--rotary-percent). The text model's 1-D positions make its multimodal RoPE sections plain RoPE.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import MeshtronConfig, ModelConfig, ffn_size, head_dim, num_kv_heads
from meshtron.layer_kinds.gated_deltanet import GDN
from meshtron.layer_kinds.pattern import format_pattern, layer_kinds

DENSE, MOE = "qwen3_5_text", "qwen3_5_moe_text"
#: model_type -> (architecture class, the MLP kind of every layer)
TYPES = {DENSE: ("Qwen3_5ForCausalLM", "dense"), MOE: ("Qwen3_5MoeForCausalLM", "moe_gated_shared")}
_MIXERS = {"linear_attention": "gdn", "full_attention": "gated_attn"}
_LAYER_TYPES = {v: k for k, v in _MIXERS.items()}
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$")
_SHARED_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight$")
_OURS_LINEAR = re.compile(r"^layers\.(\d+)\.attention\.(.+)$")
_OURS_SHARED = re.compile(r"^layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)\.weight$")
_OURS_SHARED_GATE = re.compile(r"^layers\.(\d+)\.mlp\.shared_expert_gate\.weight$")
_CONV = "conv1d.weight"


def claims(m: ModelConfig) -> bool:
    """Whether ``m`` is a Qwen3.5 model (a gdn or gated_attn layer, or a moe_gated_shared MLP)."""
    return any(k.mixer.name in _LAYER_TYPES or k.mlp.name == "moe_gated_shared" for k in layer_kinds(m))


def architecture(m: ModelConfig) -> str:
    """qwen3_5_moe_text for a mixture of experts, else qwen3_5_text."""
    return MOE if any(k.mlp.has_experts for k in layer_kinds(m)) else DENSE


# ------------------------------------------------------------------------------------------ configuration
def config_from_hf(hf: dict, notices: list[str]) -> MeshtronConfig:
    """A meshtron configuration of a Qwen3.5 or Qwen3.5-MoE text ``config.json``."""
    kind = hf["model_type"]
    mlp = TYPES[kind][1]
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                      for i in range(layers)]
    unknown = sorted(set(types) - set(_MIXERS))
    if unknown or len(types) != layers:
        raise CheckpointError(f"config.json: layer_types must name {layers} layers of {', '.join(_MIXERS)}; got "
                              f"{len(types)} with {unknown or 'no'} other types")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU needs silu)")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"config.json: RoPE type {rope['rope_type']!r} is not supported for Qwen3.5 (default)")
    heads, kv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    max_pos = int(hf.get("max_position_embeddings", 32768))
    width = int(hf["intermediate_size"]) if hf.get("intermediate_size") else int(hf["moe_intermediate_size"])
    values: dict[str, Any] = dict(
        num_layers=layers, hidden_size=int(hf["hidden_size"]), ffn_hidden_size=width, num_attention_heads=heads,
        group_query_attention=kv != heads, num_query_groups=kv, kv_channels=int(hf["head_dim"]),
        seq_length=min(max_pos, 4096), max_position_embeddings=max_pos, normalization="RMSNorm",
        zero_centred_norm=True, norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
        position_embedding_type="rope", rotary_base=float(rope.get("rope_theta", 10000.0)),
        rotary_percent=float(rope.get("partial_rotary_factor", 0.25)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        disable_bias_linear=not hf.get("attention_bias", False), hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)), vocab_size=int(hf["vocab_size"]),
        linear_num_key_heads=int(hf["linear_num_key_heads"]), linear_num_value_heads=int(hf["linear_num_value_heads"]),
        linear_key_head_dim=int(hf["linear_key_head_dim"]), linear_value_head_dim=int(hf["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
        layer_pattern=format_pattern([f"{_MIXERS[t]}+{mlp}" for t in types]))
    if hf.get("attention_bias"):
        raise CheckpointError("config.json: attention_bias is not supported for Qwen3.5 (meshtron's biases would "
                              "reach its MLPs too)")
    if kind == MOE:
        values.update(num_experts=int(hf["num_experts"]), moe_router_topk=int(hf["num_experts_per_tok"]),
                      moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                      moe_shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                      moe_router_score_function="softmax", moe_router_pre_softmax=False,
                      moe_router_load_balancing_type="aux_loss",
                      moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0) or 0.0))
    cfg = MeshtronConfig()
    for key, value in values.items():
        cfg.set(key, value)
    return cfg


def hf_config(m: ModelConfig, vocab_size: int, dtype_name: str, eos_id: Optional[int],
              bos_id: Optional[int]) -> dict:
    """A Qwen3.5 or Qwen3.5-MoE text ``config.json`` (read by transformers 5)."""
    kind = architecture(m)
    cfg = {
        "architectures": [TYPES[kind][0]], "model_type": kind, "vocab_size": int(vocab_size),
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": num_kv_heads(m), "head_dim": head_dim(m),
        "layer_types": [_LAYER_TYPES[k.mixer.name] for k in layer_kinds(m)],
        "linear_num_key_heads": m.linear_num_key_heads, "linear_num_value_heads": m.linear_num_value_heads,
        "linear_key_head_dim": m.linear_key_head_dim, "linear_value_head_dim": m.linear_value_head_dim,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "hidden_act": "silu",
        "max_position_embeddings": int(m.max_position_embeddings or m.seq_length),
        "rms_norm_eps": float(m.norm_epsilon),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base),
                            "partial_rotary_factor": float(m.rotary_percent)},
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": float(m.init_method_std), "use_cache": True,
        "torch_dtype": dtype_name, "dtype": dtype_name, "bos_token_id": bos_id, "eos_token_id": eos_id,
    }
    if kind == MOE:
        cfg.update(num_experts=int(m.num_experts), num_experts_per_tok=int(m.moe_router_topk),
                   moe_intermediate_size=int(m.moe_ffn_hidden_size or ffn_size(m)),
                   shared_expert_intermediate_size=int(m.moe_shared_expert_intermediate_size),
                   router_aux_loss_coef=float(m.moe_aux_loss_coeff or 0.0), output_router_logits=False)
    else:
        cfg["intermediate_size"] = ffn_size(m)
    return cfg


def check_exportable(m: ModelConfig) -> list[str]:
    """What a Hugging Face Qwen3.5 (or Qwen3.5-MoE) cannot represent of ``m``."""
    problems = []
    if m.normalization != "RMSNorm" or not m.zero_centred_norm:
        problems.append("layer norms other than --normalization RMSNorm --zero-centred-norm (Qwen3.5's are 1 + w)")
    if not m.swiglu:
        problems.append("no --swiglu (Qwen3.5's MLPs are SwiGLU)")
    if m.position_embedding_type != "rope" or (m.rope_type or "rope") != "rope" or m.use_rope_scaling:
        problems.append("positions other than plain RoPE (--position-embedding-type rope, --rope-type rope)")
    if not m.disable_bias_linear or m.add_qkv_bias:
        problems.append("linear biases (Qwen3.5 has none: --disable-bias-linear)")
    mlp = TYPES[architecture(m)][1]
    others = sorted({k.entry for k in layer_kinds(m) if k.mixer.name not in _LAYER_TYPES or k.mlp.name != mlp})
    if others:
        problems.append(f"--layer-pattern entries {', '.join(others)} (every Qwen3.5 layer is gdn or gated_attn with "
                        f"{mlp})")
    if m.mtp_num_layers:
        problems.append(f"--mtp-num-layers {m.mtp_num_layers} (not exported for Qwen3.5)")
    if architecture(m) == MOE and (m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax
                                   or m.moe_router_enable_expert_bias or m.moe_router_num_groups
                                   or m.moe_router_topk_scaling_factor or m.moe_expert_capacity_factor is not None):
        problems.append("routing other than the default softmax over the top-k logits (Qwen3.5-MoE renormalises the "
                        "top-k softmax and never drops tokens)")
    return problems


# ------------------------------------------------------------------------------------------ tensors
def tensors_from_hf(name: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
    """meshtron (name, tensor) pairs of a gated DeltaNet or gated shared expert tensor; None for the others (named
    as the kinds and Qwen3-MoE's experts and router are)."""
    linear = _LINEAR.match(name)
    if linear:
        layer, rest = linear.groups()
        if rest not in GDN.hf_names:
            raise CheckpointError(f"unexpected tensor {name!r} in the Qwen3.5 checkpoint")
        if rest == _CONV:
            if tensor.dim() != 3 or tensor.shape[1] != 1:
                raise CheckpointError(f"{name}: expected [channels, 1, kernel], got shape {tuple(tensor.shape)}")
            tensor = tensor[:, 0]
        return [(f"layers.{layer}.attention.{GDN.hf_names[rest]}", tensor)]
    shared = _SHARED.match(name)
    if shared:
        return [(f"layers.{shared.group(1)}.mlp.shared_experts.{shared.group(2)}.weight", tensor)]
    gate = _SHARED_GATE.match(name)
    if gate:
        return [(f"layers.{gate.group(1)}.mlp.shared_expert_gate.weight", tensor)]
    return None


def tensors_to_hf(tensors: dict[str, torch.Tensor], name_of) -> dict[str, torch.Tensor]:
    """Every canonical tensor under its Qwen3.5 name; ``name_of(name)`` names the others (as gqa's, Qwen3-MoE's)."""
    ours_to_hf = {ours: hf for hf, ours in GDN.hf_names.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        linear, shared, gate = (p.match(name) for p in (_OURS_LINEAR, _OURS_SHARED, _OURS_SHARED_GATE))
        if linear and linear.group(2) in ours_to_hf:
            hf = ours_to_hf[linear.group(2)]
            out[f"model.layers.{linear.group(1)}.linear_attn.{hf}"] = t[:, None] if hf == _CONV else t
        elif shared:
            out[f"model.layers.{shared.group(1)}.mlp.shared_expert.{shared.group(2)}_proj.weight"] = t
        elif gate:
            out[f"model.layers.{gate.group(1)}.mlp.shared_expert_gate.weight"] = t
        else:
            out[name_of(name)] = t
    return out
