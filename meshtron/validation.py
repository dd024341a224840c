"""Resolving and checking a whole configuration, before any work starts.

Two steps, run in this order by :func:`validate_config`:

- :func:`resolve` fills, in place, the fields that other fields imply: ``--max-position-embeddings``
  from ``--seq-length``, the key/value groups, the MLP sizes, ``--expert-tensor-parallel-size``,
  the virtual stages from ``--num-layers-per-virtual-pipeline-stage``, the device and precision,
  the global batch from the data-parallel size, iterations from sample counts, ... It fills only
  what is unset (or always derives it the same way), so resolving twice gives the same result.
- :func:`check` reads the resolved configuration, changes nothing in it, and raises
  :class:`~meshtron.errors.ConfigError` with a one-line message that names the flag, the numbers
  involved and what would be valid.

Both need neither torch nor model code: this module imports only the schema
(:mod:`meshtron.config`), the error (:mod:`meshtron.errors`), the launcher's and the resilience
features' flag checks, the integer rules of the rank layout (:mod:`meshtron.parallel.layout`), the integer
layer partition (:mod:`meshtron.pipeline.partition`) and the resolved layout (:mod:`meshtron.run_layout`).
Only the CUDA probe behind an unset ``--device`` (or ``--device cuda``) asks torch, and a missing torch means
no CUDA. :func:`validate_run` validates and then resolves the :class:`~meshtron.run_layout.RunLayout` once.

Which module owns which rule (each rule lives in one place; the others call it):

- the type, choices and encoding of a value, unknown flags and YAML keys: :mod:`meshtron.flags`;
- finite numbers: every float field here (:func:`check_finite`); a field whose definition says
  ``allow_inf`` may be infinite;
- the world size factoring into TP x CP x DP x PP and the expert ranks over DP x CP:
  :mod:`meshtron.parallel.layout`, shared with the process groups;
- what the flags imply about the layout (stage layout, loss stage, sharding strategy, effective sequence
  parallelism, compute dtype): :mod:`meshtron.run_layout`;
- the model shape, sizes against the shape, experts against EP and the expert tensor-parallel size, batch
  sizes, precision, recomputation, the optimizer and schedule, data and tokenizer files, checkpoint and
  logging directories: this module;
- the layer split over pipeline stages and virtual stages, and the micro-batch count of the
  interleaved schedule: :mod:`meshtron.pipeline.partition`, called from here with integers;
- the launcher flags (``--nnodes``, ``--node-rank``, ``--master-port``, ...):
  :func:`meshtron.launcher.check_launcher`, called from here;
- the hang, restart, fault-drill, straggler, re-run and weight-hash flags:
  :mod:`meshtron.resilience.checks` and :mod:`meshtron.resilience.detection_checks`, called from here;
- facts known only later (the GPUs on the node, a checkpoint's contents, a dataset's tokens): the
  launcher, :mod:`meshtron.checkpoint` and :mod:`meshtron.data`, when they read them.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import math
import os
from typing import Iterable, Optional, Sequence

from meshtron.config import (
    PIPELINE_SCHEDULES, SECTIONS, SHARDING_STRATEGIES, CheckpointConfig, DataConfig, LogConfig, MeshtronConfig,
    ModelConfig, OptimConfig, ffn_size, flag_name,
)
from meshtron.errors import ConfigError
from meshtron.launcher import check_launcher
from meshtron.parallel.layout import check_expert_ranks, data_parallel_size_of
from meshtron.resilience.checks import check_resilience
from meshtron.resilience.detection_checks import check_detection_flags
from meshtron.pipeline.partition import check_micro_batches
from meshtron.run_layout import RunLayout, layout_from_config, resolve_layout, sharding_strategy
from meshtron.layer_kinds.pattern import check_pattern, layer_kinds


def validate_config(cfg: MeshtronConfig, world_size: Optional[int] = 1) -> MeshtronConfig:
    """:func:`resolve` then :func:`check`; returns ``cfg``.

    ``world_size`` is the number of processes of the run; ``None`` (an elastic launch whose size is
    not known yet) skips what depends on it.
    """
    resolve(cfg, world_size)
    check(cfg, world_size)
    return cfg


def validate_run(cfg: MeshtronConfig, world_size: int) -> RunLayout:
    """:func:`validate_config` for a run of ``world_size`` ranks, then its :class:`~meshtron.run_layout.RunLayout`:
    what the configuration implies about the layout, resolved once for everything that follows."""
    validate_config(cfg, world_size)
    return resolve_layout(cfg, world_size)


def resolve(cfg: MeshtronConfig, world_size: Optional[int] = 1) -> None:
    """Fill, in place, the fields of ``cfg`` that other fields imply (idempotent).

    A fill whose inputs are unusable is skipped, and :func:`check` then names the flag. The one
    error raised here is an impossible ``--num-layers-per-virtual-pipeline-stage`` or
    ``--pipeline-model-parallel-layout`` split (the partition that derives the virtual stages is the same that
    refuses it).
    """
    _resolve_model(cfg.model)
    _resolve_precision_and_recompute(cfg)
    p = cfg.parallel
    if p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = p.tensor_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage is not None:
        p.virtual_pipeline_model_parallel_size = layout_from_config(cfg).virtual_stages
    if p.pipeline_model_parallel_layout is not None and p.virtual_pipeline_model_parallel_size is None:
        virtual = layout_from_config(cfg).virtual_stages  # the layout's chunks per stage
        p.virtual_pipeline_model_parallel_size = virtual if virtual > 1 else None
    dp = _data_parallel_size_or_none(cfg, world_size)
    if dp is not None:
        _resolve_batch_and_samples(cfg, dp)
        _resolve_shard_size(cfg, dp)
    o = cfg.optim
    if o.main_grads_dtype == "bf16":  # the gradient buffer is both what is reduced and what the optimizer reads
        p.grad_reduce_in_bf16 = True
    if o.lr_decay_iters is None and o.lr_decay_samples is None:
        o.lr_decay_iters = cfg.train.train_iters
    d = cfg.data
    if d.tokenizer_type is None and d.vocab_file and d.merge_file:
        d.tokenizer_type = "GPT2BPETokenizer"  # Megatron scripts pass only --vocab-file/--merge-file
    lg = cfg.log
    if all(_is_int(r) for r in lg.profile_ranks):
        lg.profile_ranks = [int(r) for r in lg.profile_ranks]


def check(cfg: MeshtronConfig, world_size: Optional[int] = 1) -> None:
    """Check every constraint of a resolved configuration; raises ConfigError naming the flag.

    Reads ``cfg`` only. ``world_size`` as in :func:`validate_config`.
    """
    check_finite(cfg)
    _check_model(cfg.model)
    _check_precision_and_recompute(cfg)
    _check_parallel(cfg)
    _check_pipeline_schedule(cfg)
    check_cuda_graphs(cfg)
    _check_mtp(cfg)
    if world_size is not None:
        dp = data_parallel_size(cfg, world_size)
        _check_experts_over_ranks(cfg, dp)
        _check_hybrid_sharding_over_ranks(cfg, dp)
        _check_batch(cfg, dp)
    _check_batch_sizes(cfg)
    _check_training(cfg)
    _check_optim(cfg.optim)
    _check_optimizer_kind(cfg)
    _check_data(cfg.data, cfg.model)
    _check_checkpoint(cfg.checkpoint)
    _check_logging(cfg.log)
    check_launcher(cfg.launcher)
    check_resilience(cfg, world_size)
    check_detection_flags(cfg)


# ---------------------------------------------------------------------------------------------
# Layout arithmetic with the run's flags (the integer rules are meshtron.parallel.layout's).
# ---------------------------------------------------------------------------------------------

def data_parallel_size(cfg: MeshtronConfig, world_size: int) -> int:
    """:func:`data_parallel_size_of` with the run's flags."""
    p = cfg.parallel
    return data_parallel_size_of(world_size, p.tensor_model_parallel_size, p.context_parallel_size,
                                 p.pipeline_model_parallel_size)


