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

Qwen3-MoE (``Qwen3MoeForCausalLM``: dense Qwen3's attention, experts under ``mlp.experts.E.{gate,up,down}_proj``)
and DeepSeek-V2/V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: multi-latent attention named by
:mod:`meshtron.layers.mla_hf`, shared experts, V3's expert bias) take their configuration and routing from
:mod:`meshtron.checkpoint.hf_moe`; their fused transformers-5 expert tensors are read as Mixtral's.

Routing: Mixtral takes the softmax over all experts, keeps the top k and renormalises
them; this equals meshtron's default softmax router (top k of the logits, softmax over
those k), since softmax preserves the order and the renormalised probabilities are
``exp(l_i) / sum_topk exp(l_j)``. Both are dropless (no capacity factor).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from meshtron.checkpoint import hf_gpt_oss, hf_moe, hf_qwen3_5
from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import MeshtronConfig, ModelConfig, ffn_size, head_dim, num_kv_heads
from meshtron.layer_kinds import MIXERS, MLPS, MixerKind
from meshtron.layer_kinds.pattern import layer_at, pattern_is_derived, resolved_pattern
from meshtron.layers.mtp import HF_MTP_NAMES, mtp_depths
from meshtron.layers.rotary import rope_kind, rope_table_scale, yarn_mscale

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
_NAMES = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3",
          "qwen3_moe": "Qwen3-MoE", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "gpt_oss": "gpt-oss",
          "qwen3_5_text": "Qwen3.5", "qwen3_5_moe_text": "Qwen3.5-MoE"}
#: Families whose layers are kinds of their own, converted by a module each (``config_from_hf``, ``claims``,
#: ``architecture``, ``tensors_from_hf``, ``tensors_to_hf``, ``check_exportable``, ``hf_config``), by model_type.
FAMILIES = {"gpt_oss": hf_gpt_oss, "qwen3_5_text": hf_qwen3_5, "qwen3_5_moe_text": hf_qwen3_5}


def _family(m: Optional[ModelConfig]):
    """The family module whose model ``m`` is (None: a Llama-style or DeepSeek model, converted here)."""
    return next((module for module in FAMILIES.values() if m is not None and module.claims(m)), None)


def _kind_names(kinds, hf_part: str, our_part: str) -> dict[str, str]:
    """The layer-relative names of every registered kind of one part (they agree where they overlap)."""
    return {f"{hf_part}.{hf}": f"{our_part}.{ours}" for kind in kinds for hf, ours in kind.hf_names.items()}


# A layer's two norms, then its mixer's and its dense MLP's tensors as their kinds name them.
_LAYER_MAP = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **_kind_names(MIXERS.values(), "self_attn", "attention"),
    **_kind_names(MLPS.values(), "mlp", "mlp"),
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
# DeepSeek-V2/V3 and Qwen3-MoE as saved: per-expert SwiGLU projections, shared experts, V3's expert bias.
_HF_EXPERT_PROJ = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_HF_SHARED = re.compile(r"^mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
_HF_EXPERT_BIAS = "mlp.gate.e_score_correction_bias"
# transformers 5's fused in-memory expert tensors, [E, 2F, H] (gate rows, then up rows) and [E, H, F].
_HF_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_HF_FUSED_DOWN = "mlp.experts.down_proj"
_MESHTRON_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)\.weight$")
_MESHTRON_SHARED = re.compile(r"^mlp\.shared_experts\.(gate|up|down)\.weight$")
_MESHTRON_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_MAP_BACK = {v: k for k, v in _LAYER_MAP.items()}
_GLOBAL_MAP_BACK = {v: k for k, v in _GLOBAL_MAP.items()}
# Buffers some exporters include; they are recomputed from the config.
_IGNORED_HF = re.compile(r"\.rotary_emb\.inv_freq$")
# DeepSeek-V3's multi-token prediction layers (model.layers.{num_hidden_layers + k}): each depth's own tensors
# (HF right side -> meshtron name after ``mtp.layers.{k}.``), the copies of the shared embedding and output
# layer, and the decoder layer, named as a main layer's.
_MTP_PREFIX = "mtp.layers.{k}."
_MTP_LAYER = "transformer_layer."
_HF_MTP_OWN = {hf: ours[len(_MTP_PREFIX):] for ours, hf in HF_MTP_NAMES.items()
               if ours.startswith(_MTP_PREFIX) and not ours.startswith(_MTP_PREFIX + _MTP_LAYER)}
