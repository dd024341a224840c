"""Checks and derived defaults of a whole configuration, run before any work.

``validate_config`` fills the defaults that depend on other fields (data-parallel
size, device, precision, ...) and raises :class:`meshtron.config.ConfigError`
with a one-line message that names the flag, the numbers involved and what
would be valid. It is idempotent: validating twice with the same world size
gives the same configuration.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Iterable, Optional, Sequence

from meshtron.config import (
    CheckpointConfig, ConfigError, DataConfig, LogConfig, MeshtronConfig, ModelConfig, OptimConfig, ffn_size,
)
from meshtron.launcher import check_launcher


def validate_config(cfg: MeshtronConfig, world_size: Optional[int] = 1) -> None:
    """Fill derived defaults of ``cfg`` in place and check every constraint.

    ``world_size`` is the number of processes of the run; ``None`` (an elastic
    launch whose size is not known yet) skips the checks that depend on it.
    """
    _fill_model(cfg.model)
    _check_model(cfg.model)
    _fill_precision_and_recompute(cfg)
    _check_parallel(cfg)
    if world_size is not None:
        dp = data_parallel_size(cfg, world_size)
        _check_layout(cfg, dp)
        _fill_and_check_batch(cfg, dp)
        _samples_to_iterations(cfg)
    _check_batch_sizes(cfg)
    _check_training(cfg)
    _check_optim(cfg.optim, cfg.train.train_iters)
    _check_data(cfg.data, cfg.model)
    _check_checkpoint(cfg.checkpoint)
    _check_logging(cfg.log)
    check_launcher(cfg.parallel)


def data_parallel_size(cfg: MeshtronConfig, world_size: int) -> int:
    """DP = world / (TP x CP x PP); ConfigError when the world size does not factor."""
    p = cfg.parallel
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    _positive([("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
               ("--pipeline-model-parallel-size", pp)])
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    if world_size % (tp * cp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by TP({tp}) x CP({cp}) x PP({pp}) = {tp * cp * pp}: "
            f"choose --tensor-model-parallel-size, --context-parallel-size and --pipeline-model-parallel-size "
            f"whose product divides {world_size}")
    return world_size // (tp * cp * pp)


def parse_data_path(values: Sequence[str], flag: str = "--data-path") -> list[tuple[Optional[float], str]]:
    """``["0.7", "A", "0.3", "B"]`` -> [(0.7, "A"), (0.3, "B")]; ``["A", "B"]`` -> [(None, "A"), (None, "B")].

    Megatron's blend syntax: either prefixes only, or weight/prefix pairs.
    """
    tokens = [t for v in values for t in str(v).split()]
    is_number = [_is_float(t) for t in tokens]
    if not any(is_number):
        return [(None, t) for t in tokens]
    if len(tokens) % 2 or not all(is_number[0::2]) or any(is_number[1::2]):
        raise ConfigError(f"{flag}: expected PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...], "
                          f"got {' '.join(tokens)!r}")
    pairs = [(float(w), prefix) for w, prefix in zip(tokens[0::2], tokens[1::2])]
    if any(w < 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"{flag}: weights must be >= 0 with a positive sum, got {' '.join(tokens)!r}")
    return pairs


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> [969, 30, 1] (also ``/``-separated; missing parts are 0)."""
    parts = split.replace("/", ",").split(",")
    try:
        values = [float(s) for s in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three numbers >= 0 with a positive sum, e.g. 969,30,1")
    return values + [0.0] * (3 - len(values))


# ---------------------------------------------------------------------------------------------
# Model shape.
# ---------------------------------------------------------------------------------------------

def _fill_model(m: ModelConfig) -> None:
    if m.use_rotary_position_embeddings:
        m.position_embedding_type = "rope"
    if m.no_position_embedding and m.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding leaves the model without positions: use it with "
                          "--position-embedding-type rope (or --use-rotary-position-embeddings)")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.group_query_attention:
        if m.num_query_groups is None:
            m.num_query_groups = 1  # Megatron's default for --group-query-attention
    elif m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    if m.ffn_hidden_size is None and m.hidden_size > 0:
        m.ffn_hidden_size = ffn_size(m)
    if m.num_experts and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size