def _data_parallel_size_or_none(cfg: MeshtronConfig, world_size: Optional[int]) -> Optional[int]:
    """DP for the fills of :func:`resolve`; None when unknown or impossible (check names the flag)."""
    if world_size is None:
        return None
    try:
        return data_parallel_size(cfg, world_size)
    except (ConfigError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# Parsing helpers of list-valued flags.
# ---------------------------------------------------------------------------------------------

def data_path_items(values: Sequence[str]) -> list[str]:
    """The words of a ``--data-path`` list (Megatron's ``[WEIGHT] PREFIX ...``): weights and prefixes, in order.

    Each item (one command-line argument, one YAML list item, or a YAML string) is kept whole, so that a prefix
    may contain spaces, except where it is itself weighted:

    - ``"0.7 A 0.3 B"``: every other word is a number, starting with one: a whole blend in one item, split into
      its words (the form of Megatron's ``DATA_PATH="0.7 A 0.3 B"`` once quoted, or of a YAML string);
    - ``"0.7 /data/my corpus"``: a number, then the rest: one ``WEIGHT PREFIX`` pair, whose prefix keeps its spaces;
    - anything else is one prefix: ``"/data/my corpus/text_document"``.

    argparse already separates the command line's arguments, so nothing else is split. A relative prefix whose
    first word is a number reads as weighted: write it ``./2024 corpus/text``. Several prefixes with spaces in a
    blend go in separate items.
    """
    words: list[str] = []
    for value in values:
        item = str(value).strip()
        parts = item.split()
        if len(parts) <= 1:
            words += parts
        elif len(parts) % 2 == 0 and all(_is_float(w) for w in parts[0::2]) \
                and not any(_is_float(p) for p in parts[1::2]):
            words += parts
        elif _is_float(parts[0]):
            words += [parts[0], item[len(parts[0]):].strip()]
        else:
            words.append(item)
    return words


def parse_data_path(values: Sequence[str], flag: str = "--data-path") -> list[tuple[Optional[float], str]]:
    """``["0.7", "A", "0.3", "B"]`` -> [(0.7, "A"), (0.3, "B")]; ``["A", "B"]`` -> [(None, "A"), (None, "B")].

    Megatron's blend syntax: either prefixes only, or weight/prefix pairs (items as in :func:`data_path_items`).
    """
    tokens = data_path_items(values)
    is_number = [_is_float(t) for t in tokens]
    if not any(is_number):
        return [(None, t) for t in tokens]
    if len(tokens) % 2 or not all(is_number[0::2]) or any(is_number[1::2]):
        raise ConfigError(f"{flag}: expected PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...], "
                          f"got {' '.join(tokens)!r}")
    pairs = [(float(w), prefix) for w, prefix in zip(tokens[0::2], tokens[1::2])]
    if not all(math.isfinite(w) and w >= 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"{flag}: weights must be finite numbers >= 0 with a positive sum, "
                          f"got {' '.join(tokens)!r}")
    return pairs


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> [969, 30, 1] (also ``/``-separated; missing parts are 0)."""
    parts = split.replace("/", ",").split(",")
    try:
        values = [float(s) for s in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(values) > 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three finite numbers >= 0 with a positive sum, "
                          f"e.g. 969,30,1")
    return values + [0.0] * (3 - len(values))


# ---------------------------------------------------------------------------------------------
# Finite numbers.
# ---------------------------------------------------------------------------------------------

def check_finite(cfg: MeshtronConfig) -> None:
    """Every number of the configuration is finite: NaN never means anything, and infinity only where
    the field's definition says ``allow_inf`` (e.g. ``--exit-duration-in-mins inf``: never)."""
    for section in SECTIONS:
        values = getattr(cfg, section)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if not isinstance(value, float) or math.isfinite(value):
                continue
            if math.isinf(value) and f.metadata.get("allow_inf"):
                continue
            raise ConfigError(f"{flag_name(f.name)} must be a finite number, got {value}")


# ---------------------------------------------------------------------------------------------
# Model shape.
# ---------------------------------------------------------------------------------------------

def _check_mtp(cfg: MeshtronConfig) -> None:
    """Multi-token prediction (--mtp-num-layers): depths, loss weight, and the layouts it runs under."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is None:
        return
    if isinstance(m.mtp_num_layers, bool) or not isinstance(m.mtp_num_layers, int) or m.mtp_num_layers < 0:
        raise ConfigError(f"--mtp-num-layers must be a whole number >= 0 (0 or unset: no multi-token prediction), "
                          f"got {m.mtp_num_layers!r}")
    if m.mtp_num_layers == 0:
        return
    f = m.mtp_loss_scaling_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
        raise ConfigError(f"--mtp-loss-scaling-factor must be a finite number > 0 (Megatron's default 0.1), got {f!r}")
    if m.mtp_num_layers >= m.seq_length:
        raise ConfigError(f"--mtp-num-layers ({m.mtp_num_layers}) must be smaller than --seq-length "
                          f"({m.seq_length}): depth k predicts the token k+1 positions ahead")
    tp = p.tensor_model_parallel_size
    if tp > 1 and m.hidden_size % tp:
        raise ConfigError(f"--mtp-num-layers: --hidden-size ({m.hidden_size}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp}) (the projection of each depth is split over it)")


def _resolve_model(m: ModelConfig) -> None:
    if m.use_rotary_position_embeddings:
        m.position_embedding_type = "rope"
    if m.position_embedding_type == "yarn":
        _resolve_yarn_position(m)
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.num_query_groups is None:
        # Megatron's default for --group-query-attention is one group; without it every head has its own.
        m.num_query_groups = 1 if m.group_query_attention else m.num_attention_heads
    if m.ffn_hidden_size is None and _is_int(m.hidden_size) and m.hidden_size > 0:
        m.ffn_hidden_size = ffn_size(m)
    if m.num_experts and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size


def _resolve_yarn_position(m: ModelConfig) -> None:
    """Megatron's ``--position-embedding-type yarn`` (grouped-query attention) as meshtron's RoPE with
    ``--rope-type yarn``, refusing what megatron-core's ``YarnRotaryEmbedding`` would compute otherwise."""
    if m.multi_latent_attention:
        raise ConfigError("--position-embedding-type yarn is not for --multi-latent-attention: its YaRN is "
                          "--position-embedding-type rope --rope-type yarn")
    if m.rope_type == "rope":
        raise ConfigError("--rope-type rope contradicts --position-embedding-type yarn")
    if m.rotary_percent != 1:
        # megatron-core's YaRN table spans the whole head whatever --rotary-percent says
        raise ConfigError(f"--rotary-percent {m.rotary_percent} with --position-embedding-type yarn (megatron-core's "
                          "YaRN rotates the whole head: leave it at 1)")
    if m.use_rope_scaling:
        raise ConfigError("--use-rope-scaling (Llama-3.1 frequencies) contradicts --position-embedding-type yarn")
    m.position_embedding_type, m.rope_type = "rope", "yarn"


def _check_model(m: ModelConfig) -> None:
    if m.no_position_embedding and m.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding leaves the model without positions: use it with "
                          "--position-embedding-type rope (or --use-rotary-position-embeddings)")
    if m.zero_centred_norm and m.normalization != "RMSNorm":
        raise ConfigError("--zero-centred-norm scales an RMSNorm: it needs --normalization RMSNorm")
    _positive([("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
               ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
               ("--ffn-hidden-size", m.ffn_hidden_size), ("--num-query-groups", m.num_query_groups),
               ("--max-position-embeddings", m.max_position_embeddings),
               ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
               ("--moe-layer-freq", m.moe_layer_freq),
               ("--rope-original-max-position-embeddings", m.rope_original_max_position_embeddings)])
    _positive_if_set([("--kv-channels", m.kv_channels), ("--vocab-size", m.vocab_size),
                      ("--num-experts", m.num_experts), ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size),
                      ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                      ("--moe-expert-capacity-factor", m.moe_expert_capacity_factor)])
    if m.moe_first_dense_layers < 0:
        raise ConfigError(f"--moe-first-dense-layers must be >= 0, got {m.moe_first_dense_layers}")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity it "
                          "pads to)")
    for flag, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    for flag, value in (("--norm-epsilon", m.norm_epsilon), ("--rotary-base", m.rotary_base),
                        ("--rope-scaling-factor", m.rope_scaling_factor), ("--init-method-std", m.init_method_std)):
        if not value > 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads and not m.multi_latent_attention:
        raise ConfigError(f"--hidden-size ({m.hidden_size}) must be divisible by --num-attention-heads "
                          f"({m.num_attention_heads}), or set the head size with --kv-channels")
    if not m.group_query_attention and m.num_query_groups != m.num_attention_heads:
        raise ConfigError(f"--num-query-groups {m.num_query_groups} needs --group-query-attention "
                          f"(without it every one of the {m.num_attention_heads} heads has its own key/value)")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                          f"--num-query-groups ({m.num_query_groups})")
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"--max-position-embeddings ({m.max_position_embeddings}) must be at least --seq-length "
                          f"({m.seq_length}) with learned absolute positions")
    if m.num_experts:
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(f"--moe-router-topk must be in [1, --num-experts ({m.num_experts})], "
                              f"got {m.moe_router_topk}")
        for flag, value in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-z-loss-coeff", m.moe_z_loss_coeff),
                            ("--moe-router-bias-update-rate", m.moe_router_bias_update_rate)):
            if value is not None and value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
    if m.moe_router_force_skew:
        if not m.moe_router_force_skew > 0:
            raise ConfigError(f"--moe-router-force-skew must be >= 0, got {m.moe_router_force_skew}")
        if not m.moe_router_force_load_balancing:
            raise ConfigError("--moe-router-force-skew shapes the forced routing: it needs "
                              "--moe-router-force-load-balancing")
    _check_group_routing(m)
    _check_multi_latent_attention(m)
    check_pattern(m)  # --layer-pattern (or the one the flags imply): its syntax, length and each kind's needs
    scaling = m.moe_router_topk_scaling_factor
    if scaling is not None and not scaling > 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor must be positive, got {scaling}")


