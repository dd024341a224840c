"""``meshtron convert --to megatron``: a meshtron checkpoint written as a Megatron-LM ``torch_dist`` checkpoint.

What megatron-core 0.19's ``load_checkpoint`` (``--ckpt-format torch_dist``) reads, in its own names and layouts
(:func:`.names.from_canonical`, :func:`.names.stack_for_torch_dist`):

* the model's tensors, the vocabulary padded to ``--make-vocab-size-divisible-by`` x tensor-parallel size with
  zero rows (as Megatron pads it; the tied output layer is the embedding and is not written); a multi-token
  prediction depth (``--mtp-num-layers 1``) under ``mtp.layers.0.*``, not stacked (megatron-core saves each depth
  under its own number); dense and mixture-of-experts layers mixed, each layer under its own number too
  (``decoder.layers.N.*``, megatron-core's layout of layers not all alike), ``args.moe_layer_freq`` Megatron-LM's
  integer or list (:func:`moe_layer_freq`);
* with the optimizer (AdamW's fp32 masters and moments), the distributed optimizer's ``fully_reshardable``
  format: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, and parameter groups carrying the step
  count (loaded by a run with ``--use-distributed-optimizer`` in any parallel layout);
* the common state: ``args`` (the model flags, the tokenizer's kind where Megatron-LM has it, the parallel
  sizes of the saving run, consumed samples),
  ``iteration``, ``checkpoint_version`` 3.0, ``opt_param_scheduler`` (meshtron's schedule is Megatron's; its
  position in samples), ``content_metadata``. RNG states are not written (``args.no_save_rng``: Megatron then
  keeps its own), nor is the rerun state machine.

Only types meshtron's own restricted unpickler admits go into the pickled parts (``argparse.Namespace``, plain
containers, numbers, strings, ``torch.dtype``), so the result reads back with ``convert --from megatron``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtron.checkpoint.errors import CheckpointError, describe_dcp_failure
from meshtron.checkpoint.megatron import files, names
from meshtron.checkpoint.megatron.args import MLA_FIELDS, YARN_CONFIG, YARN_FLAGS, YARN_POSITION_FLAGS, yarn_applies
from meshtron.checkpoint.pieces import MODEL_PREFIX, OPTIM_PREFIX
from meshtron.config import (MeshtronConfig, ModelConfig, ffn_size, flag_name, head_dim, num_kv_heads,
                             padded_vocab_size)
from meshtron.layer_kinds.gated_shared_moe import GATED_SHARED_MOE
from meshtron.layer_kinds.gqa import GQA
from meshtron.layer_kinds.moe import MOE
from meshtron.layer_kinds.pattern import is_moe_layer, layer_at, resolved_pattern
from meshtron.layers.rotary import rope_kind

#: meshtron's optimizer states -> Megatron's names in the fully reshardable format.
OPTIM_NAMES = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
CHECKPOINT_VERSION = 3.0


def unsupported(m: ModelConfig) -> list[str]:
    """What of ``m`` this export cannot write (empty: everything)."""
    out = []
    if m.multi_latent_attention and yarn_applies(m):
        for name, field, default in YARN_CONFIG:  # megatron-core's MLA values, which Megatron-LM cannot change
            if float(getattr(m, field)) != default:
                out.append(f"{flag_name(field)} {getattr(m, field)} with multi-latent attention's YaRN (Megatron-LM "
                           f"has no flag for it: megatron-core's {name} is {default:g})")
        if not m.yarn_truncate:
            out.append("--no-yarn-truncate with multi-latent attention's YaRN (megatron-core rounds the ramp's ends)")
    if yarn_position(m) and m.rotary_percent != 1:
        out.append(f"--rotary-percent {m.rotary_percent} with YaRN (megatron-core's --position-embedding-type "
                   "yarn rotates the whole head)")
    experts = {layer_at(m, i).mlp.name for i in range(m.num_layers) if is_moe_layer(m, i)}
    if len(experts) > 1 or experts - {MOE.name, GATED_SHARED_MOE.name}:
        out.append(f"--layer-pattern {resolved_pattern(m)} (Megatron-LM's mixture-of-experts layers are all of one "
                   f"kind: {MOE.name}, or {GATED_SHARED_MOE.name} with --moe-shared-expert-gate)")
    if m.mtp_num_layers and m.position_embedding_type == "learned_absolute":
        out.append("--mtp-num-layers with learned absolute position embeddings (megatron-core adds the shifted "
                   "position's embedding to a depth's token embedding; meshtron looks up the word embedding alone)")
    if m.use_rope_scaling:
        out.append("--use-rope-scaling (not read back by meshtron's Megatron reader yet)")
    return out


def interleaved_unsupported(m: ModelConfig) -> list[str]:
    """Why ``m`` cannot be written for ``--rotary-interleaved`` (empty: it can)."""
    if m.position_embedding_type != "rope":
        return [f"--megatron-rotary-interleaved with --position-embedding-type {m.position_embedding_type}"]
    if yarn_position(m):
        return ["--megatron-rotary-interleaved with YaRN (megatron-core's YarnRotaryEmbedding refuses it)"]
    if m.multi_latent_attention or any(layer_at(m, i).mixer.name != GQA.name for i in range(m.num_layers)):
        return [f"--megatron-rotary-interleaved with --layer-pattern {resolved_pattern(m)} (megatron-core's "
                "--rotary-interleaved is for grouped-query attention)"]
    return []


def shape_info(m: ModelConfig, interleaved: bool = False) -> dict[str, Any]:
    """The shapes :func:`.names.from_canonical` needs; ``interleaved``: the query/key rows each head rotates
    written in megatron-core's interleaved pairs (``--rotary-interleaved``)."""
    mla = {k: getattr(m, k) for k in MLA_FIELDS[1:6]} if m.multi_latent_attention else None
    return {"heads": m.num_attention_heads, "groups": num_kv_heads(m), "head_dim": head_dim(m),
            "swiglu": bool(m.swiglu), "tied": not m.untie_embeddings_and_output_weights, "mla": mla,
            "rope_interleaved": int(head_dim(m) * m.rotary_percent) if interleaved else None}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def moe_layer_freq(m: ModelConfig) -> int | list[int]:
    """Megatron-LM's ``--moe-layer-freq`` of ``m``'s layers, as its ``args`` keep it: 1 (every layer has experts,
    or none has), N when the experts are in every N-th layer counting from layer 0 (its integer form), else the
    list of one 1 per mixture-of-experts layer and one 0 per dense layer (as a DeepSeek model's first dense
    layers, ``--moe-first-dense-layers``, are written)."""
    pattern = [int(is_moe_layer(m, i)) for i in range(m.num_layers)]
    if not m.num_experts or all(pattern):
        return 1
    for n in range(2, m.num_layers + 1):
        if pattern == [int(i % n == 0) for i in range(m.num_layers)]:
            return n
    return pattern