def _check_model(m: ModelConfig) -> None:
    _positive([("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
               ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
               ("--ffn-hidden-size", m.ffn_hidden_size), ("--num-query-groups", m.num_query_groups),
               ("--max-position-embeddings", m.max_position_embeddings),
               ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
               ("--moe-layer-freq", m.moe_layer_freq)])
    _positive_if_set([("--kv-channels", m.kv_channels), ("--vocab-size", m.vocab_size),
                      ("--num-experts", m.num_experts), ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size),
                      ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                      ("--moe-expert-capacity-factor", m.moe_expert_capacity_factor)])
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
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
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


# ---------------------------------------------------------------------------------------------
# Parallel layout.
# ---------------------------------------------------------------------------------------------

def _check_parallel(cfg: MeshtronConfig) -> None:
    """Checks of the layout that do not depend on the world size."""
    m, p = cfg.model, cfg.parallel
    tp, cp, pp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                      p.expert_model_parallel_size)
    _positive([("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
               ("--pipeline-model-parallel-size", pp), ("--expert-model-parallel-size", ep)])
    if p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = tp
    _positive([("--expert-tensor-parallel-size", p.expert_tensor_parallel_size),
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
    _check_pipeline_layers(cfg)
    _check_experts(cfg)
    if p.distributed_backend == "nccl" and cfg.train.device == "cpu":
        raise ConfigError("--distributed-backend nccl needs --device cuda (use gloo on CPU)")
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")


def _check_pipeline_layers(cfg: MeshtronConfig) -> None:
    """Layers must split over the pipeline stages and virtual stages (meshtron.pipeline.partition raises
    the error that names the flags); a virtual stage count given as layers per virtual stage is resolved."""
    from meshtron.pipeline.partition import layout_from_config

    layout = layout_from_config(cfg)
    if cfg.parallel.num_layers_per_virtual_pipeline_stage:
        cfg.parallel.virtual_pipeline_model_parallel_size = layout.virtual_stages


def _check_experts(cfg: MeshtronConfig) -> None:
    m, p = cfg.model, cfg.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if not m.num_experts:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model (--num-experts)")
        return
    if m.num_experts % ep:
        raise ConfigError(f"--num-experts ({m.num_experts}) must be divisible by --expert-model-parallel-size ({ep})")
    if m.moe_ffn_hidden_size % etp:
        raise ConfigError(f"--moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) must be divisible by "
                          f"--expert-tensor-parallel-size ({etp})")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % p.tensor_model_parallel_size:
        raise ConfigError(f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                          f"--tensor-model-parallel-size ({p.tensor_model_parallel_size})")


def _check_layout(cfg: MeshtronConfig, dp: int) -> None:
    """Checks that need the data-parallel size."""
    p = cfg.parallel
    tp, cp, ep, etp = (p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size,
                       p.expert_tensor_parallel_size)
    if not cfg.model.num_experts:
        return
    # Experts split the DP x CP ranks of a stage (and, with their own tensor-parallel size ETP, its TP ranks).
    if etp == tp and (dp * cp) % ep:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) must divide data-parallel size ({dp}) x "
                          f"--context-parallel-size ({cp}) = {dp * cp}")
    if (tp * cp * dp) % (etp * ep):
        raise ConfigError(f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must divide "
                          f"TP({tp}) x CP({cp}) x data-parallel size ({dp}) = {tp * cp * dp}")


# ---------------------------------------------------------------------------------------------
# Batch, precision, optimizer, training.
# ---------------------------------------------------------------------------------------------

def _fill_and_check_batch(cfg: MeshtronConfig, dp: int) -> None:
    t = cfg.train
    _positive([("--micro-batch-size", t.micro_batch_size)])
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _positive([("--global-batch-size", t.global_batch_size)])
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
                          f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")
    from meshtron.pipeline.partition import check_micro_batches

    p = cfg.parallel
    check_micro_batches(t.global_batch_size // (t.micro_batch_size * dp), p.pipeline_model_parallel_size,
                        p.virtual_pipeline_model_parallel_size or 1)


def _samples_to_iterations(cfg: MeshtronConfig) -> None:
    """Megatron's sample-based schedule: --train-samples, --lr-warmup-samples and --lr-decay-samples become
    iterations of --global-batch-size samples (the same schedule, since the batch size is fixed)."""
    t, o = cfg.train, cfg.optim
    gbs = t.global_batch_size
    _positive_if_set([("--train-samples", t.train_samples), ("--lr-decay-samples", o.lr_decay_samples)])
    if o.lr_warmup_samples is not None and o.lr_warmup_samples < 0:
        raise ConfigError(f"--lr-warmup-samples must be >= 0, got {o.lr_warmup_samples}")
    if t.train_samples is not None:
        if t.train_samples < gbs:
            raise ConfigError(f"--train-samples ({t.train_samples}) must be at least one --global-batch-size "
                              f"({gbs})")
        t.train_iters = t.train_samples // gbs
    if o.lr_decay_samples is not None:
        if o.lr_decay_iters is not None:
            raise ConfigError("--lr-decay-samples and --lr-decay-iters exclude each other: give one of them")
        o.lr_decay_iters = max(1, o.lr_decay_samples // gbs)
    if o.lr_warmup_samples is not None:
        if o.lr_warmup_iters or o.lr_warmup_fraction is not None:
            raise ConfigError("--lr-warmup-samples excludes --lr-warmup-iters and --lr-warmup-fraction: give one "
                              "of them")
        o.lr_warmup_iters = o.lr_warmup_samples // gbs


def _check_batch_sizes(cfg: MeshtronConfig) -> None:
    _positive([("--micro-batch-size", cfg.train.micro_batch_size)])
    _positive_if_set([("--global-batch-size", cfg.train.global_batch_size)])


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _fill_precision_and_recompute(cfg: MeshtronConfig) -> None:
    t = cfg.train
    _check_unsupported_megatron_flags(cfg)
    if t.recompute_activations:
        if t.recompute_granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective; it contradicts "
                              "--recompute-granularity full: give one of them")
        t.recompute_granularity = "selective"
    if t.device is None:
        t.device = "cuda" if _cuda_available() else "cpu"
    elif t.device == "cuda" and not _cuda_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine (use --device cpu)")
    if t.fp16:
        raise ConfigError("--fp16 is not supported: use --bf16")
    if t.bf16 and t.fp32:
        raise ConfigError("--bf16 and --fp32 exclude each other: give one of them")
    if not t.bf16 and not t.fp32:
        # bf16 with fp32 master weights on GPU; plain fp32 on CPU (--bf16 is allowed there, but slow).
        t.bf16, t.fp32 = (True, False) if t.device == "cuda" else (False, True)
    if t.fp8_hybrid:
        if t.fp8_format not in (None, "hybrid"):
            raise ConfigError(f"--fp8-hybrid contradicts --fp8-format {t.fp8_format}")
        t.fp8_format = "hybrid"
    if t.fp8_format and not t.bf16:
        raise ConfigError(f"--fp8-format {t.fp8_format} needs --bf16 (FP8 matmuls take and give bf16 activations)")
    if t.fp8_format and t.fp8_recipe == "delayed":
        raise ConfigError("--fp8-recipe delayed is not implemented; use --fp8-recipe tensorwise (one current "
                          "scale per tensor) or rowwise (one per row)")
    if t.fp8_recipe == "rowwise" and t.fp8_format == "hybrid":
        raise ConfigError("--fp8-recipe rowwise takes --fp8-format e4m3 (the rowwise scaled matmul has no e5m2 "
                          "gradient path); use --fp8-recipe tensorwise for hybrid")
    if t.compile is None:
        t.compile = t.device == "cuda"
    if cfg.parallel.async_tensor_parallel and not (t.device == "cuda" and t.compile and cfg.parallel.sequence_parallel):
        raise ConfigError("--async-tensor-parallel needs --device cuda, compiled layers (not --no-compile) and "
                          "--sequence-parallel with --tensor-model-parallel-size > 1")
    if t.recompute_method and t.recompute_granularity != "full":
        raise ConfigError(f"--recompute-method {t.recompute_method} needs --recompute-granularity full")
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if t.recompute_granularity and tp > 1 and (m.attention_dropout > 0 or
                                                (m.hidden_dropout > 0 and cfg.parallel.sequence_parallel)):
        # The recomputed forward would draw other dropout masks from the tensor-parallel RNG stream.
        raise ConfigError(f"--recompute-granularity {t.recompute_granularity} with --tensor-model-parallel-size "
                          f"{tp} needs --attention-dropout 0 (and --hidden-dropout 0 with --sequence-parallel)")
    if t.recompute_granularity == "full" and t.recompute_method is None:
        t.recompute_method = "uniform"
    if t.recompute_num_layers < 1 or t.recompute_num_layers > cfg.model.num_layers:
        raise ConfigError(f"--recompute-num-layers must be in [1, --num-layers ({cfg.model.num_layers})], "
                          f"got {t.recompute_num_layers}")


def _check_optim(o: OptimConfig, train_iters: int) -> None:
    if o.lr_decay_iters is None:
        o.lr_decay_iters = train_iters
    _positive([("--lr-decay-iters", o.lr_decay_iters), ("--max-nonfinite-steps", o.max_nonfinite_steps)])
    _positive_if_set([("--lr-wsd-decay-iters", o.lr_wsd_decay_iters)])
    for flag, value in (("--lr", o.lr), ("--min-lr", o.min_lr), ("--lr-warmup-init", o.lr_warmup_init),
                        ("--lr-warmup-iters", o.lr_warmup_iters), ("--weight-decay", o.weight_decay),
                        ("--clip-grad", o.clip_grad)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    if o.lr < o.min_lr:
        raise ConfigError(f"--lr ({o.lr}) must be at least --min-lr ({o.min_lr})")
    if o.lr_warmup_fraction is not None:
        if not 0.0 <= o.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got {o.lr_warmup_fraction}")
        if o.lr_warmup_iters:
            raise ConfigError("give either --lr-warmup-fraction or --lr-warmup-iters, not both")
    if o.lr_warmup_iters and o.lr_warmup_iters >= o.lr_decay_iters:
        raise ConfigError(f"--lr-warmup-iters ({o.lr_warmup_iters}) must be smaller than --lr-decay-iters "
                          f"({o.lr_decay_iters}, default --train-iters)")
    if o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_iters > o.lr_decay_iters:
        raise ConfigError(f"--lr-wsd-decay-iters ({o.lr_wsd_decay_iters}) must be at most --lr-decay-iters "
                          f"({o.lr_decay_iters})")
    for flag, value in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    if not o.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be positive, got {o.adam_eps}")
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1], got {o.optimizer_offload_fraction}")


def _check_unsupported_megatron_flags(cfg: MeshtronConfig) -> None:
    """Megatron-LM flags that meshtron parses so that it can say why it does not do what they ask."""
    t = cfg.train
    if t.fp8_amax_history_len is not None or t.fp8_amax_compute_algo is not None:
        flag = "--fp8-amax-history-len" if t.fp8_amax_history_len is not None else "--fp8-amax-compute-algo"
        raise ConfigError(f"{flag} configures delayed FP8 scaling, which meshtron does not implement: it scales "
                          f"from current values (--fp8-recipe tensorwise or rowwise); drop {flag}")
    if t.use_torch_fsdp2:
        raise ConfigError("--use-torch-fsdp2 is not supported: meshtron shards the optimizer state with "
                          "--use-distributed-optimizer (add --optimizer-cpu-offload, or tensor/pipeline "
                          "parallelism, when the model does not fit)")
    if t.rampup_batch_size:
        raise ConfigError("--rampup-batch-size is not supported: train with a fixed --global-batch-size")
    for flag, value in (("--loss-scale", t.loss_scale), ("--initial-loss-scale", t.initial_loss_scale)):
        if value is not None:
            raise ConfigError(f"{flag} belongs to fp16 training, which meshtron does not support: use --bf16 "
                              f"(no loss scaling needed) and drop {flag}")
    _check_group_routing(cfg.model)
    scaling = cfg.model.moe_router_topk_scaling_factor
    if scaling is not None and not scaling > 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor must be positive, got {scaling}")


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


def _check_training(cfg: MeshtronConfig) -> None:
    t = cfg.train
    lg = cfg.log
    try:
        lg.profile_ranks = [int(r) for r in lg.profile_ranks]
    except (TypeError, ValueError):
        given = " ".join(map(str, lg.profile_ranks))
        raise ConfigError(f"--profile-ranks takes global rank numbers, got {given}") from None
    if lg.record_memory_history and t.device != "cuda":
        raise ConfigError("--record-memory-history records the CUDA allocator: it needs --device cuda")
    if lg.profile and not 1 <= lg.profile_step_start < lg.profile_step_end:
        raise ConfigError(f"--profile-step-start ({lg.profile_step_start}) must be at least 1 and below "
                          f"--profile-step-end ({lg.profile_step_end})")
    if t.timing_log_level not in (0, 1, 2):
        raise ConfigError(f"--timing-log-level must be 0, 1 or 2, got {t.timing_log_level}")
    if t.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}")
    if t.manual_gc_interval and not t.manual_gc:
        raise ConfigError("--manual-gc-interval needs --manual-gc")
    if t.train_iters <= 0:
        raise ConfigError(f"--train-iters must be positive, got {t.train_iters}")
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
                        raise ConfigError(f"{flag}: {prefix + suffix} does not exist (a dataset prefix needs "
                                          f"PREFIX.bin and PREFIX.idx, made by `meshtron preprocess`)")
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {d.num_workers}")
    _check_tokenizer(d, m)