def _check_multi_latent_attention(m: ModelConfig) -> None:
    """MLA's head dims and ranks, and the RoPE variants that go with it."""
    if m.rope_type == "yarn" and m.position_embedding_type != "rope":
        raise ConfigError("--rope-type yarn needs --position-embedding-type rope")
    if m.rope_type == "yarn" and m.use_rope_scaling:
        raise ConfigError("--use-rope-scaling (Llama-3.1 frequencies) contradicts --rope-type yarn")
    if m.rope_type == "yarn" or m.multi_latent_attention:
        _positive([("--rotary-scaling-factor", m.rotary_scaling_factor),
                   ("--yarn-original-max-position-embeddings", m.yarn_original_max_position_embeddings),
                   ("--yarn-beta-fast", m.yarn_beta_fast), ("--yarn-beta-slow", m.yarn_beta_slow)])
    if not m.multi_latent_attention:
        return
    _positive([("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_head_dim),
               ("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim), ("--v-head-dim", m.v_head_dim)])
    _positive_if_set([("--q-lora-rank", m.q_lora_rank)])
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim must be even (RoPE rotates pairs), got {m.qk_pos_emb_head_dim}")
    if m.group_query_attention:
        raise ConfigError("--multi-latent-attention and --group-query-attention exclude each other (MLA's keys "
                          "and values come from one latent shared by all heads)")
    if m.position_embedding_type != "rope":
        raise ConfigError("--multi-latent-attention needs --position-embedding-type rope (RoPE acts on "
                          "--qk-pos-emb-head-dim of each head)")
    if m.qk_layernorm:
        raise ConfigError("--qk-layernorm is not implemented with --multi-latent-attention (MLA normalises its "
                          "latents instead)")
    if m.use_rope_scaling and m.rope_type != "rope":
        raise ConfigError("--use-rope-scaling (Llama-3.1 frequencies) goes with --rope-type rope; multi-latent "
                          "attention defaults to YaRN (--rotary-scaling-factor)")


def _check_group_routing(m: ModelConfig) -> None:
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing)")
    E, k = m.num_experts or 0, m.moe_router_topk
    if groups < 1 or E % groups:
        raise ConfigError(f"--moe-router-num-groups ({groups}) must divide --num-experts ({E})")
    if not 1 <= group_topk <= groups:
        raise ConfigError(f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups "
                          f"({groups})")
    if not group_topk <= k <= group_topk * (E // groups):
        raise ConfigError(f"--moe-router-topk ({k}) must be at least --moe-router-group-topk ({group_topk}) and at "
                          f"most the {group_topk * (E // groups)} experts of the chosen groups")


# ---------------------------------------------------------------------------------------------
# Parallel layout.
# ---------------------------------------------------------------------------------------------

def _check_parallel(cfg: MeshtronConfig) -> None:
    """Checks of the layout that do not depend on the world size."""
    m, p = cfg.model, cfg.parallel
    tp, cp, pp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                      p.expert_model_parallel_size)
    _positive([("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
               ("--pipeline-model-parallel-size", pp), ("--expert-model-parallel-size", ep),
               ("--expert-tensor-parallel-size", p.expert_tensor_parallel_size),
               ("--distributed-timeout-minutes", p.distributed_timeout_minutes)])
    _positive_if_set([("--ddp-bucket-size", p.ddp_bucket_size)])

    if m.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    groups = m.num_query_groups
    if groups % tp and tp % groups:
        raise ConfigError(f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp}), "
                          f"or TP a multiple of it (key/value heads are then replicated)")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    if p.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                          "over the tensor-parallel ranks)")
    if cp > 1 and m.seq_length % (2 * cp):
        raise ConfigError(f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size "
                          f"({cp}) = {2 * cp}")
    if p.sequence_parallel and m.seq_length % (tp * cp):
        raise ConfigError(f"--seq-length ({m.seq_length}) must be divisible by --tensor-model-parallel-size ({tp})"
                          + (f" x --context-parallel-size ({cp})" if cp > 1 else "") + " with --sequence-parallel")
    _check_cp_comm_type(cfg)
    layout_from_config(cfg)  # raises the error that names the flags of an impossible layer split
    _check_experts(cfg)
    if p.distributed_backend == "nccl" and cfg.train.device == "cpu":
        raise ConfigError("--distributed-backend nccl needs --device cuda (use gloo on CPU)")
    _check_sharding_strategy(cfg)


def _check_cp_comm_type(cfg: MeshtronConfig) -> None:
    """--cp-comm-type (one value), --hierarchical-context-parallel-sizes, and the heads all-to-all CP splits."""
    from meshtron.cp_comm_types import a2a_degree, check_a2a_heads, single_comm_type

    m, p = cfg.model, cfg.parallel
    p.cp_comm_type = single_comm_type(p.cp_comm_type)
    tp, cp, comm = p.tensor_model_parallel_size, p.context_parallel_size, p.cp_comm_type
    sizes = p.hierarchical_context_parallel_sizes or []
    try:
        sizes = [int(v) for v in sizes]
    except (TypeError, ValueError):
        raise ConfigError(f"--hierarchical-context-parallel-sizes: expected integers, got {sizes}") from None
    p.hierarchical_context_parallel_sizes = sizes
    if comm == "a2a+p2p":
        if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
            raise ConfigError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B with A x B = "
                              f"--context-parallel-size ({cp}), got {' '.join(map(str, sizes)) or 'none'}")
    elif sizes:
        raise ConfigError(f"--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p, not {comm}")
    degree = a2a_degree(comm, cp, sizes)
    mixers = {kinds.mixer.name: kinds.mixer for kinds in layer_kinds(m)}
    if cp > 1:
        for mixer in mixers.values():
            if not mixer.supports_context_parallel:
                raise ConfigError(f"--context-parallel-size {cp}: {mixer.name} layers (--layer-pattern) cannot "
                                  "split their sequence over context-parallel ranks")
    if cp > 1 and degree > 1:
        heads = m.num_attention_heads // tp
        for mixer in mixers.values():
            groups = mixer.cp_exchange_heads(m, tp)
            if groups:  # 0: the mixer exchanges no heads under a2a (gated DeltaNet gathers its states instead)
                check_a2a_heads(heads, groups, degree, tp, comm)


