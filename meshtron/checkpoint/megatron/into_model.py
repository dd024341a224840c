"""``meshtron train --load MEGATRON_DIR``: a running model (any parallel layout) and its optimizer filled from a
Megatron-LM checkpoint.

Every rank reads the checkpoint whole (:func:`.reader.read_megatron`, on the host) and copies the regions of
the canonical tensors its parameters hold, as a meshtron checkpoint's load does through DCP; the optimizer's
fp32 masters and Adam moments likewise, where the checkpoint has them (otherwise the masters follow the loaded
weights and the moments start from zero, with a notice). The run continues at the checkpoint's iteration and
consumed samples (``args.consumed_train_samples``): meshtron's learning-rate schedule is Megatron-LM's, so it
takes the learning rate Megatron would have used. RNG states are not carried over.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn as nn

from meshtron.checkpoint import coordination
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron.args import check_model
from meshtron.checkpoint.megatron.detect import MegatronCheckpoint
from meshtron.checkpoint.megatron.reader import MegatronState, read_megatron
from meshtron.checkpoint.metadata import compare_tensors
from meshtron.checkpoint.pieces import MODEL_PREFIX, OPTIM_PREFIX, SavedShard, model_shards, state_names_of, state_shards
from meshtron.training.state import TrainingState

logger = logging.getLogger(__name__)


def _fill(chunk: SavedShard, source: dict[str, torch.Tensor], name: str, where: str) -> None:
    full = source.get(name)
    if full is None:
        raise CheckpointError(f"the {where} has no tensor {name}")
    region = full
    for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.data.shape)):
        region = region.narrow(dim, off, size)
    chunk.data.copy_(region.to(chunk.data.dtype))


def _required(models: Sequence[nn.Module], group) -> dict[str, tuple]:
    mine = {c.key[len(MODEL_PREFIX):]: c.global_shape for c in model_shards(models)}
    out: dict[str, tuple] = {}
    for part in coordination.all_gather_object(mine, group):
        out.update(part)
    return out


def load_megatron_into(ckpt: MegatronCheckpoint, model_chunks: Sequence[nn.Module], optimizer, ctx, cfg, *,
                       load_optim: bool = True, vocab_size: Optional[int] = None) -> TrainingState:
    """Fill ``model_chunks`` (and ``optimizer``) from ``ckpt``; the run's progress at the checkpoint. Collective:
    every rank calls it. CheckpointError naming every model flag or tensor that differs."""
    group = coordination.checkpoint_group(ctx)
    lead = coordination.rank() == 0
    where = ckpt.describe()
    vocab = vocab_size or next((int(c.vocab_size) for c in model_chunks if getattr(c, "vocab_size", None)), None)
    state: MegatronState = read_megatron(ckpt, vocab, optimizer=optimizer is not None and load_optim)
    check_model(state.settings, cfg.model, where, vocab)
    diffs = compare_tensors({k: tuple(v.shape) for k, v in state.model.items()}, _required(model_chunks, group))
    if diffs:
        raise CheckpointError(f"the {where} does not match this model", diffs)
    if optimizer is not None:
        optimizer.finish_param_gather()
    with torch.no_grad():
        for chunk in model_shards(model_chunks):
            _fill(chunk, state.model, chunk.key[len(MODEL_PREFIX):], where)
    notices = list(state.notices)
    if optimizer is not None:
        optimizer.weights_written()
        optimizer.ensure_state()
        wanted = {s for i in range(len(optimizer.params)) for s in state_names_of(optimizer, i)}
        have = set(state.optim)
        use_optim = load_optim and bool(have) and wanted <= have
        if load_optim and have and not wanted <= have:
            notices.append(f"{where}: this run's optimizer keeps {', '.join(sorted(wanted - have))}, which the "
                           "checkpoint's Adam state has not: the masters follow the weights, the states start from "
                           "zero")
        elif load_optim and not have and not state.notices:
            notices.append(f"{where} holds no optimizer state: the Adam moments start from zero")
        with torch.no_grad():
            for i, param in enumerate(optimizer.params):
                tensors = optimizer.state_tensors(i)  # a collective over data parallelism (distributed optimizer)
                if use_optim:
                    names = state_names_of(optimizer, i)
                    for chunk in state_shards(param, i, tensors, names):
                        st, name = chunk.key[len(OPTIM_PREFIX):].split(".", 1)
                        _fill(chunk, state.optim[st], name, where)
                    optimizer.load_state_tensors(i, {k: tensors[k] for k in names})
                else:
                    optimizer.load_state_tensors(i, {"master": param.detach().float()})
        if use_optim:
            optimizer.set_step_count(int(state.step if state.step is not None else state.iteration))
    if lead:
        for note in notices:
            logger.warning("%s", note)
        logger.warning("%s: random-number-generator states are not carried over from Megatron-LM", where)
    return TrainingState(iteration=state.iteration, consumed_samples=state.consumed_samples)