_HF_MTP_SHARED = {hf: ours for ours, hf in HF_MTP_NAMES.items() if not ours.startswith(_MTP_PREFIX)}
_MTP_OWN_BACK = {v: k for k, v in _HF_MTP_OWN.items()}
_MESHTRON_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
WORD_EMBEDDING = "embedding.word_embeddings.weight"


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
        if rest == _HF_EXPERT_BIAS:
            return f"layers.{layer}.mlp.router.expert_bias"
        expert = _HF_EXPERT.match(rest)
        if expert:
            return f"layers.{layer}.mlp.experts.{expert.group(1)}.{_EXPERT_MAP[expert.group(2)]}.weight"
        expert = _HF_EXPERT_PROJ.match(rest)
        if expert:
            return f"layers.{layer}.mlp.experts.{expert.group(1)}.{expert.group(2)}.weight"
        shared = _HF_SHARED.match(rest)
        if shared:
            return f"layers.{layer}.mlp.shared_experts.{shared.group(1)}.weight"
    raise CheckpointError(f"unexpected tensor {name!r} in the Hugging Face checkpoint (supported: Llama, "
                          "Mistral and Mixtral without biases, Qwen2 with query/key/value biases, dense Qwen3, "
                          "Qwen3-MoE, DeepSeek-V2/V3)")


def hf_layer_index(name: str) -> Optional[int]:
    """The decoder layer a Hugging Face tensor belongs to (``model.layers.N.``), None for global tensors."""
    m = _HF_LAYER.match(name)
    return int(m.group(1)) if m else None