def _check_sharding_strategy(cfg: MeshtronConfig) -> None:
    """--data-parallel-sharding-strategy, its aliases and what each strategy composes with."""
    p, t = cfg.parallel, cfg.train
    explicit = p.data_parallel_sharding_strategy
    aliases = [f for f, on in (("--use-megatron-fsdp", p.use_megatron_fsdp), ("--use-torch-fsdp2", t.use_torch_fsdp2))
               if on]
    if explicit is not None and explicit not in SHARDING_STRATEGIES:
        raise ConfigError(f"--data-parallel-sharding-strategy must be {', '.join(SHARDING_STRATEGIES[:-1])} or "
                          f"{SHARDING_STRATEGIES[-1]}, got {explicit!r}")
    if aliases and explicit not in (None, "optim_grads_params"):
        raise ConfigError(f"{aliases[0]} means --data-parallel-sharding-strategy optim_grads_params, which "
                          f"contradicts --data-parallel-sharding-strategy {explicit}; drop one of them")
    if explicit == "no_shard" and p.use_distributed_optimizer:
        raise ConfigError("--use-distributed-optimizer shards the optimizer state, which contradicts "
                          "--data-parallel-sharding-strategy no_shard; drop one of them")
    strategy = sharding_strategy(cfg)
    if p.overlap_param_gather:
        if strategy == "optim" and not p.overlap_grad_reduce:
            raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce with the distributed optimizer")
        if strategy not in ("optim", "optim_grads"):
            raise ConfigError(f"--overlap-param-gather needs --use-distributed-optimizer (or "
                              f"--data-parallel-sharding-strategy optim / optim_grads); with {strategy} "
                              + ("there is no weight all-gather" if strategy == "no_shard" else
                                 "each layer's gather is always prefetched and overlapped")
                              + ": drop --overlap-param-gather")
    replicas = p.num_distributed_optimizer_instances
    if replicas < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be at least 1, got {replicas}")
    if p.data_parallel_shard_size is not None and p.data_parallel_shard_size < 1:
        raise ConfigError(f"--data-parallel-shard-size must be at least 1, got {p.data_parallel_shard_size}")
    if replicas > 1 and strategy == "no_shard":
        raise ConfigError(f"--num-distributed-optimizer-instances {replicas} (hybrid sharding) needs a sharded "
                          f"optimizer: add --use-distributed-optimizer or --data-parallel-sharding-strategy "
                          f"optim / optim_grads / optim_grads_params")
    if replicas > 1 and p.expert_model_parallel_size > 1:
        raise ConfigError("--num-distributed-optimizer-instances > 1 (hybrid sharding) is not implemented with "
                          "--expert-model-parallel-size > 1; use one of them")
    # optim_grads_params composes with --fp8-format (the weights are gathered in their own dtype and the
    # FP8 linears cast them per micro-batch) and with compiled layers (gathered outside the compiled call).


def _check_pipeline_schedule(cfg: MeshtronConfig) -> None:
    """--pipeline-schedule against the virtual stages (each schedule takes one chunk per rank, or several)."""
    p = cfg.parallel
    schedule = p.pipeline_schedule
    if schedule is None:
        return
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule!r} is not known; choose one of "
                          f"{', '.join(PIPELINE_SCHEDULES)}")
    if schedule == "zbv":
        _check_zbv(cfg)
        return
    virtual = p.virtual_pipeline_model_parallel_size or 1
    if schedule == "interleaved" and virtual == 1:
        raise ConfigError("--pipeline-schedule interleaved needs virtual stages: give "
                          "--virtual-pipeline-model-parallel-size > 1 or --num-layers-per-virtual-pipeline-stage")
    if schedule != "interleaved" and virtual > 1:
        raise ConfigError(f"--pipeline-schedule {schedule} runs one model chunk per pipeline rank, but "
                          f"--virtual-pipeline-model-parallel-size is {virtual}: use --pipeline-schedule interleaved "
                          f"or drop the virtual stages")


