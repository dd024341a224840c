"""One Megatron-LM checkpoint read whole into meshtron's canonical tensors, optimizer state and progress."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron import buckets, legacy, legacy_optim, names, torch_dist
from meshtron.checkpoint.megatron.args import model_settings, rope_layout
from meshtron.checkpoint.megatron.detect import MegatronCheckpoint
from meshtron.checkpoint.megatron.unpickler import load_pickled
from meshtron.checkpoint.writer import quiet_single_process_notice
from meshtron.config import ModelConfig, head_dim, num_kv_heads
from meshtron.errors import ConfigError
from meshtron.pipeline.partition import partition_layers

#: Megatron's optimizer state names (fully reshardable: ``param``; fully sharded model space: ``fp32_param``)
#: -> meshtron's.
OPTIM_STATES = {"param": "master", "fp32_param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_OPTIM_KEY = re.compile(r"^optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)$")
_VOCAB_NAMES = (names.WORD_EMBEDDING, names.OUTPUT)
#: the dp_reshardable format's buckets (see :mod:`.buckets`) and its per-rank optimizer common state
#: (a MoE model's two optimizers, dense then experts, chained: their keys prefixed ``chained_0.``, ``chained_1.``)
_BUCKET_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                         r"dtype_(.+)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_OPTIMIZER_ENTRY = re.compile(r"^(?:chained_\d+\.)?optimizer\.")
_GROUPS_KEY = re.compile(r"^(?:chained_0\.)?optimizer\.distributed\.dp_group_idx_0\.optimizer/")


@dataclass
class MegatronState:
    """What a Megatron checkpoint holds, in meshtron's terms."""

    source: MegatronCheckpoint
    settings: dict[str, Any]  #: meshtron model fields from ``args``
    model: dict[str, torch.Tensor]  #: canonical name -> whole tensor
    optim: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  #: state -> canonical name -> tensor
    step: Optional[int] = None  #: the optimizer's step count
    iteration: int = 0
    consumed_samples: int = 0
    scheduler: dict = field(default_factory=dict)  #: Megatron's opt_param_scheduler state
    args: Any = None
    notices: list[str] = field(default_factory=list)


def _shape_info(settings: dict[str, Any], args: Any = None) -> dict[str, Any]:
    m = ModelConfig()
    for k, v in settings.items():
        if k != "vocab_size":
            setattr(m, k, v)
    mla = {k: getattr(m, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                       "v_head_dim")} if m.multi_latent_attention else None
    return {"heads": m.num_attention_heads, "groups": num_kv_heads(m), "head_dim": head_dim(m),
            "swiglu": bool(m.swiglu), "tied": not m.untie_embeddings_and_output_weights, "mla": mla,
            "rope_interleaved": rope_layout(args, settings) if args is not None else None}


