"""Turning token samples into the tensors a training step consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from meshtron.data.errors import DataError


@dataclass(frozen=True)
class BatchOptions:
    """How samples become micro-batches."""

    eod: Optional[int] = None
    #: A dedicated padding id: labels equal to it leave the loss, as Megatron-Core's GPTDataset does. ``None`` (or
    #: the end-of-document id: a tokenizer without its own padding token) masks nothing.
    pad: Optional[int] = None
    vocab_size: Optional[int] = None  # when set, token ids are checked against it
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    pin_memory: bool = False

    def check(self) -> None:
        """The flags that need an end-of-document token fail early when there is none."""
        if self.eod is None:
            for flag, on in (("--reset-position-ids", self.reset_position_ids),
                             ("--reset-attention-mask", self.reset_attention_mask),
                             ("--eod-mask-loss", self.eod_mask_loss)):
                if on:
                    raise DataError(f"{flag} needs an end-of-document token, and this data has none "
                                    "(mock data, or a tokenizer without one)")


def make_micro_batch(samples: np.ndarray, opts: BatchOptions) -> dict[str, torch.Tensor]:
    """One micro-batch from ``samples`` of shape (mbs, seq_length + 1).

    Returns CPU tensors ``tokens`` and ``labels`` (int64), ``loss_mask`` (float32: 0 where the label is the
    padding token, or an end-of-document token under ``eod_mask_loss``) and
    ``position_ids`` (int64), all (mbs, seq_length), plus ``document_ids`` (int32) with
    ``reset_attention_mask``: equal ids mark tokens of one document within a sample (an
    end-of-document token belongs to the document it ends).
    """
    if opts.vocab_size is not None and samples.size:
        hi, lo = int(samples.max()), int(samples.min())
        if hi >= opts.vocab_size or lo < 0:
            bad = hi if hi >= opts.vocab_size else lo
            raise DataError(f"token id {bad} is outside the tokenizer's vocabulary of {opts.vocab_size}: the dataset "
                            "was made with another tokenizer (give the --tokenizer-type/--tokenizer-model/--vocab-file "
                            "used by `meshtron preprocess`)")
    tokens = np.ascontiguousarray(samples[:, :-1])
    labels = np.ascontiguousarray(samples[:, 1:])
    mbs, seq = tokens.shape
    loss_mask = np.ones((mbs, seq), dtype=np.float32)
    if opts.pad is not None and opts.pad != opts.eod:
        loss_mask[labels == opts.pad] = 0.0
    positions = np.repeat(np.arange(seq, dtype=np.int64)[None, :], mbs, axis=0)
    out: dict[str, np.ndarray] = {}
    if opts.eod is not None and (opts.reset_position_ids or opts.reset_attention_mask or opts.eod_mask_loss):
        is_eod = tokens == opts.eod
        if opts.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        if opts.reset_position_ids:
            # A document starts right after each end-of-document token: position = index - start.
            idx = np.arange(seq, dtype=np.int64)
            after_eod = np.where(is_eod, idx + 1, 0)
            start = np.zeros((mbs, seq), dtype=np.int64)
            start[:, 1:] = np.maximum.accumulate(after_eod, axis=1)[:, :-1]
            positions = idx - start
        if opts.reset_attention_mask:
            # Document id = number of end-of-document tokens strictly before the position.
            counts = np.cumsum(is_eod, axis=1, dtype=np.int32)
            out["document_ids"] = counts - is_eod.astype(np.int32)
    out.update(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions)
    batch = {k: torch.from_numpy(v) for k, v in out.items()}
    if opts.pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids", "document_ids") if k in batch}