def _check_zbv(cfg: MeshtronConfig) -> None:
    """ZBV's V puts the embedding and the output layer on the first stage, in two model chunks."""
    m, p = cfg.model, cfg.parallel
    if p.pipeline_model_parallel_size < 2:
        raise ConfigError("--pipeline-schedule zbv needs --pipeline-model-parallel-size >= 2")
    if not m.untie_embeddings_and_output_weights:
        raise ConfigError("--pipeline-schedule zbv needs --untie-embeddings-and-output-weights: the tied input "
                          "embedding and output layer would sit in two model chunks of the first stage")
    if m.mtp_num_layers:
        raise ConfigError("--pipeline-schedule zbv does not run multi-token prediction (--mtp-num-layers); use "
                          "zero-bubble-h1 or 1f1b")


def _check_experts(cfg: MeshtronConfig) -> None:
    m, p = cfg.model, cfg.parallel
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if not m.num_experts:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model (--num-experts)")
        return
    if etp != tp:
        # The expert layers are split over the same TP ranks as the dense layers; there are no separate
        # expert tensor-parallel groups.
        raise ConfigError(f"--expert-tensor-parallel-size ({etp}) must equal --tensor-model-parallel-size ({tp}): "
                          f"experts are split over the same tensor-parallel ranks as the dense layers")
    if m.num_experts % ep:
        raise ConfigError(f"--num-experts ({m.num_experts}) must be divisible by --expert-model-parallel-size ({ep})")
    if m.moe_ffn_hidden_size % etp:
        raise ConfigError(f"--moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) must be divisible by "
                          f"--expert-tensor-parallel-size ({etp})")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        raise ConfigError(f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                          f"--tensor-model-parallel-size ({tp})")


def _check_experts_over_ranks(cfg: MeshtronConfig, dp: int) -> None:
    """Checks of the experts that need the data-parallel size."""
    if cfg.model.num_experts:
        check_expert_ranks(cfg.parallel.expert_model_parallel_size, dp, cfg.parallel.context_parallel_size)


def _resolve_shard_size(cfg: MeshtronConfig, dp: int) -> None:
    """--data-parallel-shard-size S sets --num-distributed-optimizer-instances to DP x CP / S (when it divides)."""
    p = cfg.parallel
    size, ranks = p.data_parallel_shard_size, dp * p.context_parallel_size
    if size and p.num_distributed_optimizer_instances == 1 and size <= ranks and ranks % size == 0:
        p.num_distributed_optimizer_instances = ranks // size


def _check_hybrid_sharding_over_ranks(cfg: MeshtronConfig, dp: int) -> None:
    """HSDP's replicas R (and shard size S) against the DP x CP ranks of a stage."""
    p = cfg.parallel
    ranks, replicas, size = dp * p.context_parallel_size, p.num_distributed_optimizer_instances, p.data_parallel_shard_size
    if size is not None and size * replicas != ranks:
        raise ConfigError(f"--data-parallel-shard-size ({size}) must divide data-parallel size ({dp}) x "
                          f"--context-parallel-size ({p.context_parallel_size}) = {ranks}"
                          + (f" and agree with --num-distributed-optimizer-instances {replicas}"
                             if ranks % size == 0 else ""))
    if ranks % replicas:
        raise ConfigError(f"--num-distributed-optimizer-instances ({replicas}) must divide data-parallel size "
                          f"({dp}) x --context-parallel-size ({p.context_parallel_size}) = {ranks}")


# ---------------------------------------------------------------------------------------------
# Batch and sample counts.
# ---------------------------------------------------------------------------------------------

def _resolve_batch_and_samples(cfg: MeshtronConfig, dp: int) -> None:
    """The global batch from DP, and Megatron's sample-based schedule: --train-samples, --lr-warmup-samples
    and --lr-decay-samples become iterations of --global-batch-size samples (the same schedule, since the
    batch size is fixed)."""
    t, o = cfg.train, cfg.optim
    if t.global_batch_size is None and _is_int(t.micro_batch_size) and t.micro_batch_size > 0:
        t.global_batch_size = t.micro_batch_size * dp
    gbs = t.global_batch_size
    if not (_is_int(gbs) and gbs > 0):
        return
    if _is_int(t.train_samples) and t.train_samples >= gbs:
        t.train_iters = t.train_samples // gbs  # takes precedence over --train-iters
    if o.lr_decay_iters is None and _is_int(o.lr_decay_samples) and o.lr_decay_samples > 0:
        o.lr_decay_iters = _decay_iters_of(o, gbs)
    if o.lr_warmup_iters == 0 and _is_int(o.lr_warmup_samples) and o.lr_warmup_samples >= 0:
        o.lr_warmup_iters = o.lr_warmup_samples // gbs


