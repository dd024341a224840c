"""Hugging Face gpt-oss (``GptOssForCausalLM``) <-> meshtron: configuration and tensors.

A gpt-oss layer is a ``sink`` or ``sink_window`` mixer (``layer_types`` ``full_attention`` /
``sliding_attention``) and an ``oss_moe`` MLP. Names: attention as the kinds map them (``self_attn.sinks``
included); the router's ``mlp.router.{weight,bias}`` keep their names; the experts are fused in Hugging
Face's files, input-major and with gate and up columns interleaved:

    gate_up_proj [E, H, 2F] (gate, up, gate, up, ...)   ->  experts.e.gate.weight, experts.e.up.weight [F, H]
    gate_up_proj_bias [E, 2F]                            ->  experts.e.gate.bias, experts.e.up.bias [F]
    down_proj [E, F, H], down_proj_bias [E, H]           ->  experts.e.down.weight [H, F], experts.e.down.bias

The rotary tables are YaRN's with the ramp's ends kept fractional (``truncate: false``, --no-yarn-truncate)
and the cos/sin factor 0.1 ln(factor) + 1 (--mscale 1, --mscale-all-dim 0).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import MeshtronConfig, ModelConfig, ffn_size, head_dim, num_kv_heads
from meshtron.layer_kinds.pattern import format_pattern, layer_kinds

ARCHITECTURE = "gpt_oss"
_MIXERS = {"sliding_attention": "sink_window", "full_attention": "sink"}
_LAYER_TYPES = {v: k for k, v in _MIXERS.items()}
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.router\.(weight|bias)$")
_OURS_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)\.(weight|bias)$")
_OURS_ROUTER = re.compile(r"^layers\.(\d+)\.mlp\.router\.(weight|bias)$")


def architecture(m: ModelConfig) -> str:
    """The Hugging Face architecture of a gpt-oss model: gpt_oss."""
    return ARCHITECTURE


def claims(m: ModelConfig) -> bool:
    """Whether ``m`` is a gpt-oss model (a layer with a sink mixer or an ``oss_moe`` MLP)."""
    return any(k.mixer.name in _LAYER_TYPES or k.mlp.name == "oss_moe" for k in layer_kinds(m))


# ------------------------------------------------------------------------------------------ configuration
def _rope(hf: dict) -> dict[str, Any]:
    """meshtron's RoPE fields of a gpt-oss ``config.json`` (transformers 5's ``rope_parameters`` or 4's keys)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=theta, rope_type="rope")
    if kind != "yarn":
        raise CheckpointError(f"config.json: gpt-oss RoPE type {kind!r} is not supported (yarn or default)")
    if params.get("attention_factor") is not None or params.get("mscale") or params.get("mscale_all_dim"):
        raise CheckpointError("config.json: gpt-oss YaRN with attention_factor/mscale is not supported (meshtron "
                              "reads the default factor 0.1 ln(factor) + 1)")
    return dict(rotary_base=theta, rope_type="yarn", rotary_scaling_factor=float(params["factor"]),
                yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                yarn_beta_fast=float(params.get("beta_fast", 32.0)), yarn_beta_slow=float(params.get("beta_slow", 1.0)),
                yarn_truncate=bool(params.get("truncate", True)), mscale=1.0, mscale_all_dim=0.0)


def config_from_hf(hf: dict, notices: list[str]) -> MeshtronConfig:
    """A meshtron configuration of a gpt-oss ``config.json``."""
    if hf.get("attention_bias", True) is False:
        raise CheckpointError("config.json: gpt-oss without attention_bias is not supported (meshtron's biases "
                              "are on every projection or none: --disable-bias-linear)")
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(_MIXERS))
    if unknown or len(types) != layers:
        raise CheckpointError(f"config.json: layer_types must name {layers} layers of {', '.join(_MIXERS)}; got "
                              f"{len(types)} with {unknown or 'no'} other types")
    heads, kv, max_pos = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"]), int(
        hf.get("max_position_embeddings", 131072))
    experts, topk = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
    values: dict[str, Any] = dict(
        num_layers=layers, hidden_size=int(hf["hidden_size"]), ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads, group_query_attention=kv != heads, num_query_groups=kv,
        kv_channels=int(hf["head_dim"]), seq_length=min(max_pos, 4096), max_position_embeddings=max_pos,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-5)), swiglu=True,
        position_embedding_type="rope", untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        disable_bias_linear=False, hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)), vocab_size=int(hf["vocab_size"]),
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(hf["intermediate_size"]),
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
        swiglu_clamp_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_clamp_alpha=float(hf.get("swiglu_alpha", 1.702)),
        sliding_window_size=int(hf["sliding_window"]) if hf.get("sliding_window") else None,
        layer_pattern=format_pattern([f"{_MIXERS[t]}+oss_moe" for t in types]), **_rope(hf))
    cfg = MeshtronConfig()
    for key, value in values.items():
        cfg.set(key, value)
    return cfg


