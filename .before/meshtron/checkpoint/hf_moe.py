"""Hugging Face fine-grained MoE families <-> meshtron configurations: DeepSeek-V2, DeepSeek-V3, Qwen3-MoE.

Each Hugging Face routing feature maps to one meshtron MoE flag, and only where both compute the
same thing (transformers 5's ``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``, ``Qwen3MoeTopKRouter``):

* DeepSeek-V3: sigmoid scores (``--moe-router-score-function sigmoid``); the choice uses score +
  ``e_score_correction_bias`` (``--moe-router-enable-expert-bias``, the buffer
  ``layers.N.mlp.router.expert_bias``) while the weights are the unbiased scores, normalised over the
  k chosen (``norm_topk_prob``; meshtron's sigmoid router always normalises for k > 1) and multiplied
  by ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``). ``n_group``/``topk_group``
  are ``--moe-router-num-groups``/``--moe-router-group-topk``: Hugging Face scores a group by the
  sum of its 2 best values and meshtron by the sum of its ``topk // group_topk`` best, so the two
  agree when ``num_experts_per_tok // topk_group == 2`` (DeepSeek-V3: 8 // 4).
* DeepSeek-V2: the softmax over all experts, top k of those probabilities, not renormalised
  (``--moe-router-pre-softmax``; transformers' V2 router has no ``norm_topk_prob``), times
  ``routed_scaling_factor``. ``topk_method group_limited_greedy`` scores a group by its best value,
  which meshtron's group routing equals when ``num_experts_per_tok // topk_group == 1``.
* Qwen3-MoE: softmax over all experts, top k; ``norm_topk_prob`` renormalises them, which is
  meshtron's default softmax router (softmax over the k chosen logits); without it the weights stay
  unnormalised (``--moe-router-pre-softmax``).

DeepSeek's ``n_shared_experts`` experts of ``moe_intermediate_size`` form one shared MLP
(``--moe-shared-expert-intermediate-size`` = their product) and ``first_k_dense_replace`` is
``--moe-first-dense-layers``; Qwen3-MoE's ``mlp_only_layers`` may list the first layers only, with
``decoder_sparse_step`` 1. Anything else raises CheckpointError: a conversion never yields a model
that computes something else. All routing is dropless, as in transformers.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import ModelConfig, ffn_size, head_dim, num_kv_heads
from meshtron.layers.rotary import rope_kind

DEEPSEEK = ("deepseek_v2", "deepseek_v3")
#: Hugging Face's DeepSeek latent norms (q_a_layernorm, kv_a_layernorm) use this epsilon whatever
#: rms_norm_eps says; meshtron uses --norm-epsilon for every norm.
DEEPSEEK_LATENT_NORM_EPS = 1e-6
#: values per group that Hugging Face sums to score a group (V2 group_limited_greedy: the max; V3: top 2)
_GROUP_SCORE_TOPK = {"deepseek_v2": 1, "deepseek_v3": 2}


def _int(hf: dict, key: str, default: Optional[int] = None) -> Optional[int]:
    value = hf.get(key, default)
    return None if value is None else int(value)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json -> meshtron flags.
# ---------------------------------------------------------------------------------------------


def _experts_per_token(hf: dict, experts: int, experts_key: str) -> int:
    """``num_experts_per_tok``, checked against the expert count (read from ``experts_key``)."""
    topk = _int(hf, "num_experts_per_tok")
    if topk is None or not 1 <= topk <= experts:
        raise CheckpointError(f"config.json: num_experts_per_tok {topk} must be between 1 and {experts_key} "
                              f"{experts}")
    return topk


def deepseek_settings(hf: dict, kind: str, notices: list[str]) -> dict[str, Any]:
    """meshtron model fields for a DeepSeek-V2/V3 ``config.json`` (MLA, YaRN, dense first layers, MoE)."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("config.json: attention_bias/mlp_bias are not supported (meshtron's biases, without "
                              "--disable-bias-linear, would cover every projection)")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    if eps != DEEPSEEK_LATENT_NORM_EPS:
        raise CheckpointError(f"config.json: rms_norm_eps {eps}: Hugging Face's DeepSeek latent norms use 1e-6 "
                              "whatever rms_norm_eps says, meshtron one --norm-epsilon for every norm (only 1e-6 "
                              "converts exactly)")
    layers = int(hf["num_hidden_layers"])
    values: dict[str, Any] = dict(
        multi_latent_attention=True, group_query_attention=False, num_query_groups=None, kv_channels=None,
        q_lora_rank=_int(hf, "q_lora_rank"), kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_head_dim=int(hf["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]), norm_epsilon=eps, qk_layernorm=False, add_qkv_bias=False,
    )
    values.update(deepseek_rope(hf))
    if kind == "deepseek_v3":
        # the multi-token prediction layers model.layers.{layers + k} (--mtp-num-layers); the converter drops
        # this when the weights do not hold them or the user leaves them out
        depths = _int(hf, "num_nextn_predict_layers", _int(hf, "num_mtp_layers", 0)) or 0
        values["mtp_num_layers"] = depths or None
    experts = _int(hf, "n_routed_experts")
    first_dense = min(_int(hf, "first_k_dense_replace", 0) or 0, layers)
    if not experts or first_dense >= layers:
        return values  # every layer dense
    topk = _experts_per_token(hf, experts, "n_routed_experts")
    if _int(hf, "moe_layer_freq", 1) != 1:
        raise CheckpointError(f"config.json: moe_layer_freq {hf['moe_layer_freq']}: transformers makes every layer "
                              "from first_k_dense_replace on MoE")
    moe_ffn = int(hf["moe_intermediate_size"])
    shared = (_int(hf, "n_shared_experts", 0) or 0) * moe_ffn
    scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
    values.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                  moe_shared_expert_intermediate_size=shared or None, moe_first_dense_layers=first_dense,
                  moe_layer_freq=1, moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                  moe_expert_capacity_factor=None)
    values.update(_deepseek_balancing(hf))
    groups = _deepseek_groups(hf, kind, experts, topk)
    values.update(moe_router_num_groups=groups[0] if groups else None,
                  moe_router_group_topk=groups[1] if groups else None)
    if kind == "deepseek_v3":
        if not hf.get("norm_topk_prob", True) or topk == 1:
            raise CheckpointError("config.json: DeepSeek-V3 routing without norm_topk_prob (or with one expert "
                                  "per token) is not supported: meshtron's sigmoid router normalises the weights "
                                  "of k > 1 experts and only those")
        values.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                      moe_router_enable_expert_bias=True)
    else:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"config.json: topk_method {method!r} is not supported (greedy, "
                                  "group_limited_greedy)")
        if hf.get("norm_topk_prob"):
            raise CheckpointError("config.json: norm_topk_prob true: transformers' DeepSeek-V2 router ignores it "
                                  "while DeepSeek's own code renormalises, so the intended routing is ambiguous")
        values.update(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                      moe_router_enable_expert_bias=False)
    return values