def _decay_iters_of(o: OptimConfig, gbs: int) -> int:
    return max(1, o.lr_decay_samples // gbs)


def _check_batch(cfg: MeshtronConfig, dp: int) -> None:
    """Checks of the batch that need the data-parallel size."""
    t, o = cfg.train, cfg.optim
    _positive([("--micro-batch-size", t.micro_batch_size), ("--global-batch-size", t.global_batch_size)])
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
                          f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")
    p = cfg.parallel
    check_micro_batches(t.global_batch_size // (t.micro_batch_size * dp), p.pipeline_model_parallel_size,
                        p.virtual_pipeline_model_parallel_size or 1)
    gbs = t.global_batch_size
    _positive_if_set([("--train-samples", t.train_samples), ("--lr-decay-samples", o.lr_decay_samples)])
    if o.lr_warmup_samples is not None and o.lr_warmup_samples < 0:
        raise ConfigError(f"--lr-warmup-samples must be >= 0, got {o.lr_warmup_samples}")
    if t.train_samples is not None and t.train_samples < gbs:
        raise ConfigError(f"--train-samples ({t.train_samples}) must be at least one --global-batch-size ({gbs})")
    if o.lr_decay_samples is not None and o.lr_decay_iters != _decay_iters_of(o, gbs):
        raise ConfigError(f"--lr-decay-samples and --lr-decay-iters exclude each other: give one of them "
                          f"(--lr-decay-samples {o.lr_decay_samples} is {_decay_iters_of(o, gbs)} iterations of "
                          f"--global-batch-size {gbs}, --lr-decay-iters says {o.lr_decay_iters})")
    if o.lr_warmup_samples is not None:
        if o.lr_warmup_fraction is not None or o.lr_warmup_iters != o.lr_warmup_samples // gbs:
            raise ConfigError("--lr-warmup-samples excludes --lr-warmup-iters and --lr-warmup-fraction: give one "
                              "of them")


def _check_batch_sizes(cfg: MeshtronConfig) -> None:
    _positive([("--micro-batch-size", cfg.train.micro_batch_size)])
    _positive_if_set([("--global-batch-size", cfg.train.global_batch_size)])


# ---------------------------------------------------------------------------------------------
# Precision, recomputation and Megatron flags meshtron refuses.
# ---------------------------------------------------------------------------------------------

def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # checking a configuration needs no torch; without it there is no CUDA either
        return False
    return torch.cuda.is_available()


def _resolve_precision_and_recompute(cfg: MeshtronConfig) -> None:
    t = cfg.train
    if t.recompute_activations and t.recompute_granularity is None:
        t.recompute_granularity = "selective"
    if t.device is None:
        t.device = "cuda" if _cuda_available() else "cpu"
    if not t.bf16 and not t.fp32:
        # bf16 with fp32 master weights on GPU; plain fp32 on CPU (--bf16 is allowed there, but slow).
        t.bf16, t.fp32 = (True, False) if t.device == "cuda" else (False, True)
    if t.fp8_hybrid and t.fp8_format is None:
        t.fp8_format = "hybrid"
    if t.compile is None:
        t.compile = t.device == "cuda"
    if t.recompute_granularity == "full" and t.recompute_method is None:
        t.recompute_method = "uniform"


def _check_precision_and_recompute(cfg: MeshtronConfig) -> None:
    t = cfg.train
    _check_unsupported_megatron_flags(cfg)
    _check_precision_aware_optimizer(cfg)
    if t.recompute_activations and t.recompute_granularity != "selective":
        raise ConfigError(f"--recompute-activations means --recompute-granularity selective; it contradicts "
                          f"--recompute-granularity {t.recompute_granularity}: give one of them")
    if t.device == "cuda" and not _cuda_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine (use --device cpu)")
    if t.fp16:
        raise ConfigError("--fp16 is not supported: use --bf16")
    if t.bf16 and t.fp32:
        raise ConfigError("--bf16 and --fp32 exclude each other: give one of them")
    if t.fp8_hybrid and t.fp8_format != "hybrid":
        raise ConfigError(f"--fp8-hybrid contradicts --fp8-format {t.fp8_format}")
    if t.fp8_format and not t.bf16:
        raise ConfigError(f"--fp8-format {t.fp8_format} needs --bf16 (FP8 matmuls take and give bf16 activations)")
    if t.fp8_format and t.fp8_recipe == "delayed":
        raise ConfigError("--fp8-recipe delayed is not implemented; use --fp8-recipe tensorwise (one current "
                          "scale per tensor), rowwise (one per row) or blockwise (one per tile)")
    if t.fp8_recipe == "rowwise" and t.fp8_format == "hybrid":
        raise ConfigError("--fp8-recipe rowwise takes --fp8-format e4m3 (the rowwise scaled matmul has no e5m2 "
                          "gradient path); use --fp8-recipe tensorwise for hybrid")
    if t.fp8_recipe == "blockwise" and t.fp8_format == "hybrid":
        raise ConfigError("--fp8-recipe blockwise takes --fp8-format e4m3 (its per-tile scales give gradients their "
                          "range, and the blockwise scaled matmul takes e4m3 only); use --fp8-recipe tensorwise for "
                          "hybrid")
    if t.fp8_format and t.fp8_recipe == "blockwise" and t.device == "cuda":
        from meshtron.layers.fp8.blockwise import gpu_support_error
        problem = gpu_support_error()
        if problem:
            raise ConfigError(problem)
    if t.fp8_experts and not t.fp8_format:
        raise ConfigError("--fp8-experts runs the experts' GEMMs in the FP8 recipe: it needs --fp8-format e4m3")
    if t.fp8_experts and not cfg.model.num_experts:
        raise ConfigError("--fp8-experts needs a mixture-of-experts model (--num-experts)")
    if t.fp8_experts and t.device == "cuda":
        # The routed experts' GEMMs run FP8 (meshtron.layers.fp8.grouped): torch's grouped FP8 kernel.
        from meshtron.layers.fp8.grouped import grouped_support_error
        m = cfg.model
        expert_tp = cfg.parallel.expert_tensor_parallel_size or cfg.parallel.tensor_model_parallel_size
        problem = grouped_support_error(m.hidden_size, (m.moe_ffn_hidden_size or ffn_size(m)) // expert_tp,
                                        t.fp8_recipe)
        if problem:
            raise ConfigError(problem)
    if cfg.parallel.async_tensor_parallel and not (t.device == "cuda" and t.compile and cfg.parallel.sequence_parallel):
        raise ConfigError("--async-tensor-parallel needs --device cuda, compiled layers (not --no-compile) and "
                          "--sequence-parallel with --tensor-model-parallel-size > 1")
    if t.recompute_method and t.recompute_granularity != "full":
        raise ConfigError(f"--recompute-method {t.recompute_method} needs --recompute-granularity full")
    if t.offload_activations and t.recompute_granularity == "full":
        # A fully recomputed layer saves only its input, inside the recomputation's own saved-tensor hooks.
        raise ConfigError("--offload-activations with --recompute-granularity full would move nothing: a fully "
                          "recomputed layer keeps only its input; use one of them, or --recompute-granularity "
                          "selective with --offload-activations")
    if t.offload_activations_num_layers is not None and (not t.offload_activations
                                                         or t.offload_activations_num_layers < 1):
        raise ConfigError("--offload-activations-num-layers needs --offload-activations and a value of at least 1, "
                          f"got {t.offload_activations_num_layers}")
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if t.recompute_granularity and tp > 1 and (m.attention_dropout > 0 or
                                                (m.hidden_dropout > 0 and cfg.parallel.sequence_parallel)):
        # The recomputed forward would draw other dropout masks from the tensor-parallel RNG stream.
        raise ConfigError(f"--recompute-granularity {t.recompute_granularity} with --tensor-model-parallel-size "
                          f"{tp} needs --attention-dropout 0 (and --hidden-dropout 0 with --sequence-parallel)")
    if t.recompute_num_layers < 1 or t.recompute_num_layers > cfg.model.num_layers:
        raise ConfigError(f"--recompute-num-layers must be in [1, --num-layers ({cfg.model.num_layers})], "
                          f"got {t.recompute_num_layers}")


def check_cuda_graphs(cfg: MeshtronConfig) -> None:
    """--enable-cuda-graph: where a graph can hold a whole layer's forward and backward."""
    t, p = cfg.train, cfg.parallel
    if not t.enable_cuda_graph:
        return
    if t.device != "cuda" or not t.compile:
        raise ConfigError("--enable-cuda-graph needs --device cuda and compiled layers (not --no-compile): the "
                          "graphs are those of torch.compile's layers")
    # A graph replays its kernels without the host, but the collectives inside a layer keep buffers of the
    # graph's memory pool alive past its recording (TP, CP); pipeline schedules keep several micro-batches
    # of a layer in flight, each of which would need its own graphs.
    for flag, size in (("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                       ("--context-parallel-size", p.context_parallel_size),
                       ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size)):
        if size > 1:
            raise ConfigError(f"--enable-cuda-graph needs {flag} 1 (got {size}): a layer's graph can hold no "
                              "collective and one micro-batch at a time; drop --enable-cuda-graph")
    if t.offload_activations:
        raise ConfigError("--enable-cuda-graph and --offload-activations exclude each other: the offloader moves "
                          "what a layer saves between its forward and backward, which the graphs keep in their "
                          "own memory; give one of them")
    if sharding_strategy(cfg) == "optim_grads_params":
        raise ConfigError("--enable-cuda-graph does not work with --data-parallel-sharding-strategy "
                          "optim_grads_params: its weights are gathered into new memory before every layer, which "
                          "a graph cannot read; use optim_grads or drop --enable-cuda-graph")


def _check_precision_aware_optimizer(cfg: MeshtronConfig) -> None:
    """Adam moments below fp32 only on request, and the state kinds meshtron keeps in fp32."""
    o = cfg.optim
    low = [f"--{name.replace('_', '-')} {getattr(o, name)}" for name in ("exp_avg_dtype", "exp_avg_sq_dtype")
           if getattr(o, name) != "fp32"]
    if low and not o.use_precision_aware_optimizer:
        raise ConfigError(f"{' and '.join(low)} needs --use-precision-aware-optimizer")
    if o.main_grads_dtype != "fp32" and not o.use_precision_aware_optimizer:
        raise ConfigError(f"--main-grads-dtype {o.main_grads_dtype} needs --use-precision-aware-optimizer")
    if o.main_grads_dtype == "bf16" and not cfg.train.bf16:
        raise ConfigError("--main-grads-dtype bf16 needs --bf16: with --fp32 the weights and their gradients are "
                          "fp32; use --main-grads-dtype fp32")
    if low and o.optimizer_cpu_offload:
        raise ConfigError(f"{' and '.join(low)} with --optimizer-cpu-offload is not implemented: the host step "
                          "keeps fp32 moments; drop one of them")


def _check_unsupported_megatron_flags(cfg: MeshtronConfig) -> None:
    """Megatron-LM flags that meshtron parses so that it can say why it does not do what they ask."""
    t = cfg.train
    if t.fp8_amax_history_len is not None or t.fp8_amax_compute_algo is not None:
        flag = "--fp8-amax-history-len" if t.fp8_amax_history_len is not None else "--fp8-amax-compute-algo"
        raise ConfigError(f"{flag} configures delayed FP8 scaling, which meshtron does not implement: it scales "
                          f"from current values (--fp8-recipe tensorwise, rowwise or blockwise); drop {flag}")
    if t.rampup_batch_size:
        raise ConfigError("--rampup-batch-size is not supported: train with a fixed --global-batch-size")
    for flag, value in (("--loss-scale", t.loss_scale), ("--initial-loss-scale", t.initial_loss_scale)):
        if value is not None:
            raise ConfigError(f"{flag} belongs to fp16 training, which meshtron does not support: use --bf16 "
                              f"(no loss scaling needed) and drop {flag}")


# ---------------------------------------------------------------------------------------------
# Optimizer, schedule and training loop.
# ---------------------------------------------------------------------------------------------

_FP32_MAX = 3.4028234663852886e38


def _check_optim(o: OptimConfig) -> None:
    _positive([("--max-nonfinite-steps", o.max_nonfinite_steps)])
    _positive_if_set([("--lr-decay-iters", o.lr_decay_iters), ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters),
                      ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples)])
    if o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_samples is not None:
        raise ConfigError("--lr-wsd-decay-iters and --lr-wsd-decay-samples exclude each other: give one of them")
    for flag, value in (("--lr", o.lr), ("--min-lr", o.min_lr), ("--lr-warmup-init", o.lr_warmup_init),
                        ("--lr-warmup-iters", o.lr_warmup_iters), ("--weight-decay", o.weight_decay),
                        ("--clip-grad", o.clip_grad)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
        if not math.isfinite(value) or value > _FP32_MAX:  # the optimizer computes in fp32: inf there
            raise ConfigError(f"{flag} must be a finite number an fp32 optimizer can hold (at most 3.4e38), "
                              f"got {value}")
    if o.lr < o.min_lr:
        raise ConfigError(f"--lr ({o.lr}) must be at least --min-lr ({o.min_lr})")
    if o.lr_warmup_fraction is not None:
        if not 0.0 <= o.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got {o.lr_warmup_fraction}")
        if o.lr_warmup_iters:
            raise ConfigError("give either --lr-warmup-fraction or --lr-warmup-iters, not both")
    decay = o.lr_decay_iters  # None only while the sample count waits for the world size
    if decay is not None and o.lr_warmup_iters and o.lr_warmup_iters >= decay:
        raise ConfigError(f"--lr-warmup-iters ({o.lr_warmup_iters}) must be smaller than --lr-decay-iters "
                          f"({decay}, default --train-iters)")
    if decay is not None and o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_iters > decay:
        raise ConfigError(f"--lr-wsd-decay-iters ({o.lr_wsd_decay_iters}) must be at most --lr-decay-iters "
                          f"({decay})")
    for flag, value in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    if not o.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be positive, got {o.adam_eps}")
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1], got {o.optimizer_offload_fraction}")