def hf_to_meshtron_tensors(name: str, tensor: torch.Tensor, model: Optional[ModelConfig] = None,
                           rope_interleave: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Canonical meshtron (name, tensor) pairs of one Hugging Face tensor.

    One pair for most tensors, none for derived buffers, and one per expert projection for
    transformers 5's fused expert tensors. Multi-latent attention tensors need ``model`` (their
    shapes) and ``rope_interleave`` (DeepSeek's interleaved rotary rows, see :mod:`meshtron.layers.mla_hf`).
    """
    family = _family(model)
    pairs = family.tensors_from_hf(name, tensor) if family is not None else None
    if pairs is not None:
        return pairs
    m = _HF_LAYER.match(name)
    if m and model is not None and mtp_depths(model) and int(m.group(1)) >= model.num_layers:
        return _mtp_from_hf(name, int(m.group(1)) - model.num_layers, m.group(2), tensor, model, rope_interleave)
    return _layer_tensors(name, tensor, model, rope_interleave)


def _mtp_from_hf(name: str, depth: int, rest: str, tensor: torch.Tensor, model: ModelConfig,
                 rope_interleave: bool) -> list[tuple[str, torch.Tensor]]:
    """meshtron pairs of a tensor of DeepSeek-V3's multi-token prediction layer ``depth`` (0-based): its own
    norms and projection under ``mtp.layers.{depth}``, its decoder layer under ``...transformer_layer``, and
    its copies of the embedding and output layer under the shared names (the converter checks that they
    equal the model's)."""
    if depth >= mtp_depths(model):
        raise CheckpointError(f"unexpected tensor {name!r}: the model has {model.num_layers} layers and "
                              f"{mtp_depths(model)} multi-token prediction layer(s) (num_nextn_predict_layers)")
    prefix = _MTP_PREFIX.format(k=depth)
    if rest in _HF_MTP_OWN:
        return [(prefix + _HF_MTP_OWN[rest], tensor)]
    if rest in _HF_MTP_SHARED:
        shared = _HF_MTP_SHARED[rest]
        tied = not model.untie_embeddings_and_output_weights
        return [(WORD_EMBEDDING if tied else shared, tensor)]
    main = f"layers.{model.num_layers + depth}."
    return [(prefix + _MTP_LAYER + n[len(main):], t) for n, t in _layer_tensors(name, tensor, model, rope_interleave)]


def _layer_tensors(name: str, tensor: torch.Tensor, model: Optional[ModelConfig],
                   rope_interleave: bool) -> list[tuple[str, torch.Tensor]]:
    """:func:`hf_to_meshtron_tensors` for the main model's tensors."""
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
    if canonical is None:
        return []
    if ".attention." in canonical and model is not None:
        mixer = _layer_mixer(model, canonical)
        values, short = mixer.hf_value_converter(), canonical.split(".attention.", 1)[1]
        if values is not None and mixer.hf_name(short):
            tensor = values.attention_from_hf({mixer.hf_name(short): tensor}, model, rope_interleave)[short]
    return [(canonical, tensor)]


def _layer_mixer(model: ModelConfig, name: str) -> MixerKind:
    """The mixer kind of the layer a tensor belongs to (a prediction depth's layer: the last layer's kinds)."""
    match = re.search(r"layers\.(\d+)\.", name)
    index = int(match.group(1)) if match else model.num_layers - 1
    return layer_at(model, min(index, model.num_layers - 1)).mixer


def rope_interleaved(hf: dict) -> bool:
    """Whether a ``config.json``'s rotary rows are in DeepSeek's interleaved order (V2 always, V3 by
    ``rope_interleave``, default true)."""
    kind = hf.get("model_type")
    return kind == "deepseek_v2" or (kind == "deepseek_v3" and bool(hf.get("rope_interleave", True)))


def meshtron_to_hf_name(name: str, architecture: str = "llama") -> str:
    """Hugging Face name of a canonical meshtron tensor in ``architecture``'s layout."""
    if name in _GLOBAL_MAP_BACK:
        return _GLOBAL_MAP_BACK[name]
    m = _MESHTRON_LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        mixtral = architecture == "mixtral"
        if rest in _LAYER_MAP_BACK:
            return f"model.layers.{layer}.{_LAYER_MAP_BACK[rest]}"
        if rest == "mlp.router.weight":
            return f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.gate.weight"
        if rest == "mlp.router.expert_bias" and architecture == "deepseek_v3":
            return f"model.layers.{layer}.{_HF_EXPERT_BIAS}"
        expert = _MESHTRON_EXPERT.match(rest)
        if expert and mixtral:
            return (f"model.layers.{layer}.block_sparse_moe.experts.{expert.group(1)}."
                    f"{_EXPERT_MAP_BACK[expert.group(2)]}.weight")
        if expert:
            return f"model.layers.{layer}.mlp.experts.{expert.group(1)}.{expert.group(2)}_proj.weight"
        shared = _MESHTRON_SHARED.match(rest)
        if shared and architecture in hf_moe.DEEPSEEK:
            return f"model.layers.{layer}.mlp.shared_experts.{shared.group(1)}_proj.weight"
    raise CheckpointError(f"tensor {name!r} has no Hugging Face {_NAMES.get(architecture, architecture)} "
                          "equivalent")


def meshtron_to_hf_tensors(tensors: dict[str, torch.Tensor], model: ModelConfig,
                           architecture: str) -> dict[str, torch.Tensor]:
    """Every canonical meshtron tensor under its Hugging Face name, in ``architecture``'s layout (DeepSeek:
    rotary rows interleaved; a zero ``e_score_correction_bias`` where a V3 router has no expert bias;
    DeepSeek-V3's multi-token prediction depths as ``model.layers.{num_layers + k}``, each with copies of the
    embedding and output layer, as the released checkpoints hold them)."""
    if architecture in FAMILIES:
        return FAMILIES[architecture].tensors_to_hf(tensors, lambda name: meshtron_to_hf_name(name, architecture))
    out = {}
    for name, t in tensors.items():
        canonical = name
        mtp = _MESHTRON_MTP.match(name)
        if mtp and architecture == "deepseek_v3":
            layer, rest = model.num_layers + int(mtp.group(1)), mtp.group(2)
            if rest in _MTP_OWN_BACK:
                out[f"model.layers.{layer}.{_MTP_OWN_BACK[rest]}"] = t
                continue
            if rest.startswith(_MTP_LAYER):  # the depth's decoder layer: as a main layer of that index
                name = f"layers.{layer}.{rest[len(_MTP_LAYER):]}"
        if ".attention." in name:
            mixer = _layer_mixer(model, name)
            values, short = mixer.hf_value_converter(), name.split(".attention.", 1)[1]
            if values is not None and mixer.hf_name(short):
                t = next(iter(values.attention_to_hf({short: t}, model, rope_interleave=True).values()))
        out[meshtron_to_hf_name(name, architecture)] = t
        if architecture == "deepseek_v3" and name.endswith(".mlp.router.weight"):
            bias = name.replace(".router.weight", ".router.expert_bias")
            if canonical.replace(".router.weight", ".router.expert_bias") not in tensors:
                # transformers' V3 router always has one; zero changes nothing
                out[meshtron_to_hf_name(bias, architecture)] = torch.zeros(t.shape[0], dtype=torch.float32)
    if architecture == "deepseek_v3":
        # each prediction layer of the checkpoint carries its own copy of the shared embedding and output layer
        # (copies: safetensors stores no two names over one storage)
        output = tensors.get("output.weight", tensors.get(WORD_EMBEDDING))
        for k in range(mtp_depths(model)):
            for hf_right, shared in _HF_MTP_SHARED.items():
                out[f"model.layers.{model.num_layers + k}.{hf_right}"] = (
                    output if shared == "output.weight" else tensors[WORD_EMBEDDING]).clone()
    return out


def _rope_settings(hf: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from either the transformers-4 keys or the transformers-5 ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in ("llama3", "yarn"):
            raise CheckpointError(f"config.json: RoPE scaling type {kind!r} is not supported (meshtron implements "
                                  "Llama 3.1's 'llama3' scaling and 'yarn')")
        elif (float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))) != (1.0, 4.0):
            raise CheckpointError("config.json: llama3 RoPE scaling with low_freq_factor != 1 or high_freq_factor "
                                  "!= 4 is not supported")
    return float(theta), scaling


def _is_yarn(scaling: Optional[dict]) -> bool:
    return scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn"


def _yarn_settings(scaling: dict) -> dict[str, Any]:
    """meshtron's YaRN fields for ``rope_type: yarn`` (transformers' defaults for absent keys); an explicit
    ``attention_factor`` must be the one the mscales give (meshtron's table scale is mscale over mscale_all_dim)."""
    if scaling.get("factor") is None or scaling.get("original_max_position_embeddings") is None:
        raise CheckpointError("config.json: yarn RoPE scaling without factor or original_max_position_embeddings "
                              "is not supported")
    factor = float(scaling["factor"])
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    # transformers takes the mscales only when both are set (and nonzero), else the temperature 0.1 ln(factor) + 1
    ours = (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)
    expected = yarn_mscale(factor, ours[0]) / yarn_mscale(factor, ours[1])
    given = scaling.get("attention_factor")
    if given is not None and abs(float(given) - expected) > 1e-9 * expected:
        raise CheckpointError(f"config.json: yarn attention_factor {given} differs from the {expected} its factor "
                              "and mscales give (not supported)")
    return dict(rope_type="yarn", use_rope_scaling=False, rotary_scaling_factor=factor, mscale=ours[0],
                mscale_all_dim=ours[1],
                yarn_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
                yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
                yarn_truncate=bool(scaling.get("truncate", True)))


def _hf_rope_scaling(m: ModelConfig) -> Optional[dict]:
    """A Llama-like ``rope_scaling`` for the model's Llama-3.1 scaling or YaRN (None: plain RoPE); YaRN's
    table scale written as ``attention_factor``, which says it whatever the mscales are."""
    if m.use_rope_scaling:
        return {"rope_type": "llama3", "factor": float(m.rope_scaling_factor), "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": int(m.rope_original_max_position_embeddings)}
    if rope_kind(m) != "yarn":
        return None
    out = {"rope_type": "yarn", "factor": float(m.rotary_scaling_factor),
           "original_max_position_embeddings": int(m.yarn_original_max_position_embeddings),
           "beta_fast": float(m.yarn_beta_fast), "beta_slow": float(m.yarn_beta_slow),
           "attention_factor": float(rope_table_scale(m))}
    if not m.yarn_truncate:  # transformers' default truncates; older versions do not know the key
        out["truncate"] = False
    return out


def config_from_hf(hf: dict, notices: list[str]) -> MeshtronConfig:
    """A meshtron configuration of the model that a Hugging Face ``config.json`` describes."""
    kind = hf.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind].config_from_hf(hf, notices)
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
    # DeepSeek's YaRN is read by hf_moe.deepseek_rope
    theta, scaling = _rope_settings(hf) if kind not in hf_moe.DEEPSEEK else (10000.0, None)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if kind in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
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
        rotary_base=theta, use_rope_scaling=scaling is not None and not _is_yarn(scaling),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), disable_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)), vocab_size=int(hf["vocab_size"]),
        add_qkv_bias=kind == "qwen2", qk_layernorm=kind in ("qwen3", "qwen3_moe"),
    )
    if _is_yarn(scaling):
        values.update(_yarn_settings(scaling))
    elif scaling is not None:
        values["rope_scaling_factor"] = float(scaling["factor"])
        values["rope_original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if kind == "mixtral":
        values.update(_mixtral_settings(hf, notices))
    elif kind == "qwen3_moe":
        values.update(hf_moe.qwen3_moe_settings(hf, notices))
    elif kind in hf_moe.DEEPSEEK:
        values.update(hf_moe.deepseek_settings(hf, kind, notices))
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
    """The Hugging Face architecture to export to when none is named: for multi-latent attention
    deepseek_v2 with softmax routing and deepseek_v3 otherwise; for MoE qwen3_moe with query/key head
    norms, else mixtral; dense: qwen3 with query/key head norms, qwen2 with query/key/value biases,
    else llama; a family of its own (gpt-oss, Qwen3.5) by its layer kinds."""
    family = _family(m)
    if family is not None:
        return family.architecture(m)
    if m.multi_latent_attention:
        return "deepseek_v2" if m.num_experts and m.moe_router_score_function == "softmax" else "deepseek_v3"
    if m.num_experts:
        return "qwen3_moe" if m.qk_layernorm else "mixtral"
    if m.qk_layernorm:
        return "qwen3"
    return "qwen2" if m.add_qkv_bias else "llama"


def check_exportable(m: ModelConfig, architecture: str = "llama") -> None:
    """Raise CheckpointError listing what the Hugging Face ``architecture`` cannot represent."""
    problems = []
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"--hf-architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    family = _family(m)
    if architecture in FAMILIES or family is not None:
        if family is None or architecture != family.architecture(m):
            problems.append(f"--layer-pattern {resolved_pattern(m)} (export with --hf-architecture "
                            f"{default_architecture(m)})")
        else:
            problems += family.check_exportable(m)
        if problems:
            raise CheckpointError(f"this checkpoint cannot be written as a Hugging Face "
                                  f"{_NAMES.get(architecture, architecture)} model", problems)
        return
    if m.normalization != "RMSNorm":
        problems.append(f"--normalization {m.normalization} (Llama uses RMSNorm)")
    if not m.swiglu:
        problems.append("no --swiglu (Llama's MLP is SwiGLU)")
    if m.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {m.position_embedding_type} (Llama uses rope)")
    if not m.multi_latent_attention and m.rotary_percent != 1:
        problems.append(f"--rotary-percent {m.rotary_percent} (these configs rotate the whole head)")
    if not m.disable_bias_linear:
        problems.append(f"linear biases ({_NAMES.get(architecture, architecture)} has none on its other "
                        "projections: --disable-bias-linear)")
    if architecture == "qwen2" and not m.add_qkv_bias:
        problems.append("no --add-qkv-bias (Qwen2 has biases on the query/key/value projections: export as llama)")
    if architecture != "qwen2" and m.add_qkv_bias:
        problems.append("--add-qkv-bias (query/key/value biases: export with --hf-architecture qwen2)")
    if architecture in ("qwen3", "qwen3_moe") and not m.qk_layernorm:
        problems.append("no --qk-layernorm (Qwen3 normalises each query and key head)")
    if architecture not in ("qwen3", "qwen3_moe") and m.qk_layernorm:
        problems.append("--qk-layernorm (query/key head norms: export with --hf-architecture qwen3 or qwen3_moe)")
    if m.multi_latent_attention and architecture not in hf_moe.DEEPSEEK:
        problems.append("--multi-latent-attention (multi-latent attention: export with --hf-architecture "
                        "deepseek_v3 or deepseek_v2)")
    if mtp_depths(m) and architecture != "deepseek_v3":
        problems.append(f"--mtp-num-layers {m.mtp_num_layers} (only DeepSeek-V3 checkpoints hold multi-token "
                        "prediction layers: export with --hf-architecture deepseek_v3, or leave the depths out "
                        "with --skip-mtp)")
    if not pattern_is_derived(m):
        problems.append(f"--layer-pattern {resolved_pattern(m)} (a Hugging Face config places the experts by the "
                        "MoE fields: only the layers --moe-first-dense-layers and --moe-layer-freq imply)")
    if architecture in hf_moe.DEEPSEEK or architecture == "qwen3_moe":
        problems += hf_moe.export_problems(m, architecture)
    elif architecture == "mixtral":
        if not m.num_experts:
            problems.append("no --num-experts (Mixtral is a mixture of experts: export a dense model as llama or "
                            "mistral)")
        else:
            problems += _moe_problems(m)
    elif m.num_experts:
        problems.append("mixture of experts (--num-experts: export it with --hf-architecture mixtral, qwen3_moe, "
                        "deepseek_v2 or deepseek_v3)")
    if problems:
        name = _NAMES.get(architecture, architecture)
        raise CheckpointError(f"this checkpoint cannot be written as a Hugging Face {name} model", problems)


def hf_config(m: ModelConfig, vocab_size: int, architecture: str, dtype_name: str,
              eos_id: Optional[int], bos_id: Optional[int]) -> dict:
    """A ``config.json`` for the Hugging Face ``architecture`` (a key of :data:`ARCHITECTURES`; read by
    transformers 4 and 5, the DeepSeek and Qwen3-MoE ones by transformers 5)."""
    if architecture in FAMILIES:
        return FAMILIES[architecture].hf_config(m, vocab_size, dtype_name, eos_id, bos_id)
    theta = float(m.rotary_base)
    rope_scaling = _hf_rope_scaling(m)
    rope_parameters: dict[str, Any] = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": theta}
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
    if architecture in hf_moe.DEEPSEEK:
        for key in ("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters"):
            del cfg[key]
        cfg.update(hf_moe.deepseek_config(m, architecture), **hf_moe.moe_config(m, architecture))
        return cfg
    if architecture == "qwen3_moe":
        cfg.update(hf_moe.qwen3_attention_config(m), **hf_moe.moe_config(m, architecture))
        return cfg
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