def _deepseek_balancing(hf: dict) -> dict[str, Any]:
    """Load balancing for training: DeepSeek's sequence-wise auxiliary loss (``aux_loss_alpha``, ``seq_aux``)."""
    alpha = float(hf.get("aux_loss_alpha", 0.0) or 0.0)
    if alpha <= 0:
        return dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    kind = "seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss"
    return dict(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=alpha)


def _deepseek_groups(hf: dict, kind: str, experts: int, topk: int) -> Optional[tuple[int, int]]:
    """(--moe-router-num-groups, --moe-router-group-topk), or None when no group restricts the choice."""
    groups, group_topk = _int(hf, "n_group"), _int(hf, "topk_group")
    if kind == "deepseek_v2" and hf.get("topk_method", "greedy") == "greedy":
        return None
    if not groups or groups == 1 or group_topk == groups:
        return None  # one group, or every group allowed: plain top-k
    if group_topk is None or experts % groups or not 1 <= group_topk < groups:
        raise CheckpointError(f"config.json: n_group {groups} / topk_group {group_topk} do not form groups of the "
                              f"{experts} experts")
    per_group = _GROUP_SCORE_TOPK[kind]
    if topk // group_topk != per_group:
        raise CheckpointError(
            f"config.json: group-limited routing with num_experts_per_tok {topk} and topk_group {group_topk}: "
            f"transformers scores each group by its best {per_group} value(s), meshtron's "
            f"--moe-router-group-topk by the best num_experts_per_tok // topk_group = {topk // group_topk}")
    return groups, group_topk


