"""``save_checkpoint``: write model, optimizer, progress, RNG, config and tokenizer as one checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from meshtron.checkpoint import coordination
from meshtron.checkpoint.async_save import process_writer
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.owned import (
    first_weight_gather_done, owns_state_segments, sharded_weights, state_shards_by_segment, weight_shards,
)
from meshtron.checkpoint.metadata import checkpoint_meta, config_yaml, layout_dict, model_signature, rng_bytes
from meshtron.checkpoint.pieces import SavedShard, optimizer_shards_by_param, state_tensors_are_views, to_state_dict
from meshtron.checkpoint.pieces import model_shards
from meshtron.checkpoint.writer import SaveJob, quiet_single_process_notice, write_and_publish
from meshtron.config import MeshtronConfig
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import capture_rng_state
from meshtron.training.state import TrainingState


def model_vocab_size(model_chunks: Sequence[nn.Module], cfg: Optional[MeshtronConfig]) -> Optional[int]:
    """The (unpadded) vocabulary size of the model, from its chunks or else the config."""
    for chunk in model_chunks:
        if getattr(chunk, "vocab_size", None) is not None:
            return int(chunk.vocab_size)
    return cfg.model.vocab_size if cfg is not None else None


def build_meta(state: TrainingState, model_chunks: Sequence[nn.Module], optimizer, ctx: ParallelContext,
               cfg: MeshtronConfig, has_tokenizer: bool, save_rng: bool = True) -> dict[str, Any]:
    """The content of ``meshtron_checkpoint.json`` for a training checkpoint."""
    return checkpoint_meta(state, model_signature(cfg.model, model_vocab_size(model_chunks, cfg)), layout_dict(ctx),
                           int(optimizer.step_count) if optimizer is not None else None,
                           coordination.world_size() if save_rng else None, has_tokenizer)


def save_checkpoint(save_dir: str, state: TrainingState, model_chunks: list[nn.Module], optimizer,
                    ctx: ParallelContext, cfg: MeshtronConfig, tokenizer=None, async_save: bool = False,
                    retain: Optional[int] = None, save_rng: bool = True,
                    report: Optional[Callable[[str], None]] = None) -> None:
    """Save checkpoint ``state.iteration`` under ``save_dir`` (collective: every rank calls it).

    Each rank writes only its own chunks of the canonical tensors (chunks several ranks
    hold are written once), its RNG state (``state.rng``, or the process's current
    state when None) and, on rank 0, the progress, config and tokenizer. ``latest``
    moves to the new checkpoint only after every rank's files are written and verified.
    With ``async_save`` the function returns once a host copy is taken; the write runs
    in the background (one at a time; see :func:`finalize_async_saves`). ``retain``
    keeps only the newest K checkpoints. ``optimizer`` None saves no optimizer state and
    ``save_rng`` False no RNG states (``--no-save-optim``, ``--no-save-rng``): loading such a
    checkpoint starts fresh Adam moments / keeps the seeded RNG. Raises CheckpointError on any
    failure (the previous checkpoint stays the latest).

    ``report`` (the train loop's console) is told "saved checkpoint at iteration N to DIR" when a
    synchronous save is complete; for an asynchronous one, "saving checkpoint at iteration N to DIR
    (in the background)" when its write starts, and "saved ... (durable)" only once it is published
    (:func:`~meshtron.checkpoint.async_save.poll_async_saves` at a later iteration, or any wait).
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
    meta = build_meta(state, model_chunks, optimizer, ctx, cfg, tokenizer is not None, save_rng)
    rng = (state.rng if state.rng is not None else capture_rng_state()) if save_rng else None
    if sharded_weights(optimizer) is not None:
        first_weight_gather_done(optimizer)  # ZeRO-3: the weights are saved from this rank's shards, never gathered
    elif optimizer is not None:
        optimizer.finish_param_gather()  # weights still being all-gathered must be whole to be read
    job = SaveJob(save_dir=Path(save_dir), iteration=int(state.iteration), rank=rank, state_dict={}, meta=meta,
                  config_text=config_yaml(cfg), rng=rng_bytes(rng) if rng is not None else None, group=group,
                  tokenizer=tokenizer if rank == 0 else None, retain=retain)
    chunks = _collect_chunks(model_chunks, optimizer, writer if async_save else None)
    job.state_dict = to_state_dict(chunks)
    if async_save:
        job.timings["blocking_s"] = time.perf_counter() - start
        writer.submit(job, report)
        if report is not None:
            report(f"saving checkpoint at iteration {job.iteration} to {save_dir} (in the background)")
    else:
        write_and_publish(job)
        job.timings["blocking_s"] = time.perf_counter() - start
        writer.last_timings = job.timings
        if report is not None:
            report(f"saved checkpoint at iteration {job.iteration} to {save_dir}")


def _collect_chunks(model_chunks: Sequence[nn.Module], optimizer, stager) -> list[SavedShard]:
    """This rank's chunks of model and optimizer state; host copies when ``stager`` is given (async).

    Nothing is gathered: ZeRO-3 weights are saved from this rank's weight shards, and the distributed
    optimizer's masters and moments from its own segments (:mod:`meshtron.checkpoint.owned`), each a view
    of the rank's memory. DCP copies one chunk at a time to the host while writing, so a synchronous save
    needs no more extra memory than its largest chunk.
    """
    if stager is not None:
        stager.begin_staging()
    zero3 = sharded_weights(optimizer) is not None
    chunks = model_shards(model_chunks, parameters=not zero3)
    if zero3:
        chunks = weight_shards(optimizer) + chunks
    if stager is not None:
        chunks = [stager.stage(c) for c in chunks]
    if optimizer is not None:
        optimizer.ensure_state()  # zero moments before the first step: the same as fresh AdamW state
        if owns_state_segments(optimizer):
            by_segment = state_shards_by_segment(optimizer)
            for segment_chunks in by_segment:
                if stager is not None:  # a converted (non-fp32) state is a temporary: copy it before the next
                    segment_chunks = [stager.stage(c, blocking=True) for c in segment_chunks]
                chunks += segment_chunks
        else:
            copies = not state_tensors_are_views(optimizer)
            for param_chunks in optimizer_shards_by_param(optimizer):
                if stager is not None:
                    param_chunks = [stager.stage(c, blocking=copies) for c in param_chunks]
                elif copies:
                    param_chunks = [SavedShard(c.key, c.global_shape, c.offsets, c.data.cpu()) for c in param_chunks]
                chunks += param_chunks
    if stager is not None:
        stager.finish_staging()
    return chunks


def last_save_timings() -> dict:
    """Seconds of the last save of this process: ``blocking_s`` (training paused), ``tensors_s``, ``total_s``
    (the write; for an asynchronous save known once it finished)."""
    return dict(process_writer().last_timings)
