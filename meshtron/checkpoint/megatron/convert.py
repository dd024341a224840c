"""``meshtron convert --from megatron``: a Megatron-LM checkpoint written as a meshtron checkpoint.

The canonical tensors, the optimizer's fp32 masters and Adam moments where the checkpoint has them in a
format meshtron reads (with the step count), the iteration and consumed samples; the model flags come from
the checkpoint's ``args``. The vocabulary keeps Megatron's padded size (``args.padded_vocab_size``): every row
Megatron computed a probability for stays a row of the model, so the converted model computes what Megatron's
did. The result loads in any parallel layout (``meshtron train --load``, ``meshtron generate``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch

from meshtron.checkpoint.conversion_checks import check_complete, first_missing, require_empty
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron.args import apply_settings
from meshtron.checkpoint.megatron.detect import find_megatron_checkpoint
from meshtron.checkpoint.megatron.reader import read_megatron
from meshtron.checkpoint.metadata import checkpoint_meta, config_yaml, model_signature
from meshtron.checkpoint.pieces import SavedShard, model_key, optim_key, to_state_dict
from meshtron.config import MeshtronConfig
from meshtron.training.state import TrainingState


def megatron_to_meshtron(input_dir: str | Path, output_dir: str | Path, dtype: Optional[torch.dtype] = None,
                         notices: Optional[list[str]] = None, optimizer: bool = True) -> Path:
    """Convert the Megatron-LM checkpoint ``input_dir`` designates (a save directory or one ``iter_N``); returns
    the path of the meshtron checkpoint written under ``output_dir``."""
    from meshtron.checkpoint.writer import SaveJob, write_and_publish

    notices = notices if notices is not None else []
    out = Path(output_dir)
    ckpt = find_megatron_checkpoint(input_dir)
    if ckpt is None:
        raise CheckpointError(f"--input {input_dir}: not a Megatron-LM checkpoint (expected "
                              "latest_checkpointed_iteration.txt and iter_NNNNNNN/ with .metadata + __*.distcp "
                              "files or mp_rank_*/model_optim_rng.pt)")
    require_empty(out)
    state = read_megatron(ckpt, optimizer=optimizer, dtype=dtype)
    notices += state.notices
    cfg = MeshtronConfig()
    apply_settings(cfg.model, state.settings)
    chunks = [SavedShard(model_key(n), tuple(t.shape), (0,) * t.dim(), t) for n, t in state.model.items()]
    check_complete(cfg, {n: tuple(t.shape) for n, t in state.model.items()})
    for st, tensors in state.optim.items():
        chunks += [SavedShard(optim_key(st, n), tuple(t.shape), (0,) * t.dim(), t.float().contiguous())
                   for n, t in tensors.items()]
    progress = TrainingState(iteration=state.iteration, consumed_samples=state.consumed_samples)
    step = state.step if state.optim else None
    meta = checkpoint_meta(progress, model_signature(cfg.model, cfg.model.vocab_size),
                           {"world_size": 1, "tp": 1, "cp": 1, "dp": 1, "pp": 1, "ep": 1}, step, None, False)
    meta["converted_from"] = {"format": "megatron", "megatron_format": ckpt.format,
                              "path": str(ckpt.directory.resolve()), "opt_param_scheduler": _plain(state.scheduler)}
    if not state.optim:
        notices.append(f"{ckpt.describe()}: converted without optimizer state (the Adam moments of a run that "
                       "loads it start from zero)")
    job = SaveJob(save_dir=out, iteration=state.iteration, rank=0, state_dict=to_state_dict(chunks), meta=meta,
                  config_text=config_yaml(cfg), rng=None, group=None, tokenizer=None)
    created = first_missing(out)
    try:
        return write_and_publish(job)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _plain(value):
    """JSON-friendly copy of Megatron's scheduler state (numbers, strings, lists, dicts)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)
