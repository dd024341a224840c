"""``save_checkpoint``: write model, optimizer, progress, RNG, config and tokenizer as one checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.nn as nn

from meshtron.checkpoint import coordination
from meshtron.checkpoint.async_save import process_writer
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.metadata import checkpoint_meta, config_yaml, layout_dict, model_signature, rng_bytes
from meshtron.checkpoint.pieces import model_chunks as model_chunk_list
from meshtron.checkpoint.pieces import optimizer_chunks, to_state_dict
from meshtron.checkpoint.writer import SaveJob, quiet_single_process_notice, write_and_publish
from meshtron.config import MeshtronConfig
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState, capture_rng_state


def model_vocab_size(model_chunks: Sequence[nn.Module], cfg: Optional[MeshtronConfig]) -> Optional[int]:
    """The (unpadded) vocabulary size of the model, from its chunks or else the config."""
    for chunk in model_chunks:
        if getattr(chunk, "vocab_size", None) is not None:
            return int(chunk.vocab_size)
    return cfg.model.vocab_size if cfg is not None else None


def build_meta(state: TrainingState, model_chunks: Sequence[nn.Module], optimizer, ctx: ParallelContext,
               cfg: MeshtronConfig, has_tokenizer: bool) -> dict[str, Any]:
    """The content of ``meshtron_checkpoint.json`` for a training checkpoint."""
    return checkpoint_meta(state, model_signature(cfg.model, model_vocab_size(model_chunks, cfg)), layout_dict(ctx),
                           int(optimizer.step_count) if optimizer is not None else None, coordination.world_size(),
                           has_tokenizer)


def save_checkpoint(save_dir: str, state: TrainingState, model_chunks: list[nn.Module], optimizer,
                    ctx: ParallelContext, cfg: MeshtronConfig, tokenizer=None, async_save: bool = False,
                    retain: Optional[int] = None) -> None:
    """Save checkpoint ``state.iteration`` under ``save_dir`` (collective: every rank calls it).

    Each rank writes only its own chunks of the canonical tensors (chunks several ranks
    hold are written once), its RNG state (``state.rng``, or the process's current
    state when None) and, on rank 0, the progress, config and tokenizer. ``latest``
    moves to the new checkpoint only after every rank's files are written and verified.
    With ``async_save`` the function returns once a host copy is taken; the write runs
    in the background (one at a time; see :func:`finalize_async_saves`). ``retain``
    keeps only the newest K checkpoints. Raises CheckpointError on any failure (the
    previous checkpoint stays the latest).
    """
    writer = process_writer()
    writer.wait()  # one save in flight; also surfaces a failed background save
    quiet_single_process_notice()
    if not save_dir:
        raise CheckpointError("--save: no checkpoint directory given")
    if retain is not None and retain < 1:
        raise CheckpointError(f"--save-retain must be at least 1, got {retain}")
    start = time.perf_counter()
    group = coordination.checkpoint_group(ctx)
    rank = coordination.rank()
    meta = build_meta(state, model_chunks, optimizer, ctx, cfg, tokenizer is not None)
    rng = state.rng if state.rng is not None else capture_rng_state()
    if hasattr(optimizer, "finish_param_gather"):
        optimizer.finish_param_gather()  # weights still being all-gathered must land before they are read
    chunks = model_chunk_list(model_chunks)
    if optimizer is not None:
        optimizer.ensure_state()  # zero moments before the first step: the same as fresh AdamW state
        chunks += optimizer_chunks(optimizer)
    job = SaveJob(save_dir=Path(save_dir), iteration=int(state.iteration), rank=rank, state_dict={}, meta=meta,
                  config_text=config_yaml(cfg), rng=rng_bytes(rng), group=group,
                  tokenizer=tokenizer if rank == 0 else None, retain=retain)
    if async_save:
        job.state_dict = to_state_dict(writer.stage(chunks))
        job.timings["blocking_s"] = time.perf_counter() - start
        writer.submit(job)
    else:
        job.state_dict = to_state_dict(chunks)
        write_and_publish(job)
        job.timings["blocking_s"] = time.perf_counter() - start
        writer.last_timings = job.timings


def last_save_timings() -> dict:
    """Seconds of the last save of this process: ``blocking_s`` (training paused), ``tensors_s``, ``total_s``
    (the write; for an asynchronous save known once it finished)."""
    return dict(process_writer().last_timings)