def stacked_layers(m: ModelConfig) -> bool:
    """Whether megatron-core stacks ``m``'s decoder layers in torch_dist (``decoder.layers.X`` [layers, ...]): not
    for an ``--moe-layer-freq`` list or one above 1 (its "non-homogeneous" layers, saved under their numbers)."""
    freq = moe_layer_freq(m)
    return isinstance(freq, int) and freq == 1


def megatron_tensors(canonical: dict[str, torch.Tensor], m: ModelConfig, padded_vocab: int, spec: str,
                     interleaved: bool = False) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors of a set of canonical tensors (weights or one optimizer state)."""
    moe = {i for i in range(m.num_layers) if is_moe_layer(m, i)}
    per_layer = names.from_canonical(canonical, shape_info(m, interleaved), moe, spec,
                                     mtp_moe=(m.num_layers - 1) in moe)
    for n in (names.WORD_EMBEDDING, "output_layer.weight"):
        if n in per_layer:
            per_layer[n] = _pad_rows(per_layer[n], padded_vocab)
    return names.stack_for_torch_dist(per_layer, m.num_layers, stacked_layers(m))


def layer_linears(m: ModelConfig, moe: bool) -> tuple[str, ...]:
    """The linear modules of one layer (its experts apart) whose Transformer Engine state megatron-core saves:
    its attention's, then its MLP's (a dense MLP, or a mixture of experts' shared expert)."""
    if not m.multi_latent_attention:
        attention = names.GQA_LINEARS
    elif m.q_lora_rank:
        attention = names.MLA_LINEARS
    else:  # one query projection instead of the two
        attention = tuple(n for n in names.MLA_LINEARS if "linear_q_" not in n) + ("self_attention.linear_q_proj",)
    if not moe:
        return attention + names.DENSE_MLP_LINEARS
    return attention + (names.SHARED_EXPERT_LINEARS if m.moe_shared_expert_intermediate_size else ())


def _layer_extra_states(base: str, linears: tuple[str, ...], experts: int, axis: tuple[tuple[int, int], ...],
                        out: dict[str, None]) -> None:
    """One layer's entries under ``base``; ``axis``: its (offset, size) on the layer axis when stacked, else ()."""
    offsets, shape = tuple(o for o, _ in axis), tuple(n for _, n in axis)
    for lin in linears:
        out[files.object_key(f"{base}.{lin}._extra_state", offsets or (0,), shape or (1,))] = None
    for lin in names.EXPERT_LINEARS if experts else ():
        for e in range(experts):
            out[files.object_key(f"{base}.{lin}._extra_state", offsets + (e,), shape + (experts,))] = None


def extra_states(m: ModelConfig) -> dict[str, None]:
    """The (empty) Transformer Engine states megatron-core saves for each linear layer, by storage key: stacked
    layers' over the layer axis, a layer under its own number (mixed layers, a prediction depth) without one."""
    L = m.num_layers
    out: dict[str, None] = {}
    stacked = stacked_layers(m)
    for layer in range(L):
        moe = is_moe_layer(m, layer)
        base, axis = ("decoder.layers", ((layer, L),)) if stacked else (f"decoder.layers.{layer}", ())
        _layer_extra_states(base, layer_linears(m, moe), m.num_experts if moe else 0, axis, out)
    mtp_moe = bool(m.num_experts) and is_moe_layer(m, L - 1)  # a depth's layer is the decoder's last layer's kind
    for k in range(m.mtp_num_layers or 0):
        base = f"mtp.layers.{k}"
        out[files.object_key(f"{base}.eh_proj._extra_state", (0,), (1,))] = None
        _layer_extra_states(f"{base}.transformer_layer", layer_linears(m, mtp_moe),
                            m.num_experts if mtp_moe else 0, (), out)
    return out


def global_batch_size(cfg: MeshtronConfig, layout: dict) -> int:
    return int(cfg.train.global_batch_size or cfg.train.micro_batch_size * int(layout.get("dp", 1) or 1))


def scheduler_state(cfg: MeshtronConfig, iteration: int, skipped: int, gbs: int) -> dict[str, Any]:
    """Megatron's ``OptimizerParamScheduler.state_dict()`` at this point of meshtron's schedule (both count in
    samples: warm-up and decay lengths, and the position after ``iteration - skipped`` applied steps)."""
    from meshtron.optim.lr_schedule import schedule_lengths

    o = cfg.optim
    lengths = schedule_lengths(o, cfg.train.train_iters, gbs, getattr(cfg.train, "train_samples", None))
    warmup = int(lengths.warmup) if float(lengths.warmup).is_integer() else float(lengths.warmup)
    return {"max_lr": float(o.lr), "lr_warmup_steps": warmup, "num_steps": max(0, iteration - skipped) * gbs,
            "lr_decay_style": o.lr_decay_style, "lr_decay_steps": int(lengths.decay), "min_lr": float(o.min_lr),
            "start_wd": float(o.weight_decay), "end_wd": float(o.weight_decay), "wd_incr_style": "constant",
            "wd_incr_steps": int(cfg.train.train_iters) * gbs}


def _param_groups(cfg: MeshtronConfig, step: int, expert_parallel: bool) -> list[dict[str, Any]]:
    """Megatron-LM's two parameter groups (weight decay on matrices, none on norms and biases), with the keys
    its load matches groups by (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``is_expert_parallel``,
    ``is_decoupled_lr``) and those Adam reads (``betas``, ``eps``, ``weight_decay``, ``bias_correction``...)."""
    o = cfg.optim
    groups = []
    for wd_mult in (1.0, 0.0):
        groups.append({
            "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": expert_parallel,
            "default_config": True, "max_lr": float(o.lr), "min_lr": float(o.min_lr),
            "lr": float(o.lr), "weight_decay": float(o.weight_decay) * wd_mult,
            "betas": (float(o.adam_beta1), float(o.adam_beta2)), "eps": float(o.adam_eps), "bias_correction": True,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True, "step": int(step)})
    return groups


def optimizer_common(cfg: MeshtronConfig, step: int, expert_parallel_size: int) -> dict:
    """The distributed optimizer's common state as Megatron-LM builds the optimizer: one, or, for experts under
    ``--expert-model-parallel-size`` above 1, two chained (dense, then expert-parallel)."""
    def one(expert_parallel: bool) -> dict:
        return {"optimizer": {"param_groups": _param_groups(cfg, step, expert_parallel)},
                "param_state_sharding_type": "fully_reshardable"}

    if cfg.model.num_experts and expert_parallel_size > 1:
        return {0: one(False), 1: one(True)}
    return one(False)


def content_metadata(with_optimizer: bool) -> dict[str, Any]:
    """What megatron-core's ``save`` records of how the sharded state was built (its load builds the same)."""
    out: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if with_optimizer:
        out.update(distrib_optim_sharding_type="fully_reshardable", distrib_optim_fully_reshardable_mem_efficient=False)
    return out


def mla_args(m: ModelConfig) -> dict[str, Any]:
    """Megatron-LM's multi-latent attention flags: its latent norms are --qk-layernorm, its RoPE --rope-type
    (with YaRN's --rotary-scaling-factor, --mscale, --mscale-all-dim)."""
    if not m.multi_latent_attention:
        return {"multi_latent_attention": False}
    rope = rope_kind(m)
    out = dict({k: getattr(m, k) for k in MLA_FIELDS}, rope_type=rope, qk_layernorm=True,
               group_query_attention=False, num_query_groups=m.num_attention_heads, rotary_percent=1.0)
    # YaRN's flags; with --rope-type rope Megatron-LM's defaults, under which its softmax scale is plain too
    out.update({k: float(getattr(m, k)) for k in YARN_FLAGS} if rope == "yarn" else
               {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0})
    return out


def yarn_position(m: ModelConfig) -> bool:
    """Whether ``m`` is written with Megatron-LM's ``--position-embedding-type yarn``: RoPE with YaRN
    frequencies without multi-latent attention (whose YaRN is --rope-type yarn)."""
    return m.position_embedding_type == "rope" and not m.multi_latent_attention and rope_kind(m) == "yarn"


def position_args(m: ModelConfig) -> dict[str, Any]:
    """Megatron-LM's position-embedding flags: learned_absolute, rope, or yarn with its own flags (the older
    --use-rotary-position-embeddings only with rope: Megatron-LM turns it into --position-embedding-type rope).
    ``add_position_embedding`` stays True, the value Megatron-LM's parser gives every position-embedding type (its
    --no-position-embedding is deprecated): its load compares it with the running job's and stops on a difference."""
    if not yarn_position(m):
        rope = m.position_embedding_type == "rope"
        return dict(position_embedding_type=m.position_embedding_type, add_position_embedding=True,
                    use_rotary_position_embeddings=rope)
    out: dict[str, Any] = {name: type(default)(getattr(m, name)) for name, default in YARN_POSITION_FLAGS.items()
                           if name != "yarn_correction_range_round_to_int"}
    return dict(out, position_embedding_type="yarn", add_position_embedding=True,
                use_rotary_position_embeddings=False, yarn_correction_range_round_to_int=bool(m.yarn_truncate))


def gated_shared_expert(m: ModelConfig) -> bool:
    """Whether the mixture-of-experts layers gate their shared expert (``moe_gated_shared``:
    Megatron-LM's --moe-shared-expert-gate)."""
    return any(layer_at(m, i).mlp.name == GATED_SHARED_MOE.name for i in range(m.num_layers))


#: meshtron's ``--tokenizer-type`` kinds that Megatron-LM has under the same name (its ``args.tokenizer_type``).
#: ``ByteTokenizer`` (UTF-8 bytes) has no Megatron-LM counterpart.
MEGATRON_TOKENIZERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer",
                       "NullTokenizer")


