"""``load_checkpoint``: restore a checkpoint into any parallel layout; ``load_for_inference`` for one device."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshtron.checkpoint import coordination, layout
from meshtron.checkpoint.async_save import process_writer
from meshtron.checkpoint.dcp_reader import corrupt_item_in, read_dcp_metadata, safe_dcp_load
from meshtron.checkpoint.errors import CheckpointError, describe_dcp_failure
from meshtron.checkpoint.megatron.detect import find_megatron_checkpoint
from meshtron.checkpoint.metadata import (
    META_FILE, TOKENIZER_DIR, compare_signatures, compare_tensors, model_signature, read_config, read_meta, read_rng,
    training_state_from_dict,
)
from meshtron.checkpoint.owned import (
    first_weight_gather_done, masters_follow_loaded_state, masters_from_weight_shards, owns_state_segments,
    release_stale_weights, sharded_weights, state_shards_by_segment, weight_shards,
)
from meshtron.checkpoint.pieces import (
    MODEL_PREFIX, OPTIM_PREFIX, canonical_name, state_names_of, state_shards, state_tensors_are_views, to_state_dict,
)
from meshtron.checkpoint.pieces import model_shards
from meshtron.checkpoint.save import model_vocab_size
from meshtron.checkpoint.verify import SKIP_HINT, verify_for_load
from meshtron.checkpoint.writer import quiet_single_process_notice
from meshtron.config import MeshtronConfig
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import SPEC_ATTR, Piece, initialize_parameters, spec_buffers, spec_of
from meshtron.training.state import TrainingState

logger = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path) -> Optional[Path]:
    """The checkpoint directory that ``path`` designates, or None if it holds none yet.

    ``path`` is a save directory (the pointer file names the iteration) or one
    ``iter_N`` directory. A save directory without a pointer but with complete
    checkpoints (a save killed just before the pointer moved) gives the newest one.
    """
    p = Path(path)
    if (p / META_FILE).is_file():
        return p
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a checkpoint directory (give the --save directory or one "
                              "iter_N directory)")
    if not p.is_dir():
        return None
    iteration = layout.read_latest(p)
    if iteration is None:
        complete = layout.list_iterations(p)
        if not complete:
            return None
        iteration = complete[-1]
    for d in (layout.iteration_dir(p, iteration), layout.old_dir(p, iteration)):
        if (d / META_FILE).is_file():  # iter_N.old: a re-save of N was killed in the middle of its swap
            return d
    raise CheckpointError(f"{p / layout.LATEST_FILE} names iteration {iteration}, but "
                          f"{layout.iteration_dir(p, iteration)} is missing or incomplete")


def _saved_shapes(md: Metadata) -> dict[str, tuple]:
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _required_model_shapes(models: Sequence[nn.Module], buffers: bool = True) -> dict[str, tuple]:
    """{canonical name: full shape} of every tensor this rank's model chunks need (parameters, and
    the buffers that are model state unless ``buffers`` is False: those have no optimizer state)."""
    out: dict[str, tuple] = {}
    for model in models:
        state_buffers = [b for _, b in spec_buffers(model)] if buffers else []
        for param in [p for _, p in model.named_parameters()] + state_buffers:
            if getattr(param, SPEC_ATTR, None) is None:
                continue  # reported by model_shards()
            for piece in spec_of(param).pieces:
                out[piece.name] = tuple(piece.full_shape)
    return out


def check_compatibility(ckpt_dir: Path, meta: dict, saved: dict[str, tuple], models: Sequence[nn.Module],
                        cfg: MeshtronConfig, group, need_optimizer: bool) -> None:
    """Raise CheckpointError listing every difference between the checkpoint and this run's model."""
    field_diffs = compare_signatures(meta.get("model", {}), model_signature(cfg.model, model_vocab_size(models, cfg)))
    required: dict[str, tuple] = {}
    for part in coordination.all_gather_object(_required_model_shapes(models), group):
        required.update(part)  # the whole model: each pipeline stage knows only its own tensors
    saved_model = {canonical_name(k): s for k, s in saved.items() if k.startswith(MODEL_PREFIX)}
    tensor_diffs = compare_tensors(saved_model, required)
    if need_optimizer:
        from meshtron.optim.registry import kind_of

        kind = kind_of(cfg)
        with_state: dict[str, tuple] = {}
        for part in coordination.all_gather_object(_required_model_shapes(models, buffers=False), group):
            with_state.update(part)
        needed: dict[str, dict[str, tuple]] = {}  # state -> {canonical name: shape}, by the run's optimizer
        for name, shape in with_state.items():
            if name in saved_model:  # model-level gaps are listed once
                for state in kind.state_names((Piece(name, shape, 0, 0, shape[0] if shape else 1),)):
                    needed.setdefault(state, {})[name] = shape
        for state, present in needed.items():
            saved_state = {canonical_name(k): s for k, s in saved.items() if k.startswith(f"{OPTIM_PREFIX}{state}.")}
            tensor_diffs += [d for d in compare_tensors(saved_state, present, f"optimizer {state}")
                             if "missing" in d]
    diffs = field_diffs + tensor_diffs
    if diffs:
        raise CheckpointError(f"the checkpoint {ckpt_dir} does not match this model", diffs)