def hf_config(m: ModelConfig, vocab_size: int, dtype_name: str, eos_id: Optional[int],
              bos_id: Optional[int]) -> dict:
    """A gpt-oss ``config.json`` (read by transformers 5)."""
    theta = float(m.rotary_base)
    if m.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(m.rotary_scaling_factor),
                "beta_fast": float(m.yarn_beta_fast), "beta_slow": float(m.yarn_beta_slow),
                "truncate": bool(m.yarn_truncate),
                "original_max_position_embeddings": int(m.yarn_original_max_position_embeddings)}
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": ARCHITECTURE, "vocab_size": int(vocab_size),
        "hidden_size": m.hidden_size, "intermediate_size": m.moe_ffn_hidden_size or ffn_size(m),
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": num_kv_heads(m), "head_dim": head_dim(m), "num_local_experts": int(m.num_experts),
        "num_experts_per_tok": int(m.moe_router_topk), "sliding_window": m.sliding_window_size or 0,
        "layer_types": [_LAYER_TYPES[k.mixer.name] for k in layer_kinds(m)],
        "max_position_embeddings": int(m.max_position_embeddings or m.seq_length),
        "rms_norm_eps": float(m.norm_epsilon), "rope_parameters": rope, "rope_scaling": rope, "rope_theta": theta,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": True,
        "attention_dropout": 0.0, "initializer_range": float(m.init_method_std),
        "router_aux_loss_coef": float(m.moe_aux_loss_coeff or 0.0), "output_router_logits": False,
        "swiglu_limit": float(m.swiglu_clamp_limit), "swiglu_alpha": float(m.swiglu_clamp_alpha),
        "hidden_act": "silu", "use_cache": True, "torch_dtype": dtype_name, "dtype": dtype_name,
        "bos_token_id": bos_id, "eos_token_id": eos_id,
    }


def check_exportable(m: ModelConfig) -> list[str]:
    """What a Hugging Face gpt-oss cannot represent of ``m``."""
    problems = []
    if m.normalization != "RMSNorm":
        problems.append(f"--normalization {m.normalization} (gpt-oss uses RMSNorm)")
    if m.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {m.position_embedding_type} (gpt-oss uses rope)")
    if m.disable_bias_linear:
        problems.append("--disable-bias-linear (gpt-oss has biases on its projections and experts)")
    others = sorted({k.entry for k in layer_kinds(m)
                     if k.mixer.name not in _LAYER_TYPES or k.mlp.name != "oss_moe"})
    if others:
        problems.append(f"--layer-pattern entries {', '.join(others)} (every gpt-oss layer is sink or "
                        "sink_window with oss_moe)")
    if m.rope_type == "yarn" and (m.mscale != 1.0 or m.mscale_all_dim != 0.0):
        problems.append("--mscale/--mscale-all-dim other than 1 and 0 (gpt-oss's YaRN factor is 0.1 ln(factor) + 1)")
    if m.mtp_num_layers:
        problems.append(f"--mtp-num-layers {m.mtp_num_layers} (gpt-oss has no multi-token prediction)")
    return problems


# ------------------------------------------------------------------------------------------ tensors
def _pairs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a tensor whose last dimension alternates gate and up entries."""
    return t[..., 0::2], t[..., 1::2]


def tensors_from_hf(name: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
    """meshtron (name, tensor) pairs of a gpt-oss MLP tensor; None for the others (named as the kinds say)."""
    router = _ROUTER.match(name)
    if router:
        return [(f"layers.{router.group(1)}.mlp.router.{router.group(2)}", tensor)]
    fused = _FUSED.match(name)
    if not fused:
        return None
    prefix, kind = f"layers.{fused.group(1)}.mlp.experts", fused.group(2)
    want = 3 if kind in ("gate_up_proj", "down_proj") else 2
    if tensor.dim() != want:
        raise CheckpointError(f"{name}: expected a {want}-d tensor, got shape {tuple(tensor.shape)}")
    E = tensor.shape[0]
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down.weight", tensor[e].T) for e in range(E)]
    if kind == "down_proj_bias":
        return [(f"{prefix}.{e}.down.bias", tensor[e]) for e in range(E)]
    gate, up = _pairs(tensor)
    suffix = "weight" if kind == "gate_up_proj" else "bias"
    flip = (lambda t: t.T) if suffix == "weight" else (lambda t: t)  # [H, F] -> [F, H]
    return [pair for e in range(E) for pair in ((f"{prefix}.{e}.gate.{suffix}", flip(gate[e])),
                                                (f"{prefix}.{e}.up.{suffix}", flip(up[e])))]


def tensors_to_hf(tensors: dict[str, torch.Tensor], name_of) -> dict[str, torch.Tensor]:
    """Every canonical tensor under its gpt-oss name; ``name_of(name)`` names those outside the MLP."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        router = _OURS_ROUTER.match(name)
        expert = _OURS_EXPERT.match(name)
        if router:
            out[f"model.layers.{router.group(1)}.mlp.router.{router.group(2)}"] = t
        elif expert:
            layer, e, part, suffix = expert.groups()
            experts.setdefault((layer, suffix), {}).setdefault(int(e), {})[part] = t
        else:
            out[name_of(name)] = t
    for (layer, suffix), per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        base = f"model.layers.{layer}.mlp.experts."
        if suffix == "weight":
            gate = torch.stack([p["gate"].T for p in order])  # [E, H, F]
            up = torch.stack([p["up"].T for p in order])
            out[base + "down_proj"] = torch.stack([p["down"].T for p in order]).contiguous()  # [E, F, H]
            out[base + "gate_up_proj"] = torch.stack([gate, up], -1).flatten(-2).contiguous()
        else:
            gate, up = torch.stack([p["gate"] for p in order]), torch.stack([p["up"] for p in order])
            out[base + "down_proj_bias"] = torch.stack([p["down"] for p in order]).contiguous()
            out[base + "gate_up_proj_bias"] = torch.stack([gate, up], -1).flatten(-2).contiguous()
    return out