def _canonical(tensors: dict[str, torch.Tensor], num_layers: int, shape: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        for layer_name, lt in names.per_layer(name, t, num_layers):
            for cname, ct in names.to_canonical(layer_name, lt, shape):
                out[cname] = ct.contiguous()
    return out


def _progress(common: dict, where: str) -> tuple[int, Any, dict]:
    args = common.get("args")
    iteration = common.get("iteration")
    if not isinstance(iteration, int):
        raise CheckpointError(f"{where} holds no iteration number")
    return iteration, args, common.get("opt_param_scheduler") or {}


def _optimizer_step(common: dict, iteration: int) -> int:
    """The Adam step count: from the parameter groups (Megatron keeps it there; a ChainedOptimizer of several
    saves the list of their states), else the iteration."""
    opt = common.get("optimizer")
    groups = []
    for one in opt if isinstance(opt, list) else [opt]:
        inner = one.get("optimizer", one) if isinstance(one, dict) else None  # FP32Optimizer: torch's own state_dict
        groups += (inner.get("param_groups") or []) if isinstance(inner, dict) else []
    return _groups_step(groups, iteration)


def _groups_step(groups: Any, iteration: int) -> int:
    steps = {int(g["step"]) for g in groups or [] if isinstance(g, dict) and isinstance(g.get("step"), (int, float))
             and float(g["step"]).is_integer()}
    return steps.pop() if len(steps) == 1 else iteration


def _bucket_size(args: Any) -> Optional[int]:
    """The distributed optimizer's bucket size as megatron-core's DistributedDataParallel chose it: none
    without ``--overlap-grad-reduce``, else ``--ddp-bucket-size`` or max(4e7, 1e6 x data-parallel size)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    return int(size) if size else max(40_000_000, 1_000_000 * int(getattr(args, "data_parallel_size", 1) or 1))


def _layout_args(args: Any) -> tuple[int, int, str]:
    return (int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            str(getattr(args, "transformer_impl", "transformer_engine")))


def _vp_size(args: Any) -> int:
    """The model chunks per pipeline rank (``virtual_pipeline_model_parallel_size``, which Megatron-LM derives from
    ``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``; unset: one)."""
    return int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def _uneven(args: Any, num_layers: int) -> buckets.Uneven:
    """Every model chunk's layers in the checkpoint, from its args (meshtron's partition of
    ``--decoder-first/last-pipeline-num-layers``, ``--pipeline-model-parallel-layout`` or
    ``--account-for-embedding/loss-in-pipeline-split``), computed once for all its ranks; a split meshtron cannot
    read is a :class:`buckets.LayoutMismatch`."""
    first, last = (getattr(args, f"decoder_{k}_pipeline_num_layers", None) for k in ("first", "last"))
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    embedding_slot = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
    loss_slot = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
    pp = _layout_args(args)[1]
    if pp > 1 and (layout is not None or embedding_slot or loss_slot):
        try:
            return partition_layers(num_layers, pp, virtual_size=_vp_size(args) if layout is None else None,
                                    embedding_slot=embedding_slot, loss_slot=loss_slot,
                                    layout=None if layout is None else str(layout),
                                    mtp_layers=int(getattr(args, "mtp_num_layers", None) or 0),
                                    standalone_mtp=True)
        except ConfigError as err:
            raise buckets.LayoutMismatch(str(err)) from None
    counts = (None if first is None else int(first), None if last is None else int(last))
    return buckets.stage_split(num_layers, pp, _vp_size(args), counts)


def _expert_args(args: Any) -> tuple[int, Optional[int], bool]:
    """Expert parallelism (``--expert-model-parallel-size``), expert tensor parallelism (``--expert-tensor-parallel-
    size``, None: the tensor-parallel size) and ``--moe-grouped-gemm``, for the experts' buffer."""
    etp = getattr(args, "expert_tensor_parallel_size", None)
    return (int(getattr(args, "expert_model_parallel_size", 1) or 1), int(etp) if etp else None,
            bool(getattr(args, "moe_grouped_gemm", False)))


def _read_legacy_optimizer(ckpt: MegatronCheckpoint, files: dict, states: dict, merged: dict[str, torch.Tensor],
                           settings: dict, args: Any, shape: dict, where: str) -> tuple[dict, list[str]]:
    """The legacy format's optimizer state as {state: {Megatron name: whole tensor}} (empty, with a notice, when
    its layout is not one meshtron can prove; empty, silently, when it has none)."""
    distributed = [f.parent / legacy_optim.DISTRIB_OPTIM_FILE for f in files.values()]
    has_distributed = any(f.is_file() for f in distributed)
    if not has_distributed and not any(isinstance(s.get("optimizer"), (dict, list)) for s in states.values()):
        return {}, []
    tp, pp, spec = _layout_args(args)
    what = "distrib_optim.pt (the distributed optimizer's buffers)" if has_distributed else \
        "the 'optimizer' entries of model_optim_rng.pt"
    why = None
    if has_distributed and not all(f.is_file() for f in distributed):
        why = f"{next(f for f in distributed if not f.is_file())} is missing"
    else:
        try:
            if has_distributed:
                return legacy_optim.distributed_state(files, merged, tp, pp, settings["num_layers"], spec,
                                                      shape["swiglu"], shape["tied"], _bucket_size(args),
                                                      *_expert_args(args), _vp_size(args),
                                                      _uneven(args, settings["num_layers"])), []
            return legacy_optim.local_state(states, merged, tp, pp, settings["num_layers"], spec, shape["swiglu"],
                                            shape["tied"], *_expert_args(args),
                                            _uneven(args, settings["num_layers"]), _vp_size(args)), []
        except buckets.LayoutMismatch as err:
            why = f"it does not hold the parameters where megatron-core puts them ({err})"
    return {}, [f"{where}: its optimizer state ({what}) is not read: {why}; the weights load and the Adam "
                "moments start from zero"]