def deepseek_rope(hf: dict) -> dict[str, Any]:
    """meshtron RoPE fields (--rope-type, YaRN settings) for DeepSeek's ``rope_parameters``/``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta, use_rope_scaling=False)
    if kind != "yarn":
        raise CheckpointError(f"config.json: RoPE type {kind!r} is not supported for DeepSeek models (default, "
                              "yarn)")
    if params.get("truncate", True) is False:
        raise CheckpointError("config.json: yarn with truncate false is not supported (meshtron rounds the "
                              "correction range as DeepSeek does)")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(hf["max_position_embeddings"]) / original
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers: the tables' factor is m(mscale)/m(mscale_all_dim) when both are set and non-zero, else
    # m(1); the softmax scale takes m(mscale_all_dim)^2 when it is non-zero. meshtron: m(--mscale)/
    # m(--mscale-all-dim) and m(--mscale-all-dim)^2 (m(0) = 1).
    if mscale and all_dim:
        ours = (float(mscale), float(all_dim))
    elif not all_dim:
        ours = (1.0, 0.0)
    else:
        raise CheckpointError("config.json: yarn with mscale_all_dim but no mscale is not supported")
    if params.get("attention_factor") is not None:
        expected = _yarn_m(factor, ours[0]) / _yarn_m(factor, ours[1])
        if not math.isclose(float(params["attention_factor"]), expected, rel_tol=1e-12):
            raise CheckpointError(f"config.json: yarn attention_factor {params['attention_factor']} differs from "
                                  f"the value mscale/mscale_all_dim give ({expected}), which meshtron uses")
    return dict(rope_type="yarn", rotary_base=theta, use_rope_scaling=False, rotary_scaling_factor=factor,
                mscale=ours[0], mscale_all_dim=ours[1], yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                yarn_beta_slow=float(params.get("beta_slow") or 1.0))


def _yarn_m(factor: float, coefficient: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def qwen3_moe_settings(hf: dict, notices: list[str]) -> dict[str, Any]:
    """meshtron MoE fields for a Qwen3-MoE ``config.json`` (attention as dense Qwen3)."""
    # the hub's configs say num_experts, transformers 5 writes num_local_experts
    layers = int(hf["num_hidden_layers"])
    experts = _int(hf, "num_experts") or _int(hf, "num_local_experts") or 0
    if experts == 0:
        return {}
    topk = _experts_per_token(hf, experts, "num_experts")
    if _int(hf, "decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"config.json: decoder_sparse_step {hf['decoder_sparse_step']} is not supported "
                              "(meshtron's --moe-layer-freq counts from layer 0, Qwen's step from layer step - 1)")
    dense = sorted(int(i) for i in (hf.get("mlp_only_layers") or []))
    if dense != list(range(len(dense))):
        raise CheckpointError(f"config.json: mlp_only_layers {dense}: only the first layers can be dense "
                              "(--moe-first-dense-layers)")
    coeff = float(hf.get("router_aux_loss_coef", 0.0) or 0.0)
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                moe_first_dense_layers=min(len(dense), layers), moe_layer_freq=1,
                moe_router_score_function="softmax", moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none", moe_aux_loss_coeff=coeff)


# ---------------------------------------------------------------------------------------------
# meshtron -> Hugging Face: what cannot be represented, and the config.json.
# ---------------------------------------------------------------------------------------------

def export_problems(m: ModelConfig, architecture: str) -> list[str]:
    """What the Hugging Face DeepSeek-V2/V3 or Qwen3-MoE ``architecture`` cannot represent of ``m``
    (attention, norms, biases and the MoE routing)."""
    problems = []
    if architecture in DEEPSEEK:
        if not m.multi_latent_attention:
            problems.append("no --multi-latent-attention (DeepSeek's attention is MLA: export grouped-query "
                            "attention as llama, mixtral or qwen3_moe)")
        elif float(m.norm_epsilon) != DEEPSEEK_LATENT_NORM_EPS:
            problems.append(f"--norm-epsilon {m.norm_epsilon} (Hugging Face's DeepSeek latent norms use 1e-6)")
    elif architecture == "qwen3_moe" and not m.num_experts:
        problems.append("no --num-experts (Qwen3-MoE is a mixture of experts: export a dense model as qwen3)")
    if not m.num_experts:
        return problems
    if m.moe_expert_capacity_factor is not None:
        problems.append(f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor} (transformers never drops "
                        "tokens)")
    if m.moe_layer_freq != 1:
        problems.append(f"--moe-layer-freq {m.moe_layer_freq} (every layer after the first dense ones is MoE)")
    score, pre = m.moe_router_score_function, m.moe_router_pre_softmax
    grouped = m.moe_router_num_groups is not None and m.moe_router_num_groups > 1
    if architecture == "qwen3_moe":
        if score != "softmax":
            problems.append(f"--moe-router-score-function {score} (Qwen3-MoE routes on the softmax)")
        if m.moe_router_enable_expert_bias:
            problems.append("--moe-router-enable-expert-bias (Qwen3-MoE's router has no expert bias)")
        if grouped:
            problems.append("--moe-router-num-groups (Qwen3-MoE has no group-limited routing)")
        if m.moe_router_topk_scaling_factor not in (None, 1.0):
            problems.append("--moe-router-topk-scaling-factor (Qwen3-MoE does not scale the weights)")
        if m.moe_shared_expert_intermediate_size:
            problems.append("--moe-shared-expert-intermediate-size (Qwen3-MoE has no shared experts)")
        return problems
    # DeepSeek
    moe_ffn = m.moe_ffn_hidden_size or ffn_size(m)
    shared = m.moe_shared_expert_intermediate_size
    if not shared or shared % moe_ffn:
        problems.append(f"--moe-shared-expert-intermediate-size {shared} (DeepSeek has n_shared_experts shared "
                        f"experts of --moe-ffn-hidden-size {moe_ffn}: a positive multiple of it)")
    if architecture == "deepseek_v3":
        if score != "sigmoid" or pre:
            problems.append(f"--moe-router-score-function {score} (DeepSeek-V3 routes on sigmoid scores)")
        if m.moe_router_topk < 2:
            problems.append("--moe-router-topk 1 (DeepSeek-V3 normalises the weights of the chosen experts, "
                            "meshtron's sigmoid router only for k > 1)")
    else:
        if score != "softmax" or not pre:
            problems.append(f"--moe-router-score-function {score}{' with' if pre else ' without'} "
                            "--moe-router-pre-softmax (DeepSeek-V2 keeps the top-k of the softmax over all experts: "
                            "softmax with --moe-router-pre-softmax)")
        if m.moe_router_enable_expert_bias:
            problems.append("--moe-router-enable-expert-bias (DeepSeek-V2's router has no expert bias)")
    if grouped:
        per_group = _GROUP_SCORE_TOPK[architecture]
        if m.moe_router_topk // m.moe_router_group_topk != per_group:
            problems.append(f"--moe-router-topk {m.moe_router_topk} with --moe-router-group-topk "
                            f"{m.moe_router_group_topk} (Hugging Face's {architecture} scores a group by its best "
                            f"{per_group} value(s): topk // group-topk must be {per_group})")
    return problems


def moe_config(m: ModelConfig, architecture: str) -> dict[str, Any]:
    """The MoE fields of a DeepSeek-V2/V3 or Qwen3-MoE ``config.json`` for ``m`` (checked by export_problems)."""
    E, k = m.num_experts or 0, m.moe_router_topk
    moe_ffn = (m.moe_ffn_hidden_size or ffn_size(m)) if E else ffn_size(m)
    if architecture == "qwen3_moe":
        return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=moe_ffn, decoder_sparse_step=1,
                    mlp_only_layers=list(range(min(m.moe_first_dense_layers, m.num_layers))),
                    norm_topk_prob=not m.moe_router_pre_softmax,
                    router_aux_loss_coef=float(m.moe_aux_loss_coeff or 0.0), output_router_logits=False)
    grouped = E and m.moe_router_num_groups is not None and m.moe_router_num_groups > 1
    cfg: dict[str, Any] = dict(
        n_routed_experts=E or 1, num_experts_per_tok=k if E else 1, moe_intermediate_size=moe_ffn,
        n_shared_experts=(m.moe_shared_expert_intermediate_size or 0) // moe_ffn if E else 0,
        first_k_dense_replace=min(m.moe_first_dense_layers, m.num_layers) if E else m.num_layers,
        routed_scaling_factor=float(m.moe_router_topk_scaling_factor or 1.0),
        n_group=int(m.moe_router_num_groups) if grouped else 1,
        topk_group=int(m.moe_router_group_topk) if grouped else 1,
        aux_loss_alpha=float(m.moe_aux_loss_coeff or 0.0), seq_aux=m.moe_router_load_balancing_type != "aux_loss",
    )
    if architecture == "deepseek_v3":
        cfg["norm_topk_prob"] = True
    else:
        cfg.update(norm_topk_prob=False, topk_method="group_limited_greedy" if grouped else "greedy")
    return cfg


def deepseek_config(m: ModelConfig, architecture: str) -> dict[str, Any]:
    """The attention and RoPE fields of a DeepSeek-V2/V3 ``config.json`` for an MLA model."""
    theta = float(m.rotary_base)
    if rope_kind(m) == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(m.rotary_scaling_factor),
                "original_max_position_embeddings": int(m.yarn_original_max_position_embeddings),
                "mscale": float(m.mscale), "mscale_all_dim": float(m.mscale_all_dim),
                "beta_fast": float(m.yarn_beta_fast), "beta_slow": float(m.yarn_beta_slow)}
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
    cfg: dict[str, Any] = dict(
        num_key_value_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        head_dim=m.qk_pos_emb_head_dim, rope_parameters=rope, rope_scaling=rope if rope["rope_type"] != "default"
        else None, rope_theta=theta, attention_bias=False, pretraining_tp=1,
    )
    if architecture == "deepseek_v2":
        cfg["mlp_bias"] = False
    else:
        cfg["rope_interleave"] = True  # the exporter writes the rotary rows in DeepSeek's interleaved order
        cfg["num_nextn_predict_layers"] = int(m.mtp_num_layers or 0)  # model.layers.{num_hidden_layers + k}
    return cfg


def qwen3_attention_config(m: ModelConfig) -> dict[str, Any]:
    """Attention fields Qwen3-MoE shares with dense Qwen3."""
    return dict(num_key_value_heads=num_kv_heads(m), head_dim=head_dim(m), attention_bias=False,
                use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
