"""Hugging Face Llama-family <-> meshtron: tensor names and configurations.

Covers ``LlamaForCausalLM`` (Llama 2, Llama 3/3.1/3.2 with their RoPE frequency
scaling), ``MistralForCausalLM``, ``MixtralForCausalLM``, ``Qwen2ForCausalLM`` (Qwen2 and
Qwen2.5: Llama with biases on the query/key/value projections, ``--add-qkv-bias``) and
``Qwen3ForCausalLM`` (dense Qwen3: an RMSNorm over each query and key head, ``--qk-layernorm``,
and a head dimension of its own, ``--kv-channels``). All use RoPE's
rotate-half convention, as meshtron does, so query/key weights map without any
permutation; grouped-query attention maps to ``--group-query-attention
--num-query-groups``.

Mixtral's sparse MoE block maps onto meshtron's MoE layer: the gate is the router
(``layers.N.mlp.router.weight``) and expert E's ``w1``/``w3``/``w2`` are its
gate/up/down projections (``layers.N.mlp.experts.E.{gate,up,down}.weight``). Files
written by ``save_pretrained`` use those per-expert names under ``block_sparse_moe``;
transformers 5's fused in-memory layout (``mlp.experts.gate_up_proj`` [E, 2F, H],
``mlp.experts.down_proj`` [E, H, F], ``mlp.gate.weight``) is read as well. Exports use
the per-expert names, which transformers 4 and 5 both load.

Routing: Mixtral takes the softmax over all experts, keeps the top k and renormalises
them; this equals meshtron's default softmax router (top k of the logits, softmax over
those k), since softmax preserves the order and the renormalised probabilities are
``exp(l_i) / sum_topk exp(l_j)``. Both are dropless (no capacity factor).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import MeshtronConfig, ModelConfig, ffn_size, head_dim, num_kv_heads

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_NAMES = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3"}

_LAYER_MAP = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.q_proj.weight": "attention.q.weight",
    "self_attn.k_proj.weight": "attention.k.weight",
    "self_attn.v_proj.weight": "attention.v.weight",
    "self_attn.q_proj.bias": "attention.q.bias",  # Qwen2
    "self_attn.k_proj.bias": "attention.k.bias",
    "self_attn.v_proj.bias": "attention.v.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.o_proj.weight": "attention.o.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "output.weight",
}
_EXPERT_MAP = {"w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_MAP_BACK = {v: k for k, v in _EXPERT_MAP.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Mixtral as saved on the hub (and by save_pretrained in transformers 4 and 5).
_HF_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
_HF_ROUTER = re.compile(r"^(?:block_sparse_moe|mlp)\.gate\.weight$")
# transformers 5's fused in-memory expert tensors, [E, 2F, H] (gate rows, then up rows) and [E, H, F].
_HF_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_HF_FUSED_DOWN = "mlp.experts.down_proj"
_MESHTRON_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)\.weight$")
_MESHTRON_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_MAP_BACK = {v: k for k, v in _LAYER_MAP.items()}
_GLOBAL_MAP_BACK = {v: k for k, v in _GLOBAL_MAP.items()}
# Buffers some exporters include; they are recomputed from the config.
_IGNORED_HF = re.compile(r"\.rotary_emb\.inv_freq$")


def hf_to_meshtron_name(name: str) -> Optional[str]:
    """Canonical meshtron name of a Hugging Face tensor (None for derived buffers such as inv_freq)."""
    if _IGNORED_HF.search(name):
        return None
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = _HF_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _LAYER_MAP:
            return f"layers.{layer}.{_LAYER_MAP[rest]}"
        if _HF_ROUTER.match(rest):
            return f"layers.{layer}.mlp.router.weight"
        expert = _HF_EXPERT.match(rest)
        if expert:
            return f"layers.{layer}.mlp.experts.{expert.group(1)}.{_EXPERT_MAP[expert.group(2)]}.weight"
    raise CheckpointError(f"unexpected tensor {name!r} in the Hugging Face checkpoint (supported: Llama, "
                          "Mistral and Mixtral without biases, Qwen2 with query/key/value biases, dense Qwen3)")


def hf_to_meshtron_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Canonical meshtron (name, tensor) pairs of one Hugging Face tensor.

    One pair for most tensors, none for derived buffers, and one per expert projection for
    transformers 5's fused Mixtral expert tensors.
    """
    m = _HF_LAYER.match(name)
    if m and m.group(2) in (_HF_FUSED_GATE_UP, _HF_FUSED_DOWN):
        prefix = f"layers.{m.group(1)}.mlp.experts"
        if tensor.dim() != 3:
            raise CheckpointError(f"{name}: expected a 3-d [experts, out, in] tensor, got shape "
                                  f"{tuple(tensor.shape)}")
        if m.group(2) == _HF_FUSED_DOWN:
            return [(f"{prefix}.{e}.down.weight", tensor[e]) for e in range(tensor.shape[0])]
        if tensor.shape[1] % 2:
            raise CheckpointError(f"{name}: the gate/up dimension {tensor.shape[1]} is odd")
        out = []
        for e in range(tensor.shape[0]):
            gate, up = tensor[e].chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate.weight", gate), (f"{prefix}.{e}.up.weight", up)]
        return out
    canonical = hf_to_meshtron_name(name)
    return [] if canonical is None else [(canonical, tensor)]