def _read_buckets(ckpt: MegatronCheckpoint, md, shapes: dict, model_tensors: dict[str, torch.Tensor],
                  settings: dict, args: Any, shape: dict, where: str) -> tuple[dict, Optional[list], list[str]]:
    """The dp_reshardable optimizer state as {state: {Megatron name: whole tensor}} (empty, with a notice, when
    its layout is not one meshtron can prove), and the parameter groups of model-parallel rank 0."""
    keys = [k for k in shapes if _BUCKET_KEY.match(k)]
    if not keys:
        return {}, None, []
    # optimizer -> (rank, buffer: the model chunk) -> bucket -> state -> key
    found: dict[int, dict[tuple[int, int], dict[int, dict[str, str]]]] = {}
    buffers = set()
    for k in keys:
        m = _BUCKET_KEY.match(k)
        buffers.add(int(m.group(3)))
        chain, buffer = int(m.group(1) or 0), (int(m.group(2)), int(m.group(3)))
        found.setdefault(chain, {}).setdefault(buffer, {}).setdefault(int(m.group(5)), {})[m.group(6)] = k
    why = None
    tp, pp, spec = _layout_args(args)
    # a second, chained optimizer only for experts in a buffer of their own (expert parallelism)
    moe = bool(getattr(args, "num_experts", None)) and buckets.experts_apart(tp, *_expert_args(args)[:2])
    vp = _vp_size(args)
    if buffers != set(range(vp)):
        why = (f"parameter buffers {sorted(buffers)} per optimizer where {vp} model chunk(s) have one each "
               "(parameters of several dtypes)")
    elif sorted(found) != ([0, 1] if moe else [0]):
        why = (f"optimizers {sorted(found)} (chained_K. prefixes), expected "
               f"{'0 (dense parameters) and 1 (experts)' if moe else 'one'}")
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups = None
    if why is None:
        tensors, raw = torch_dist.read_entries(ckpt.directory, md, keys,
                                               [k for k in md.state_dict_metadata if _GROUPS_KEY.match(k)][:1])
        flat = {c: {r: {b: {s: tensors[k] for s, k in per.items()} for b, per in rb.items()} for r, rb in fc.items()}
                for c, fc in found.items()}
        per_layer = {}
        for name, t in model_tensors.items():
            per_layer.update(dict(names.per_layer(name, t, settings["num_layers"])))
        try:
            state = buckets.unflatten(per_layer, flat[0], tp, pp, settings["num_layers"], spec, shape["swiglu"],
                                      shape["tied"], _bucket_size(args), flat.get(1), *_expert_args(args), vp,
                                      _uneven(args, settings["num_layers"]))
        except buckets.LayoutMismatch as err:
            why = f"its buckets do not hold the parameters where megatron-core puts them ({err})"
        for k, b in raw.items():
            obj = load_pickled(b, f"{ckpt.directory} (entry {k})")
            obj = obj[0] if isinstance(obj, (list, tuple)) and len(obj) == 1 else obj
            groups = obj.get("param_groups") if isinstance(obj, dict) else None
    if why is not None:
        return {}, None, [f"{where}: its optimizer state (the distributed optimizer's dp_reshardable buckets) is "
                          f"not read: {why}; the weights load and the Adam moments start from zero (save with "
                          "--dist-ckpt-optim-fully-reshardable to carry them over)"]
    return state, groups, []