def _dcp_load(state_dict: dict, ckpt_dir: Path, group, no_dist: bool, md: Optional[Metadata] = None,
              checksums: Optional[dict] = None) -> None:
    if not state_dict and no_dist:
        return  # with a group, even an empty load takes part in DCP's collectives
    try:
        safe_dcp_load(state_dict, ckpt_dir, md, process_group=group, no_dist=no_dist, checksums=checksums)
    except (Exception, CheckpointException) as err:  # DCP reports every rank's failure on every rank
        corrupt = corrupt_item_in(err)
        if corrupt is not None:  # one line naming the file and the tensor, on every rank
            raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {corrupt}; {SKIP_HINT}") from None
        raise CheckpointError(f"reading tensors from {ckpt_dir} failed", describe_dcp_failure(err)) from None


def load_model_tensors(models: Sequence[nn.Module], ckpt_dir: Path, group=None, no_dist: Optional[bool] = None,
                       md: Optional[Metadata] = None, optimizer=None, checksums: Optional[dict] = None) -> None:
    """Copy the checkpoint's model tensors into this rank's parameters (in place, any layout).

    ``md``: the checkpoint's DCP index when already read (see :func:`read_dcp_metadata`). With a ZeRO-3
    ``optimizer`` the weights are read straight into this rank's weight shards (nothing is gathered).
    ``checksums``: the stored items' CRC-32s (:func:`verify_for_load`), checked as they are read."""
    no_dist = group is None if no_dist is None else no_dist
    zero3 = sharded_weights(optimizer) is not None
    with torch.no_grad():
        chunks = model_shards(models, parameters=not zero3)
        if zero3:
            chunks = weight_shards(optimizer) + chunks
        _dcp_load(to_state_dict(chunks), ckpt_dir, group, no_dist, md, checksums)


#: Bytes of gathered optimizer state (fp32 master and moments) read per DCP load call when the
#: optimizer's state_tensors are temporary copies (the distributed optimizer): bounds device memory.
LOAD_BATCH_BYTES = 2 * 2**30