def tokenizer_kind(cfg: MeshtronConfig, ckpt_dir: Optional[Path] = None) -> Optional[str]:
    """The checkpoint's tokenizer kind: its ``--tokenizer-type`` (GPT-2 BPE for ``--vocab-file`` with
    ``--merge-file``), else the kind of the tokenizer saved in the checkpoint; None without either."""
    import json

    from meshtron.checkpoint.metadata import TOKENIZER_DIR
    from meshtron.data.tokenizers import META_FILE

    d = cfg.data
    if d.tokenizer_type:
        return d.tokenizer_type
    if d.vocab_file and d.merge_file:
        return "GPT2BPETokenizer"
    saved = ckpt_dir / TOKENIZER_DIR / META_FILE if ckpt_dir is not None else None
    if saved is not None and saved.is_file():
        try:
            kind = json.loads(saved.read_text()).get("tokenizer_type")
        except (OSError, ValueError, AttributeError):
            return None
        return kind if isinstance(kind, str) else None
    return None


def tokenizer_args(cfg: MeshtronConfig, kind: Optional[str], notices: Optional[list[str]] = None) -> dict[str, Any]:
    """Megatron-LM's tokenizer flags for ``kind`` (its ``--use-checkpoint-args`` takes ``tokenizer_type`` with
    ``tokenizer_model``): the same name, the files as the meshtron run named them. Left out, with a notice,
    for a kind Megatron-LM has not; left out silently without a tokenizer (``--mock-data``)."""
    if kind is None:
        return {}
    if kind not in MEGATRON_TOKENIZERS:
        if notices is not None:
            notices.append(f"args.tokenizer_type is left out: meshtron's {kind} has no Megatron-LM counterpart "
                           "(give Megatron-LM its own --tokenizer-type)")
        return {}
    d = cfg.data
    return {"tokenizer_type": kind, "tokenizer_model": d.tokenizer_model, "vocab_file": d.vocab_file,
            "merge_file": d.merge_file}


