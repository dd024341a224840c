"""The checkpoint's own ``args`` (Megatron-LM's argparse Namespace) as meshtron model flags, and the check of
this run's model flags against them.

Megatron-LM and meshtron share flag names, so most fields carry over by name; the differences are spelled
out here (``add_bias_linear`` is ``--disable-bias-linear`` negated; ``padded_vocab_size`` is the embedding's
row count; multi-latent attention's YaRN takes megatron-core's ``MLATransformerConfig`` values for what
Megatron-LM has no flag for; ``--moe-shared-expert-gate`` makes the MoE layers meshtron's ``moe_gated_shared``
kind; ``--rotary-interleaved`` is a reordering of the query/key rows, :func:`rope_layout`). A run whose model
flags differ from the checkpoint's is refused with every difference named, flag by flag, in one error.
"""

from __future__ import annotations

from typing import Any, Optional

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import ModelConfig, ffn_size, flag_name, head_dim, num_kv_heads
from meshtron.layer_kinds.dense import DENSE
from meshtron.layer_kinds.gated_shared_moe import GATED_SHARED_MOE
from meshtron.layer_kinds.gqa import GQA
from meshtron.layer_kinds.mla import MLA
from meshtron.layer_kinds.moe import MOE
from meshtron.layer_kinds.pattern import derived_entries, format_pattern, resolved_pattern
from meshtron.layers.rotary import rope_kind, yarn_mscale

#: multi-latent attention's fields, the same name in ``args`` and meshtron (with --multi-latent-attention).
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type")
#: YaRN of multi-latent attention (--rope-type yarn): Megatron-LM's flags, the same name in meshtron.
YARN_FLAGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")
#: YaRN of multi-latent attention that Megatron-LM has no flag for: megatron-core's ``MLATransformerConfig``
#: field (read from ``args`` where a checkpoint has it), meshtron's field, megatron-core's default.
YARN_CONFIG = (("original_max_position_embeddings", "yarn_original_max_position_embeddings", 4096),
               ("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0))
#: Megatron-LM's flags of --position-embedding-type yarn (without MLA) and the defaults megatron-training gives
#: megatron-core's YarnRotaryEmbedding when one is unset; all but the last have the same name in meshtron.
YARN_POSITION_FLAGS = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                       "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
                       "yarn_correction_range_round_to_int": True}
#: meshtron model fields taken from ``args`` under the same name.
SAME_NAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
             "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings", "normalization",
             "norm_epsilon", "swiglu", "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights",
             "add_qkv_bias", "qk_layernorm", "make_vocab_size_divisible_by", "num_experts", "moe_router_topk",
             "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function",
             "moe_router_enable_expert_bias", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
             "moe_aux_loss_coeff", "moe_router_load_balancing_type", "hidden_dropout", "attention_dropout",
             "init_method_std", "mtp_num_layers", "mtp_loss_scaling_factor")


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def model_settings(args: Any, where: str) -> dict[str, Any]:
    """meshtron model fields for a Megatron checkpoint's ``args``; CheckpointError for what meshtron cannot
    load yet (named, with ``where``)."""
    if args is None or not hasattr(args, "num_layers"):
        raise CheckpointError(f"{where} holds no Megatron-LM 'args' (with num_layers, hidden_size...): cannot tell "
                              "the model's shape")
    unsupported = []
    mla = bool(_get(args, "multi_latent_attention"))
    if mla and not _get(args, "qk_layernorm"):
        unsupported.append("--multi-latent-attention without --qk-layernorm (megatron-core's multi-latent attention "
                           "then has no latent norms; meshtron's, as DeepSeek's, has them)")
    position = _get(args, "position_embedding_type") or "learned_absolute"
    if position not in ("learned_absolute", "rope", "yarn"):
        unsupported.append(f"--position-embedding-type {position} (meshtron has learned_absolute, rope and yarn)")
    rope = _get(args, "rope_type") or ("yarn" if mla else "rope")  # unset: megatron-core's MLA takes YaRN
    percent = float(_get(args, "rotary_percent", 1.0) or 1.0)
    if position == "yarn":
        unsupported += _yarn_position_unsupported(args, mla, percent)
    elif mla:
        unsupported += _mla_rope_unsupported(args, rope, percent)
    elif _rotary(args):
        rotated = int(_head_dim(args) * percent)
        if not 0 < percent <= 1 or rotated % 2 or not rotated:
            unsupported.append(f"--rotary-percent {percent} (rotates {rotated} of each head's {_head_dim(args)} "
                               "dimensions: meshtron needs an even number, at least 2)")
    unsupported += mtp_unsupported(args)
    gated = bool(_get(args, "moe_shared_expert_gate")) and bool(_get(args, "num_experts")) and \
        bool(_get(args, "moe_shared_expert_intermediate_size"))
    freq = _get(args, "moe_layer_freq", 1)
    pattern = None
    if _get(args, "num_experts") and not isinstance(freq, int):
        pattern = _moe_pattern(freq, int(args.num_layers), mla, gated)
        if pattern is None:
            unsupported.append(f"--moe-layer-freq {freq} (a list of one 0 or 1 per layer is read as a "
                               "--layer-pattern; this is not one)")
    if unsupported:
        raise CheckpointError(f"{where}: this Megatron-LM model cannot be loaded by meshtron", unsupported)
    out = {name: _get(args, name) for name in SAME_NAME if _get(args, name) is not None}
    if not out.get("mtp_num_layers"):  # 0 or unset: no prediction depths (their loss weight then means nothing)
        out.pop("mtp_num_layers", None)
        out.pop("mtp_loss_scaling_factor", None)
    else:  # megatron-core's depths read the hidden states after the final norms
        out["mtp_normed_hidden_states"] = True
    out["disable_bias_linear"] = not bool(_get(args, "add_bias_linear", True))
    if out.get("add_qkv_bias") is None:
        out["add_qkv_bias"] = False
    if pattern is not None:
        out["layer_pattern"] = pattern  # Megatron's per-layer list: 1 for a MoE layer, 0 for a dense one
    elif _get(args, "num_experts"):
        out["moe_layer_freq"] = int(freq)
        if gated:  # every MoE layer's shared expert gated: meshtron's moe_gated_shared layers
            m = apply_settings(ModelConfig(), {k: out[k] for k in ("num_layers", "num_experts", "moe_layer_freq")})
            m.multi_latent_attention = mla
            out["layer_pattern"] = format_pattern([e.replace(f"+{MOE.name}", f"+{GATED_SHARED_MOE.name}")
                                                   for e in derived_entries(m)])
    if mla:  # Megatron's --qk-layernorm is MLA's latent norms here, which meshtron's MLA always has
        out.update({k: _get(args, k) for k in MLA_FIELDS if _get(args, k) is not None}, qk_layernorm=False,
                   group_query_attention=False, kv_channels=None, rope_type=rope)
        if rope == "yarn":
            out.update(yarn_settings(args))
    elif position == "yarn":  # meshtron's RoPE with YaRN frequencies
        out.update(yarn_position_settings(args), position_embedding_type="rope", rope_type="yarn")
    elif _rotary(args) and percent != 1.0:
        out["rotary_percent"] = percent
    if not out.get("group_query_attention"):
        out["num_query_groups"] = None
    out["vocab_size"] = int(_get(args, "padded_vocab_size") or 0) or None
    return out