def _check_optimizer_kind(cfg: MeshtronConfig) -> None:
    """The ``--optimizer`` entry's own checks (meshtron.optim.registry)."""
    from meshtron.optim import registry

    registry.check(cfg)


def _check_training(cfg: MeshtronConfig) -> None:
    t = cfg.train
    lg = cfg.log
    if not all(_is_int(r) and int(r) >= 0 for r in lg.profile_ranks):
        given = " ".join(map(str, lg.profile_ranks))
        raise ConfigError(f"--profile-ranks takes global rank numbers, got {given}")
    if lg.record_memory_history and t.device != "cuda":
        raise ConfigError("--record-memory-history records the CUDA allocator: it needs --device cuda")
    if lg.profile and not 1 <= lg.profile_step_start < lg.profile_step_end:
        raise ConfigError(f"--profile-step-start ({lg.profile_step_start}) must be at least 1 and below "
                          f"--profile-step-end ({lg.profile_step_end})")
    if t.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}")
    if t.manual_gc_interval and not t.manual_gc:
        raise ConfigError("--manual-gc-interval needs --manual-gc")
    if t.train_iters <= 0:
        raise ConfigError(f"--train-iters must be positive, got {t.train_iters}")
    if t.seed < 0:
        # The data order's generators (numpy) take non-negative seeds only.
        raise ConfigError(f"--seed must be >= 0, got {t.seed}")
    for flag, value in (("--eval-interval", t.eval_interval), ("--eval-iters", t.eval_iters)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0 (0 disables), got {value}")
    _positive_if_set([("--exit-interval", t.exit_interval), ("--exit-duration-in-mins", t.exit_duration_in_mins)])


# ---------------------------------------------------------------------------------------------
# Files: data, tokenizer, checkpoints, logging.
# ---------------------------------------------------------------------------------------------

def _check_data(d: DataConfig, m: ModelConfig) -> None:
    parse_split(d.split)
    separate = [("--train-data-path", d.train_data_path), ("--valid-data-path", d.valid_data_path),
                ("--test-data-path", d.test_data_path)]
    if d.mock_data and d.data_order == "megatron":
        raise ConfigError("--data-order megatron orders indexed data (--data-path, --train-data-path or the built-in "
                          "corpus); --mock-data draws its own random tokens: drop one of them")
    if d.mock_data:
        for flag, value in [("--data-path", d.data_path), *separate]:
            if value:
                raise ConfigError(f"--mock-data and {flag} exclude each other: give one of them")
    if d.data_path and any(v for _, v in separate):
        raise ConfigError("give either --data-path (with --split) or --train-data-path/--valid-data-path/"
                          "--test-data-path, not both")
    for flag, value in [("--data-path", d.data_path), *separate]:
        if value:
            for _, prefix in parse_data_path(value, flag):
                for suffix in (".bin", ".idx"):
                    if not os.path.isfile(prefix + suffix):
                        spaces = (" (one item with spaces is one path: give several prefixes as separate items)"
                                  if any(c.isspace() for c in prefix) else "")
                        raise ConfigError(f"{flag}: {prefix + suffix} does not exist (a dataset prefix needs "
                                          f"PREFIX.bin and PREFIX.idx, made by `meshtron preprocess`){spaces}")
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {d.num_workers}")
    _check_tokenizer(d, m)


def _check_tokenizer(d: DataConfig, m: ModelConfig) -> None:
    for flag, path in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag}: file {path} does not exist")
    kind = d.tokenizer_type
    if kind == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        raise ConfigError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer") and not d.tokenizer_model:
        raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if kind == "NullTokenizer" and not m.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    eod = d.null_tokenizer_eod_id
    if eod is not None:
        if kind != "NullTokenizer":
            raise ConfigError("--null-tokenizer-eod-id is for --tokenizer-type NullTokenizer, not "
                              f"{kind or 'the tokenizer of --data-path'}")
        if not 0 <= eod < m.vocab_size:
            raise ConfigError(f"--null-tokenizer-eod-id {eod} must be in 0..{m.vocab_size - 1} (--vocab-size "
                              f"{m.vocab_size})")
    path = d.tokenizer_model
    if path and not os.path.exists(path) and not (kind == "HuggingFaceTokenizer" and _looks_like_hub_id(path)):
        raise ConfigError(f"--tokenizer-model: {path} does not exist")