def read_megatron(ckpt: MegatronCheckpoint, vocab_size: Optional[int] = None, optimizer: bool = True,
                  dtype: Optional[torch.dtype] = None) -> MegatronState:
    """Every canonical tensor of ``ckpt`` (the embedding and output layer cut to ``vocab_size`` rows, default the
    checkpoint's padded vocabulary), its optimizer state (``optimizer``) and progress."""
    quiet_single_process_notice()
    where = f"Megatron-LM checkpoint {ckpt.directory}"
    notices: list[str] = []
    optim: dict[str, dict[str, torch.Tensor]] = {}
    if ckpt.format == "torch_dist":
        md = torch_dist.read_index(ckpt.directory)
        common = torch_dist.read_common(ckpt.directory, md)
        iteration, args, scheduler = _progress(common, where)
        settings = model_settings(args, where)
        shape = _shape_info(settings, args)
        shapes = torch_dist.tensor_shapes(md)
        model_keys = [k for k in shapes if not _OPTIMIZER_ENTRY.match(k) and not names.is_skipped(k)]
        optim_keys = [k for k in shapes if _OPTIM_KEY.match(k) and not k.endswith("expert_bias")] if optimizer else []
        tensors, _ = torch_dist.read_entries(ckpt.directory, md, model_keys + optim_keys, dtype=None)
        model = _canonical({k: tensors[k] for k in model_keys}, settings["num_layers"], shape)
        by_state: dict[str, dict[str, torch.Tensor]] = {}
        for k in optim_keys:
            m = _OPTIM_KEY.match(k)
            by_state.setdefault(OPTIM_STATES[m.group(1)], {})[m.group(2)] = tensors[k].float()
        for state, ts in by_state.items():
            optim[state] = _canonical(ts, settings["num_layers"], shape)
        groups = None
        if optimizer and not optim:
            flat, groups, more = _read_buckets(ckpt, md, shapes, {k: tensors[k] for k in model_keys}, settings, args,
                                               shape, where)
            notices += more
            for state, ts in flat.items():
                optim[OPTIM_STATES[state]] = _canonical(ts, settings["num_layers"], shape)
        step = (_groups_step(groups, iteration) if groups is not None else _optimizer_step(common, iteration)) \
            if optim else None
    else:
        first = legacy.read_rank(legacy.first_rank_file(ckpt.directory))
        iteration, args, scheduler = _progress(first, where)
        settings = model_settings(args, where)
        shape = _shape_info(settings, args)
        _refuse_legacy_expert_tp(args, where)
        # mp_rank_TT_EEE: a one-stage checkpoint's names leave the pipeline field out
        files = legacy.rank_files(ckpt.directory,
                                  expert_only=_layout_args(args)[1] == 1 and _expert_args(args)[0] > 1)
        merged, states, more = legacy.merge(ckpt.directory, shape["swiglu"], files)
        notices += more
        model = _canonical(merged, settings["num_layers"], shape)
        step = None
        if optimizer:
            flat, more = _read_legacy_optimizer(ckpt, files, states, merged, settings, args, shape, where)
            notices += more
            for state, ts in flat.items():
                optim[OPTIM_STATES[state]] = _canonical(ts, settings["num_layers"], shape)
            step = _optimizer_step(first, iteration) if optim else None
    if optimizer and optim:
        missing = sorted(set(model) - set(optim.get("master", {})) - {n for n in model if n.endswith("expert_bias")})
        if missing or {"exp_avg", "exp_avg_sq"} - set(optim):
            notices.append(f"{where}: its optimizer state does not cover every tensor ({', '.join(missing[:3]) or 'moments'}"
                           f"{' ...' if len(missing) > 3 else ''}): the weights load and the Adam moments start from zero")
            optim, step = {}, None
    padded = settings.get("vocab_size") or model[names.WORD_EMBEDDING].shape[0]
    vocab = vocab_size or padded
    for group in [model, *optim.values()]:
        for n in _VOCAB_NAMES:
            if n in group:
                group[n] = names.fit_vocab(group[n], vocab, n)
    if vocab < padded:
        notices.append(f"{where}: the vocabulary's {padded - vocab} padding rows (args.padded_vocab_size {padded}, "
                       f"this run's vocabulary {vocab}) are left out: meshtron gives its own padding no probability")
    if dtype is not None:
        model = {k: v.to(dtype) for k, v in model.items()}
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    settings = dict(settings, vocab_size=vocab)
    return MegatronState(ckpt, settings, model, optim, step, iteration, consumed, scheduler, args, notices)


def _refuse_legacy_expert_tp(args: Any, where: str) -> None:
    """Megatron-LM's legacy files are named by the writer's tensor- and expert-parallel ranks only: with expert
    tensor parallelism unlike tensor parallelism, the writers of a mixture-of-experts model's files are chosen by
    both its rank grids (ranks of data-parallel or expert-data-parallel rank 0), so that some names are missing
    and others hold an expert shard whose expert tensor-parallel rank nothing records. Refused by name."""
    tp = _layout_args(args)[0]
    _, etp, _ = _expert_args(args)
    if getattr(args, "num_experts", None) and etp is not None and etp != tp:
        raise CheckpointError(f"{where}: a mixture-of-experts model in Megatron-LM's legacy format (--ckpt-format "
                              f"torch) with --expert-tensor-parallel-size {etp} unlike --tensor-model-parallel-size "
                              f"{tp} cannot be read: its mp_rank_* directories do not say which expert "
                              "tensor-parallel rank wrote each expert shard. Save it in Megatron-LM with "
                              "--ckpt-format torch_dist (its tensors carry their global place) and load that")


def read_common_state(ckpt: MegatronCheckpoint) -> dict:
    """The checkpoint's common state (``args``, ``iteration``...), without its tensors."""
    if ckpt.format == "torch_dist":
        return torch_dist.read_common(ckpt.directory, torch_dist.read_index(ckpt.directory))
    return legacy.read_rank(legacy.first_rank_file(ckpt.directory))


def megatron_config(ckpt: MegatronCheckpoint):
    """A MeshtronConfig whose model section is the checkpoint's (``--use-checkpoint-args``), from its ``args``."""
    from meshtron.checkpoint.megatron.args import apply_settings
    from meshtron.config import MeshtronConfig

    common = read_common_state(ckpt)
    cfg = MeshtronConfig()
    apply_settings(cfg.model, model_settings(common.get("args"), ckpt.describe()))
    return cfg