def _rotary(args: Any) -> bool:
    return _get(args, "position_embedding_type") in ("rope", "yarn") or \
        bool(_get(args, "use_rotary_position_embeddings"))


def _head_dim(args: Any) -> int:
    return int(_get(args, "kv_channels") or args.hidden_size // args.num_attention_heads)


def _mla_rope_unsupported(args: Any, rope: str, percent: float) -> list[str]:
    """What of multi-latent attention's RoPE megatron-core computes otherwise than meshtron would."""
    out = []
    if rope not in ("rope", "yarn"):
        out.append(f"--rope-type {rope} with multi-latent attention (rope and yarn are read)")
    factor = float(_get(args, "rotary_scaling_factor") if _get(args, "rotary_scaling_factor") is not None else 40.0)
    all_dim = float(_get(args, "mscale_all_dim") or 0.0)
    if rope == "rope" and yarn_mscale(factor, all_dim) != 1.0:
        out.append(f"--rope-type rope with --rotary-scaling-factor {factor} and --mscale-all-dim {all_dim} "
                   "(megatron-core's multi-latent attention then scales its softmax by YaRN's mscale without "
                   "YaRN's frequencies; meshtron only with --rope-type yarn)")
    if rope == "rope" and percent != 1.0:
        out.append(f"--rotary-percent {percent} with multi-latent attention (meshtron rotates the whole "
                   "--qk-pos-emb-head-dim)")
    return out


def _yarn_position_unsupported(args: Any, mla: bool, percent: float) -> list[str]:
    """What of ``--position-embedding-type yarn`` megatron-core computes otherwise than meshtron would."""
    out = []
    if mla:
        out.append("--position-embedding-type yarn with multi-latent attention (meshtron reads MLA's YaRN as "
                   "--rope-type yarn)")
    if percent != 1.0:  # megatron-core's YaRN table spans the whole head whatever --rotary-percent says
        out.append(f"--rotary-percent {percent} with --position-embedding-type yarn (megatron-core's YaRN rotates "
                   "the whole head)")
    if _get(args, "rotary_interleaved"):
        out.append("--rotary-interleaved with --position-embedding-type yarn (megatron-core's YaRN refuses it)")
    return out


def yarn_position_settings(args: Any) -> dict[str, Any]:
    """meshtron's YaRN fields for Megatron-LM's ``--position-embedding-type yarn`` (grouped-query attention):
    its flags, absent ones at the defaults megatron-training gives megatron-core's ``YarnRotaryEmbedding``."""
    out: dict[str, Any] = {}
    for name, default in YARN_POSITION_FLAGS.items():
        value = _get(args, name)
        out[name] = type(default)(value if value is not None else default)
    out["yarn_truncate"] = out.pop("yarn_correction_range_round_to_int")
    return out


def yarn_settings(args: Any) -> dict[str, Any]:
    """meshtron's YaRN fields of multi-latent attention with --rope-type yarn, as megatron-core computes it:
    Megatron-LM's --rotary-scaling-factor, --mscale, --mscale-all-dim; megatron-core's MLA defaults for the
    original context and the betas (Megatron-LM has no flags for them: its --yarn-* flags are for
    --position-embedding-type yarn without MLA); the ramp's ends rounded outwards, as megatron-core's MLA
    always does."""
    # Megatron-LM's flags carry over by name into MLATransformerConfig; absent, its defaults apply (factor 40)
    defaults = {"rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    out: dict[str, Any] = {k: float(_get(args, k) if _get(args, k) is not None else v) for k, v in defaults.items()}
    for name, field, default in YARN_CONFIG:
        value = _get(args, name)
        out[field] = type(default)(value if value is not None else default)
    out["yarn_truncate"] = True
    return out


def rope_layout(args: Any, settings: dict[str, Any]) -> Optional[int]:
    """With ``--rotary-interleaved`` (grouped-query attention), the number of each query/key head's first rows
    megatron-core rotates in interleaved pairs (0, 1), (2, 3)...: they are reordered into meshtron's rotate-half
    halves on reading (and back on writing), which computes the same attention. None otherwise."""
    if not _get(args, "rotary_interleaved") or _get(args, "multi_latent_attention") or not _rotary(args):
        return None
    return int(_head_dim(args) * float(settings.get("rotary_percent", 1.0)))


def mtp_unsupported(args: Any) -> list[str]:
    """What of a checkpoint's multi-token prediction (``--mtp-num-layers``) meshtron does not compute as
    megatron-core does (empty: nothing, or no prediction depths)."""
    depths = int(_get(args, "mtp_num_layers") or 0)
    if not depths:
        return []
    out = []
    if _get(args, "mtp_use_repeated_layer"):
        out.append("--mtp-use-repeated-layer (one prediction layer applied at every depth; meshtron's depths have "
                   "layers of their own)")
    if _get(args, "mtp_detach_heads"):
        out.append("--mtp-detach-heads (meshtron's prediction depths train the embedding, the output layer and "
                   "the main model's hidden states)")
    if _get(args, "mtp_hybrid_override_pattern"):
        out.append(f"--mtp-hybrid-override-pattern {args.mtp_hybrid_override_pattern} (hybrid prediction layers)")
    if (_get(args, "position_embedding_type") or "learned_absolute") == "learned_absolute":
        out.append("--mtp-num-layers with learned absolute position embeddings (megatron-core adds the shifted "
                   "position's embedding to a depth's token embedding; meshtron looks up the word embedding alone)")
    return out


def _moe_pattern(freq: Any, num_layers: int, mla: bool = False, gated: bool = False) -> str | None:
    """Megatron's list form of ``--moe-layer-freq`` (one 1 per MoE layer, 0 per dense one) as a
    ``--layer-pattern`` (its mixer multi-latent or grouped-query attention; ``gated``: the MoE layers'
    shared expert gated), or None if it is not one."""
    if not isinstance(freq, (list, tuple)) or len(freq) != num_layers or not set(freq) <= {0, 1}:
        return None
    mixer = MLA.name if mla else GQA.name
    experts = GATED_SHARED_MOE.name if gated else MOE.name
    return format_pattern([f"{mixer}+{experts if moe else DENSE.name}" for moe in freq])


def apply_settings(m: ModelConfig, settings: dict[str, Any]) -> ModelConfig:
    for k, v in settings.items():
        setattr(m, k, v)
    return m


def yarn_applies(m: ModelConfig) -> bool:
    """Whether YaRN changes anything: at --rotary-scaling-factor 1 its frequencies, tables and (multi-latent
    attention's) softmax scale are plain RoPE's (megatron-core's and meshtron's alike)."""
    return m.position_embedding_type == "rope" and rope_kind(m) == "yarn" and float(m.rotary_scaling_factor) > 1


#: (what is compared, how meshtron computes it) for the check of a run against a checkpoint.
_CHECKED = {
    "num_layers": lambda m: m.num_layers,
    "hidden_size": lambda m: m.hidden_size,
    "ffn_hidden_size": ffn_size,
    "num_attention_heads": lambda m: m.num_attention_heads,
    "num_query_groups": num_kv_heads,
    "kv_channels": head_dim,
    "normalization": lambda m: m.normalization,
    "norm_epsilon": lambda m: float(m.norm_epsilon),
    "swiglu": lambda m: bool(m.swiglu),
    "position_embedding_type": lambda m: m.position_embedding_type,
    "rotary_base": lambda m: float(m.rotary_base) if m.position_embedding_type == "rope" else None,
    "untie_embeddings_and_output_weights": lambda m: bool(m.untie_embeddings_and_output_weights),
    "disable_bias_linear": lambda m: bool(m.disable_bias_linear),
    "add_qkv_bias": lambda m: bool(m.add_qkv_bias),
    "qk_layernorm": lambda m: bool(m.qk_layernorm),
    "num_experts": lambda m: m.num_experts or None,
    "moe_router_topk": lambda m: m.moe_router_topk if m.num_experts else None,
    "moe_ffn_hidden_size": lambda m: (m.moe_ffn_hidden_size or ffn_size(m)) if m.num_experts else None,
    "moe_shared_expert_intermediate_size": lambda m: m.moe_shared_expert_intermediate_size or None,
    "moe_router_score_function": lambda m: m.moe_router_score_function if m.num_experts else None,
    "moe_router_enable_expert_bias": lambda m: bool(m.moe_router_enable_expert_bias) if m.num_experts else None,
    "moe_router_pre_softmax": lambda m: bool(m.moe_router_pre_softmax) if m.num_experts else None,
    "layer_pattern": resolved_pattern,  # each layer's kinds (where the experts are)
    "multi_latent_attention": lambda m: bool(m.multi_latent_attention),
    "rotary_percent": lambda m: (float(m.rotary_percent) if m.position_embedding_type == "rope"
                                 and not m.multi_latent_attention else None),
    "rope_type": lambda m: ("yarn" if yarn_applies(m) else "rope") if m.position_embedding_type == "rope" else None,
    **{k: (lambda name: lambda m: float(getattr(m, name)) if yarn_applies(m) else None)(k)
       for k in ("rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
                 "yarn_beta_fast", "yarn_beta_slow")},
    "yarn_truncate": lambda m: bool(m.yarn_truncate) if yarn_applies(m) else None,
    "mtp_num_layers": lambda m: m.mtp_num_layers or None,
    "mtp_normed_hidden_states": lambda m: bool(m.mtp_normed_hidden_states) if m.mtp_num_layers else None,
    **{k: (lambda name: lambda m: getattr(m, name) if m.multi_latent_attention else None)(k)
       for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")},
}


def check_model(settings: dict[str, Any], run: ModelConfig, where: str, vocab_size: int | None = None) -> None:
    """CheckpointError listing, flag by flag, every model setting of this run that differs from the checkpoint's
    ``args`` (``settings`` from :func:`model_settings`); ``vocab_size``: the run's vocabulary, which must fit in
    the checkpoint's padded one."""
    saved = apply_settings(ModelConfig(), {k: v for k, v in settings.items() if k != "vocab_size"})
    diffs = []
    for name, value in _CHECKED.items():
        a, b = value(saved), value(run)
        if isinstance(a, float) or isinstance(b, float):
            same = a is not None and b is not None and abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
            same = same or (a is None and b is None)
        else:
            same = a == b
        if not same:
            diffs.append(f"{flag_name(name)}: checkpoint {a!r}, this run {b!r}")
    padded = settings.get("vocab_size")
    if vocab_size is not None and padded is not None and vocab_size > padded:
        diffs.append(f"vocabulary: checkpoint {padded} rows (args.padded_vocab_size), this run {vocab_size} (the "
                     "tokenizer's): larger than the checkpoint's")
    if diffs:
        raise CheckpointError(f"the {where} does not match this run's model flags", diffs)