def megatron_args(cfg: MeshtronConfig, layout: dict, vocab: int, padded: int, iteration: int, consumed: int,
                  with_optimizer: bool, spec: str, tokenizer: Optional[dict[str, Any]] = None,
                  interleaved: bool = False) -> argparse.Namespace:
    """Megatron-LM's ``args`` for this model: the flags its ``--use-checkpoint-args`` and checks read
    (``tokenizer``: :func:`tokenizer_args`)."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    moe = bool(m.num_experts)
    values = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=ffn_size(m),
        num_attention_heads=m.num_attention_heads, group_query_attention=num_kv_heads(m) != m.num_attention_heads,
        num_query_groups=num_kv_heads(m), kv_channels=head_dim(m), seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer()
        else float(m.rotary_base), rotary_percent=float(m.rotary_percent), rotary_interleaved=interleaved,
        add_bias_linear=not m.disable_bias_linear, add_qkv_bias=bool(m.add_qkv_bias), squared_relu=False,
        swiglu=bool(m.swiglu), untie_embeddings_and_output_weights=bool(m.untie_embeddings_and_output_weights),
        apply_layernorm_1p=False, normalization=m.normalization, norm_epsilon=float(m.norm_epsilon),
        qk_layernorm=bool(m.qk_layernorm), attention_dropout=float(m.attention_dropout),
        hidden_dropout=float(m.hidden_dropout), init_method_std=float(m.init_method_std),
        mtp_num_layers=m.mtp_num_layers or None, mtp_loss_scaling_factor=float(m.mtp_loss_scaling_factor),
        num_experts=m.num_experts if moe else None, moe_layer_freq=moe_layer_freq(m),
        moe_ffn_hidden_size=(m.moe_ffn_hidden_size or ffn_size(m)) if moe else None,
        moe_router_topk=m.moe_router_topk, moe_router_pre_softmax=bool(m.moe_router_pre_softmax),
        moe_grouped_gemm=False, moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=gated_shared_expert(m), moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=bool(m.moe_router_enable_expert_bias),
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_num_groups=m.moe_router_num_groups, moe_router_group_topk=m.moe_router_group_topk,
        moe_aux_loss_coeff=float(m.moe_aux_loss_coeff), moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_router_bias_update_rate=float(m.moe_router_bias_update_rate), moe_token_dispatcher_type="alltoall",
        vocab_size=vocab, padded_vocab_size=padded, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        tensor_model_parallel_size=int(layout.get("tp", 1)), pipeline_model_parallel_size=int(layout.get("pp", 1)),
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=int(layout.get("ep", 1)),
        context_parallel_size=int(layout.get("cp", 1)), data_parallel_size=int(layout.get("dp", 1)),
        world_size=int(layout.get("world_size", 1)),
        transformer_impl=spec, ckpt_format="torch_dist", use_dist_ckpt=True,
        iteration=iteration, consumed_train_samples=consumed, consumed_valid_samples=0,
        train_iters=t.train_iters, global_batch_size=global_batch_size(cfg, layout),
        micro_batch_size=t.micro_batch_size,
        lr=float(o.lr), min_lr=float(o.min_lr), lr_decay_style=o.lr_decay_style, lr_warmup_iters=o.lr_warmup_iters,
        lr_warmup_init=float(o.lr_warmup_init), weight_decay=float(o.weight_decay), adam_beta1=float(o.adam_beta1),
        adam_beta2=float(o.adam_beta2), adam_eps=float(o.adam_eps), clip_grad=float(o.clip_grad), optimizer="adam",
        use_distributed_optimizer=with_optimizer, dist_ckpt_optim_fully_reshardable=with_optimizer,
        no_save_optim=not with_optimizer, no_save_rng=True, params_dtype=torch.float32)
    values.update(position_args(m))
    values.update(mla_args(m))
    values.update(tokenizer or {})
    return argparse.Namespace(**values)


def read_canonical(ckpt_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a meshtron checkpoint whose key starts with ``prefix``, whole ({key minus prefix: tensor})."""
    from meshtron.checkpoint.dcp_reader import read_dcp_metadata, safe_dcp_load
    from meshtron.checkpoint.writer import quiet_single_process_notice

    quiet_single_process_notice()
    md = read_dcp_metadata(ckpt_dir)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if not state:
        return {}
    try:
        safe_dcp_load(state, ckpt_dir, md, no_dist=True)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"reading tensors from {ckpt_dir} failed", describe_dcp_failure(err)) from None
    return {k[len(prefix):]: v for k, v in state.items()}