def meshtron_to_hf_name(name: str) -> str:
    """Hugging Face name of a canonical meshtron tensor."""
    if name in _GLOBAL_MAP_BACK:
        return _GLOBAL_MAP_BACK[name]
    m = _MESHTRON_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        if rest in _LAYER_MAP_BACK:
            return f"model.layers.{layer}.{_LAYER_MAP_BACK[rest]}"
        if rest == "mlp.router.weight":
            return f"model.layers.{layer}.block_sparse_moe.gate.weight"
        expert = _MESHTRON_EXPERT.match(rest)
        if expert:
            return (f"model.layers.{layer}.block_sparse_moe.experts.{expert.group(1)}."
                    f"{_EXPERT_MAP_BACK[expert.group(2)]}.weight")
    raise CheckpointError(f"tensor {name!r} has no Hugging Face Llama/Mistral/Mixtral/Qwen2/Qwen3 equivalent")


def _rope_settings(hf: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from either the transformers-4 keys or the transformers-5 ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise CheckpointError(f"config.json: RoPE scaling type {kind!r} is not supported (meshtron implements "
                                  "Llama 3.1's 'llama3' scaling)")
        elif (float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))) != (1.0, 4.0):
            raise CheckpointError("config.json: llama3 RoPE scaling with low_freq_factor != 1 or high_freq_factor "
                                  "!= 4 is not supported")
    return float(theta), scaling