def _check_tokenizer(d: DataConfig, m: ModelConfig) -> None:
    for flag, path in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag}: file {path} does not exist")
    if d.tokenizer_type is None and d.vocab_file and d.merge_file:
        d.tokenizer_type = "GPT2BPETokenizer"  # Megatron scripts pass only --vocab-file/--merge-file
    kind = d.tokenizer_type
    if kind == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        raise ConfigError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer") and not d.tokenizer_model:
        raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if kind == "NullTokenizer" and not m.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    path = d.tokenizer_model
    if path and not os.path.exists(path) and not (kind == "HuggingFaceTokenizer" and _looks_like_hub_id(path)):
        raise ConfigError(f"--tokenizer-model: {path} does not exist")


def _looks_like_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id, resolved from the local cache) rather than a path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def _check_checkpoint(c: CheckpointConfig) -> None:
    _positive_if_set([("--save-interval", c.save_interval), ("--save-retain", c.save_retain)])
    # --load DIR --save DIR with a DIR that does not exist yet is the usual start of a resumable run.
    if c.load is not None and not os.path.isdir(c.load) and c.load != c.save:
        raise ConfigError(f"--load: directory {c.load} does not exist")
    if c.save is not None:
        _ensure_writable_dir(c.save, "--save")


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
    """Create ``path`` if needed and check that files can be written there."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag}: cannot create directory {path} ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: directory {path} is not writable")


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


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


__all__ = ["validate_config", "data_parallel_size", "parse_data_path", "parse_split"]