def _optimizer_by_state(ckpt_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in read_canonical(ckpt_dir, OPTIM_PREFIX).items():
        state, name = key.split(".", 1)
        out.setdefault(state, {})[name] = t
    return out


def _optimizer_tensors(ckpt_dir: Path, meta: dict, m: ModelConfig, padded: int, spec: str,
                       notices: list[str], interleaved: bool = False) -> dict[str, torch.Tensor]:
    """The fully reshardable optimizer tensors (``optimizer.state.<state>.<model key>``) of AdamW's state; none,
    with a notice, for a checkpoint without it or with another optimizer's."""
    optim = _optimizer_by_state(ckpt_dir) if (meta.get("optimizer") or {}).get("present") else {}
    if optim and set(optim) != set(OPTIM_NAMES):
        notices.append(f"{ckpt_dir}: its optimizer keeps {', '.join(sorted(optim))}, not AdamW's master/exp_avg/"
                       "exp_avg_sq: written without optimizer state")
        return {}
    if not optim:
        notices.append(f"{ckpt_dir} holds no optimizer state: written without (Megatron starts fresh moments)")
    out = {}
    for state, canonical in optim.items():
        for key, t in megatron_tensors(canonical, m, padded, spec, interleaved).items():
            if not key.endswith("expert_bias"):  # a buffer, not a parameter
                out[f"optimizer.state.{OPTIM_NAMES[state]}.{key}"] = t.float()
    return out


def _common_state(cfg: MeshtronConfig, meta: dict, layout: dict, vocab: int, padded: int, spec: str,
                  with_optimizer: bool, tokenizer: Optional[dict[str, Any]] = None,
                  interleaved: bool = False) -> dict[str, Any]:
    """What Megatron-LM's save keeps beside the tensors (``common_state``)."""
    progress = meta.get("training_state") or {}
    iteration = int(meta.get("iteration", 0))
    consumed = int(progress.get("consumed_samples", 0))
    common: dict[str, Any] = {
        "args": megatron_args(cfg, layout, vocab, padded, iteration, consumed, with_optimizer, spec, tokenizer,
                              interleaved),
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
        "opt_param_scheduler": scheduler_state(cfg, iteration, int(progress.get("skipped_iterations", 0)),
                                               global_batch_size(cfg, layout)),
        "num_floating_point_operations_so_far": 0, "content_metadata": content_metadata(with_optimizer)}
    if with_optimizer:
        step = int((meta.get("optimizer") or {}).get("step_count", 0)) or iteration
        common["optimizer"] = optimizer_common(cfg, step, int(layout.get("ep", 1) or 1))
    return common


def meshtron_to_megatron(input_path: str | Path, output_dir: str | Path, spec: str = "transformer_engine",
                         add_to_existing: bool = False, optimizer: bool = True, dtype: Optional[torch.dtype] = None,
                         notices: Optional[list[str]] = None, verify: bool = True,
                         layout: Optional[dict[str, int]] = None, rotary_interleaved: bool = False) -> Path:
    """Write the meshtron checkpoint ``input_path`` designates as ``output_dir/iter_NNNNNNN`` of a Megatron-LM
    save directory (then ``latest_checkpointed_iteration.txt``); returns the iteration directory. ``layout``
    (``tp``, ``pp``, ``ep``...) overrides the saving run's parallel sizes recorded in ``args``, which set the
    vocabulary's padding and, with experts, the optimizer's shape (see :func:`optimizer_common`).
    ``rotary_interleaved``: for a Megatron-LM run with ``--rotary-interleaved``, each query/key head's rotated
    rows written in its interleaved pairs (the same attention; grouped-query attention only)."""
    from meshtron.checkpoint.conversion_checks import check_complete
    from meshtron.checkpoint.load import resolve_checkpoint
    from meshtron.checkpoint.metadata import read_config, read_meta
    from meshtron.checkpoint.verify import verify_checkpoint

    notices = notices if notices is not None else []
    if spec not in names.SPECS:
        raise CheckpointError(f"--megatron-spec {spec}: valid are {', '.join(names.SPECS)}")
    out = Path(output_dir)
    ckpt_dir = resolve_checkpoint(input_path)
    if ckpt_dir is None:
        raise CheckpointError(f"--input {input_path}: no meshtron checkpoint found")
    verify_checkpoint(ckpt_dir, None, verify)
    meta, cfg = read_meta(ckpt_dir), read_config(ckpt_dir)
    m = cfg.model
    problems = unsupported(m)
    if rotary_interleaved:
        problems += interleaved_unsupported(m)
    if problems:
        raise CheckpointError(f"{ckpt_dir}: this model cannot be written as a Megatron-LM checkpoint: "
                              f"{'; '.join(problems)}")
    if m.mtp_num_layers and not m.mtp_normed_hidden_states:
        notices.append(f"{ckpt_dir} was trained without --mtp-normed-hidden-states: megatron-core's prediction "
                       "depths read the hidden states after the final norms, this model's before them, so their "
                       "loss differs until trained on (the main model computes the same)")
    iteration = int(meta.get("iteration", 0))
    files.check_destination(out, iteration, add_to_existing)
    layout = dict(meta.get("layout") or {}, **(layout or {}))
    weights = read_canonical(ckpt_dir, MODEL_PREFIX)
    check_complete(cfg, {k: tuple(v.shape) for k, v in weights.items()}, f"{ckpt_dir}: the tensors do not match "
                    "the checkpoint's configuration")
    vocab = int(weights[names.WORD_EMBEDDING].shape[0])
    padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, int(layout.get("tp", 1) or 1))
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    tensors = megatron_tensors(weights, m, padded, spec, rotary_interleaved)
    optim = _optimizer_tensors(ckpt_dir, meta, m, padded, spec, notices, rotary_interleaved) if optimizer else {}
    tensors.update(optim)
    common = _common_state(cfg, meta, layout, vocab, padded, spec, bool(optim),
                           tokenizer_args(cfg, tokenizer_kind(cfg, ckpt_dir), notices), rotary_interleaved)
    if padded > vocab:
        notices.append(f"the vocabulary of {vocab} is padded to {padded} rows (--make-vocab-size-divisible-by "
                       f"{m.make_vocab_size_divisible_by} x tensor-parallel size {layout.get('tp', 1)}) with zeros")
    return files.publish(out, iteration, tensors, extra_states(m), common)