def _param_batches(optimizer) -> list[list[int]]:
    """Parameter indices grouped so that each group's gathered state stays under LOAD_BATCH_BYTES."""
    n = len(optimizer.params)
    if state_tensors_are_views(optimizer):
        return [list(range(n))] if n else []
    batches: list[list[int]] = []
    size = 0
    for i, p in enumerate(optimizer.params):
        nbytes = p.numel() * 4 * len(state_names_of(optimizer, i))
        if not batches or (batches[-1] and size + nbytes > LOAD_BATCH_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += nbytes
    return batches


def _load_optimizer(optimizer, ckpt_dir: Path, group, step_count: int, md: Optional[Metadata] = None,
                    checksums: Optional[dict] = None) -> None:
    """Fill the optimizer's masters and moments from the checkpoint. The distributed optimizer's segments
    are read in place, with no gather (see :mod:`meshtron.checkpoint.owned`)."""
    optimizer.ensure_state()
    if owns_state_segments(optimizer):
        with torch.no_grad():
            chunks = [c for segment in state_shards_by_segment(optimizer, for_load=True) for c in segment]
            _dcp_load(to_state_dict(chunks), ckpt_dir, group, group is None, md, checksums)
            masters_follow_loaded_state(optimizer)
        optimizer.set_step_count(step_count)
        return
    batches = _param_batches(optimizer)
    # Every rank makes the same number of DCP loads (collectives), whatever its pipeline stage holds.
    rounds = max(coordination.all_gather_object(len(batches), group))
    batches += [[] for _ in range(rounds - len(batches))]
    with torch.no_grad():
        for batch in batches:
            tensors = {i: optimizer.state_tensors(i) for i in batch}
            chunks = [c for i in batch for c in state_shards(optimizer.params[i], i, tensors[i], state_names_of(optimizer, i))]
            _dcp_load(to_state_dict(chunks), ckpt_dir, group, group is None, md, checksums)
            for i in batch:
                optimizer.load_state_tensors(i, {k: tensors[i][k] for k in state_names_of(optimizer, i)})
    optimizer.set_step_count(step_count)


def _masters_from_weights(optimizer) -> None:
    """Without optimizer state to load, the fp32 masters must follow the loaded weights."""
    with torch.no_grad():
        for i, param in enumerate(optimizer.params):
            optimizer.load_state_tensors(i, {"master": param.detach().float()})


def verification_enabled(cfg: Optional[MeshtronConfig]) -> bool:
    """Whether loads check checksums: yes unless ``--no-verify-checkpoint``."""
    return not getattr(getattr(cfg, "checkpoint", None), "no_verify_checkpoint", False)


def load_checkpoint(load_dir: str, model_chunks: list[nn.Module], optimizer, ctx: ParallelContext,
                    cfg: MeshtronConfig, *, load_optim: bool = True, load_rng: bool = True,
                    verify: Optional[bool] = None) -> Optional[TrainingState]:
    """Load the latest checkpoint of ``load_dir`` into this run's layout (collective: every rank calls it).

    Returns the saved TrainingState (``rng`` = this rank's saved RNG states, None when
    not restored: ``load_rng`` False or another world size), or None when ``load_dir``
    holds no checkpoint yet. Model tensors always load; the optimizer's masters and
    moments load when ``optimizer`` is given, ``load_optim`` is true and the checkpoint
    has them, otherwise the masters are set from the loaded weights. Raises
    CheckpointError listing every difference when the checkpoint's model differs, and
    CheckpointError naming the file when a file does not match its recorded checksum
    (``verify`` None: unless ``cfg.checkpoint.no_verify_checkpoint``).
    """
    process_writer().wait()  # never read while this process is still writing
    quiet_single_process_notice()
    megatron_ckpt = find_megatron_checkpoint(load_dir)  # a Megatron-LM checkpoint: read as one
    if megatron_ckpt is not None:
        from meshtron.checkpoint.megatron.into_model import load_megatron_into

        return load_megatron_into(megatron_ckpt, model_chunks, optimizer, ctx, cfg, load_optim=load_optim)
    group = coordination.checkpoint_group(ctx)
    no_dist = group is None
    lead = coordination.rank() == 0
    ckpt_dir = resolve_checkpoint(load_dir)
    if ckpt_dir is None:
        return None
    checksums = verify_for_load(ckpt_dir, group, verification_enabled(cfg) if verify is None else verify)
    meta = read_meta(ckpt_dir)
    md = read_dcp_metadata(ckpt_dir)
    saved = _saved_shapes(md)
    has_optim = bool(meta.get("optimizer", {}).get("present"))
    want_optim = optimizer is not None and load_optim and has_optim
    check_compatibility(ckpt_dir, meta, saved, model_chunks, cfg, group, want_optim)
    zero3 = sharded_weights(optimizer) is not None
    if zero3:
        first_weight_gather_done(optimizer)  # ZeRO-3: the shards are loaded in place, nothing is gathered
    elif optimizer is not None:
        optimizer.finish_param_gather()  # a gather landing later would overwrite the loaded weights

    load_model_tensors(model_chunks, ckpt_dir, group, no_dist, md, optimizer, checksums)
    if zero3:
        release_stale_weights(optimizer)  # the full weights are stale: the next use gathers the loaded shards
    elif optimizer is not None:
        optimizer.weights_written()  # ZeRO-2: the shards take the loaded values
    if want_optim:
        _load_optimizer(optimizer, ckpt_dir, group, int(meta["optimizer"]["step_count"]), md, checksums)
    elif optimizer is not None:
        if load_optim and lead:
            logger.warning("checkpoint %s has no optimizer state: Adam moments start from zero", ckpt_dir)
        optimizer.ensure_state()
        if zero3:
            masters_from_weight_shards(optimizer)
        else:
            _masters_from_weights(optimizer)

    state = training_state_from_dict(meta["training_state"])
    state.rng = _load_rng(ckpt_dir, meta, group, lead) if load_rng else None
    return state


def _load_rng(ckpt_dir: Path, meta: dict, group, lead: bool) -> Optional[dict]:
    if not meta.get("rng", {}).get("present", False):
        return None  # e.g. a checkpoint converted from another format
    saved_world = int(meta["rng"]["world_size"])
    world = coordination.world_size()
    if saved_world != world:
        if lead:
            logger.warning("checkpoint %s was written by %d processes, this run has %d: random-number-generator "
                           "states are not restored", ckpt_dir, saved_world, world)
        return None
    rank = coordination.rank()
    result, error = None, None
    try:
        result = read_rng(ckpt_dir, rank)
    except CheckpointError as err:
        error = str(err)
    coordination.agree_or_raise(error, group, f"loading RNG states from {ckpt_dir} failed")
    return result


def latest_checkpoint_config(load_dir: str | Path) -> Optional[MeshtronConfig]:
    """The run configuration saved with the checkpoint ``load_dir`` designates (None if there is none); for a
    Megatron-LM checkpoint, its model flags from the checkpoint's ``args``."""
    megatron_ckpt = find_megatron_checkpoint(load_dir)
    if megatron_ckpt is not None:
        from meshtron.checkpoint.megatron.reader import megatron_config

        return megatron_config(megatron_ckpt)
    ckpt_dir = resolve_checkpoint(load_dir)
    return read_config(ckpt_dir) if ckpt_dir is not None else None


def build_empty_model(cfg: MeshtronConfig, vocab_size: int, device: torch.device, dtype: torch.dtype,
                      ctx: Optional[ParallelContext] = None) -> nn.Module:
    """A whole (one-stage, one-device) GPTModel, ready to receive a checkpoint."""
    from meshtron.build import build_stage

    ctx = ctx or ParallelContext(device=device)
    model = build_stage(cfg, ctx, vocab_size)
    initialize_parameters(model, 0, device, dtype)  # every value is then overwritten by the checkpoint
    return model


def load_for_inference(load_dir: str | Path, device: torch.device | str = "cpu",
                       dtype: Optional[torch.dtype] = None, verify: bool = True):
    """(model, tokenizer or None) from a checkpoint of any layout, on one device, in eval mode.

    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. The weights are the model
    tensors of the checkpoint (converted to ``dtype``). ``verify``: check every file
    against its checksum first (CheckpointError naming the file that differs).
    """
    quiet_single_process_notice()
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ckpt_dir = resolve_checkpoint(load_dir)
    if ckpt_dir is None:
        raise CheckpointError(f"no checkpoint found in {load_dir} (expected a 'latest' file or an iter_N directory)")
    checksums = verify_for_load(ckpt_dir, None, verify)
    meta = read_meta(ckpt_dir)
    cfg = read_config(ckpt_dir)
    vocab = meta.get("model", {}).get("vocab_size") or cfg.model.vocab_size
    if not vocab:
        raise CheckpointError(f"{ckpt_dir / META_FILE} does not record the vocabulary size")
    model = build_empty_model(cfg, int(vocab), device, dtype)
    md = read_dcp_metadata(ckpt_dir)
    check_compatibility(ckpt_dir, meta, _saved_shapes(md), [model], cfg, None, False)
    load_model_tensors([model], ckpt_dir, None, no_dist=True, md=md, checksums=checksums)
    model.eval()
    tokenizer = read_checkpoint_tokenizer(ckpt_dir) if (ckpt_dir / TOKENIZER_DIR).is_dir() else None
    return model, tokenizer


#: Keys of a saved tokenizer's description that name its files.
_TOKENIZER_FILE_KEYS = ("tokenizer_model", "path", "vocab_file", "merge_file")


def _tokenizer_files_stay_inside(tok_dir: Path) -> None:
    """A checkpoint's tokenizer may only name files of its own directory (never /etc/... or ../..)."""
    import json

    from meshtron.checkpoint.checksums import safe_relative_name
    from meshtron.data.tokenizers import META_FILE as TOKENIZER_META

    try:
        meta = json.loads((tok_dir / TOKENIZER_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # missing or unreadable: load_tokenizer says so
    if not isinstance(meta, dict):
        return
    for key in _TOKENIZER_FILE_KEYS:
        name = meta.get(key)
        if isinstance(name, str) and name not in (".", "") and not safe_relative_name(name):
            raise CheckpointError(f"{tok_dir / TOKENIZER_META}: {key} {name!r} is not a file inside {tok_dir}")


def read_checkpoint_tokenizer(ckpt_dir: Path):
    """The tokenizer saved in a checkpoint; CheckpointError naming the directory when it cannot be read."""
    from meshtron.data.tokenizers import load_tokenizer

    tok_dir = ckpt_dir / TOKENIZER_DIR
    _tokenizer_files_stay_inside(tok_dir)
    try:
        return load_tokenizer(tok_dir)
    except CheckpointError:
        raise
    except Exception as err:  # DataError, or a parse error of a damaged file (JSON, protobuf, ...)
        text = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"the checkpoint's tokenizer {tok_dir} cannot be read: {text}") from None