def config_from_hf(hf: dict, notices: list[str]) -> MeshtronConfig:
    """A meshtron configuration of the model that a Hugging Face ``config.json`` describes."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise CheckpointError(f"config.json: model_type {kind!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf.get('hidden_act')!r} is not supported (SwiGLU needs silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("config.json: attention_bias/mlp_bias are not supported (meshtron's Llama has no "
                              "biases)")
    heads, kv = int(hf["num_attention_heads"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope_settings(hf)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if kind in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size that applies only with use_sliding_window
    if window is not None and int(window) < max_pos:
        notices.append(f"config.json: sliding_window {window}: meshtron attends over the whole context, which "
                       f"equals sliding-window attention for sequences up to {window} tokens")
    values: dict[str, Any] = dict(
        num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden, ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads, group_query_attention=kv != heads, num_query_groups=kv,
        kv_channels=int(hf["head_dim"]) if hf.get("head_dim") and int(hf["head_dim"]) != hidden // heads else None,
        seq_length=min(max_pos, 4096), max_position_embeddings=max_pos, normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-5)), swiglu=True, position_embedding_type="rope",
        rotary_base=theta, use_rope_scaling=scaling is not None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), disable_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)), vocab_size=int(hf["vocab_size"]),
        add_qkv_bias=kind == "qwen2", qk_layernorm=kind == "qwen3",
    )
    if scaling is not None:
        values["rope_scaling_factor"] = float(scaling["factor"])
        values["rope_original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if kind == "mixtral":
        values.update(_mixtral_settings(hf, notices))
    cfg = MeshtronConfig()
    for key, value in values.items():
        cfg.set(key, value)
    return cfg


def _mixtral_settings(hf: dict, notices: list[str]) -> dict[str, Any]:
    """meshtron MoE flags for a Mixtral ``config.json``: every layer MoE, dropless softmax top-k routing."""
    experts, topk = int(hf.get("num_local_experts", 8)), int(hf.get("num_experts_per_tok", 2))
    if not 1 <= topk <= experts:
        raise CheckpointError(f"config.json: num_experts_per_tok {topk} must be between 1 and num_local_experts "
                              f"{experts}")
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
        notices.append(f"config.json: router_jitter_noise {hf['router_jitter_noise']}: meshtron's router adds "
                       "no jitter noise while training (inference is unaffected)")
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(hf["intermediate_size"]),
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0) or 0.0))


def _moe_problems(m: ModelConfig) -> list[str]:
    """What a Hugging Face Mixtral cannot represent of a meshtron MoE model."""
    problems = []
    if m.moe_shared_expert_intermediate_size:
        problems.append("--moe-shared-expert-intermediate-size (Mixtral has no shared experts)")
    if m.moe_first_dense_layers or m.moe_layer_freq != 1:
        problems.append("dense layers between MoE layers (--moe-first-dense-layers/--moe-layer-freq: every "
                        "Mixtral layer is MoE)")
    if m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax:
        problems.append(f"--moe-router-score-function {m.moe_router_score_function}"
                        f"{' with --moe-router-pre-softmax' if m.moe_router_pre_softmax else ''} (Mixtral "
                        "renormalises the softmax over the top-k experts: softmax without --moe-router-pre-softmax)")
    if m.moe_router_enable_expert_bias:
        problems.append("--moe-router-enable-expert-bias (Mixtral's router has no expert bias)")
    if m.moe_expert_capacity_factor is not None:
        problems.append(f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor} (Mixtral never drops "
                        "tokens)")
    return problems


def default_architecture(m: ModelConfig) -> str:
    """The Hugging Face architecture to export to when none is named: mixtral for MoE, qwen3 with
    query/key head norms, qwen2 with query/key/value biases, else llama."""
    if m.num_experts:
        return "mixtral"
    if m.qk_layernorm:
        return "qwen3"
    return "qwen2" if m.add_qkv_bias else "llama"


def check_exportable(m: ModelConfig, architecture: str = "llama") -> None:
    """Raise CheckpointError listing what the Hugging Face ``architecture`` cannot represent."""
    problems = []
    if m.normalization != "RMSNorm":
        problems.append(f"--normalization {m.normalization} (Llama uses RMSNorm)")
    if not m.swiglu:
        problems.append("no --swiglu (Llama's MLP is SwiGLU)")
    if m.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {m.position_embedding_type} (Llama uses rope)")
    if not m.disable_bias_linear:
        problems.append(f"linear biases ({_NAMES.get(architecture, architecture)} has none on its other "
                        "projections: --disable-bias-linear)")
    if architecture == "qwen2" and not m.add_qkv_bias:
        problems.append("no --add-qkv-bias (Qwen2 has biases on the query/key/value projections: export as llama)")
    if architecture != "qwen2" and m.add_qkv_bias:
        problems.append("--add-qkv-bias (query/key/value biases: export with --hf-architecture qwen2)")
    if architecture == "qwen3" and not m.qk_layernorm:
        problems.append("no --qk-layernorm (Qwen3 normalises each query and key head)")
    if architecture != "qwen3" and m.qk_layernorm:
        problems.append("--qk-layernorm (query/key head norms: export with --hf-architecture qwen3)")
    if architecture == "mixtral":
        if not m.num_experts:
            problems.append("no --num-experts (Mixtral is a mixture of experts: export a dense model as llama or "
                            "mistral)")
        else:
            problems += _moe_problems(m)
    elif m.num_experts:
        problems.append("mixture of experts (--num-experts: export it with --hf-architecture mixtral)")
    if problems:
        name = _NAMES.get(architecture, architecture)
        raise CheckpointError(f"this checkpoint cannot be written as a Hugging Face {name} model", problems)


def hf_config(m: ModelConfig, vocab_size: int, architecture: str, dtype_name: str,
              eos_id: Optional[int], bos_id: Optional[int]) -> dict:
    """A ``config.json`` for ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``MixtralForCausalLM`` (read by
    transformers 4 and 5)."""
    theta = float(m.rotary_base)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rope_scaling = None
    if m.use_rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": float(m.rope_scaling_factor), "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": int(m.rope_original_max_position_embeddings)}
        rope_parameters = {**rope_scaling, "rope_theta": theta}
    cfg = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": int(vocab_size),
        "hidden_size": m.hidden_size,
        "intermediate_size": (m.moe_ffn_hidden_size or ffn_size(m)) if architecture == "mixtral" else ffn_size(m),
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": num_kv_heads(m),
        "head_dim": head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": int(m.max_position_embeddings or m.seq_length),
        "rms_norm_eps": float(m.norm_epsilon),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "initializer_range": float(m.init_method_std),
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if architecture == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif architecture in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
        if architecture == "qwen3":
            cfg["attention_bias"] = False
    else:
        cfg["sliding_window"] = None
    if architecture == "mixtral":
        cfg.update(num_local_experts=int(m.num_experts), num_experts_per_tok=int(m.moe_router_topk),
                   router_aux_loss_coef=float(m.moe_aux_loss_coeff or 0.0), router_jitter_noise=0.0,
                   output_router_logits=False)
    return cfg