def check_vocab_size(m: ModelConfig, tokenizer_vocab: int, tokenizer_kind: str) -> None:
    """``--vocab-size`` beside a tokenizer: the model takes the tokenizer's vocabulary (as Megatron does), so a
    smaller ``--vocab-size`` would be ignored while the user believes the embedding is that small: refuse it.

    Called by the data pipeline once the tokenizer is loaded (its size is not known before). Passes: no
    ``--vocab-size``, the ``--model`` preset's own size (a published shape, which the tokenizer replaces), and
    NullTokenizer, whose vocabulary is ``--vocab-size``.
    """
    from meshtron.presets import PRESETS  # presets import the accounting code: only when a tokenizer is loaded

    given = m.vocab_size
    from_preset = m.model in PRESETS and PRESETS[m.model][0].get("vocab_size") == given
    if given is None or from_preset or tokenizer_kind == "NullTokenizer" or given >= tokenizer_vocab:
        return
    raise ConfigError(f"--vocab-size {given} is smaller than the tokenizer's vocabulary of {tokenizer_vocab} "
                      f"tokens ({tokenizer_kind}): the model takes the tokenizer's size; drop --vocab-size or give "
                      f"at least {tokenizer_vocab}")


def _looks_like_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id, resolved from the local cache) rather than a path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def _check_checkpoint(c: CheckpointConfig) -> None:
    _positive_if_set([("--save-interval", c.save_interval), ("--save-retain", c.save_retain)])
    if c.load == "":
        raise ConfigError("--load: expected a checkpoint directory, got an empty path")
    # --load DIR --save DIR with a DIR that does not exist yet is the usual start of a resumable run.
    if c.load is not None and os.path.exists(c.load) and not os.path.isdir(c.load):
        raise ConfigError(f"--load: {c.load} is a file, not a checkpoint directory (give a --save directory or "
                          "one of its iter_N directories)")
    if c.load is not None and not os.path.isdir(c.load) and c.load != c.save:
        raise ConfigError(f"--load: directory {c.load} does not exist")
    if c.save is not None:
        _ensure_writable_dir(c.save, "--save")
    if c.export_megatron is not None:
        if c.save is None:
            raise ConfigError("--export-megatron converts the last checkpoint saved to --save: give --save too")
        _ensure_writable_dir(c.export_megatron, "--export-megatron")


def _check_logging(lg: LogConfig) -> None:
    _positive([("--log-interval", lg.log_interval)])
    _positive_if_set([("--peak-tflops", lg.peak_tflops)])
    if lg.wandb_project and not _module_available("wandb"):
        raise ConfigError("--wandb-project needs the wandb package: pip install 'meshtron[wandb]'")
    if lg.tensorboard_dir:
        if not _module_available("tensorboard"):
            raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install 'meshtron[tb]'")
        _ensure_writable_dir(lg.tensorboard_dir, "--tensorboard-dir")
    if lg.metrics_file:
        parent = os.path.dirname(os.path.abspath(lg.metrics_file))
        _ensure_writable_dir(parent, "--metrics-file")


def _ensure_writable_dir(path: str, flag: str) -> None:
    """Create ``path`` if needed and check that files can be written there.

    The one effect of :func:`check`, and on the file system only: a directory the run will write
    to anyway is made now, so that a path that cannot be made fails before any work.
    """
    if not path:
        raise ConfigError(f"{flag}: expected a directory, got an empty path")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag}: cannot create directory {path} ({_why_not_a_dir(path, err)})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: directory {path} is not writable")


def _why_not_a_dir(path: str, err: OSError) -> str:
    """Why ``os.makedirs(path)`` failed, in words: mkdir reports a file or a symlink loop in the way as
    "File exists", which does not say what to fix."""
    parts = os.path.normpath(path).split(os.sep)
    for i in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        if os.path.islink(prefix):
            try:
                os.stat(prefix)
            except OSError as stat_err:
                kind = "a symbolic link loop" if stat_err.errno == errno.ELOOP else "a dangling symbolic link"
                return f"{prefix} is {kind}: {prefix} -> {os.readlink(prefix)}"
        if os.path.exists(prefix) and not os.path.isdir(prefix):
            return f"{prefix} is a file, not a directory"
    return err.strerror or str(err)


# ---------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------

def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _positive(items: Iterable[tuple[str, object]]) -> None:
    for flag, value in items:
        if value is None or not value > 0:
            raise ConfigError(f"{flag} must be positive, got {value}")


def _positive_if_set(items: Iterable[tuple[str, object]]) -> None:
    _positive((flag, value) for flag, value in items if value is not None)


def _is_int(value: object) -> bool:
    """An integer, or its decimal spelling (``--profile-ranks`` arrive as strings)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    try:
        int(str(value))
    except ValueError:
        return False
    return True


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


__all__ = ["validate_config", "validate_run", "resolve", "check", "check_finite", "check_expert_ranks", "check_vocab_size",
           "data_parallel_size", "data_parallel_size_of", "data_path_items", "layout_from_config", "parse_data_path",
           "parse_split"]
