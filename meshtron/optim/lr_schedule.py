"""Learning-rate schedules: linear warm-up, then constant, linear, cosine, inverse-square-root or WSD decay.

The schedule is Megatron-LM's, step for step. Its position is counted in samples: it starts at 0 and
advances by the global batch size after every applied optimizer step (a skipped, non-finite step does
not advance it). Training iteration ``i`` (1-based) therefore uses the rate at position
``(i - 1 - skipped) * global_batch_size``, where ``skipped`` counts the steps skipped before it: the first
iteration of a warm-up runs at ``--lr-warmup-init``, ``--lr`` is reached by iteration
``--lr-warmup-iters + 1``, and ``--min-lr`` is reached after the last iteration of the decay (the last
iteration of a run decaying over ``--train-iters`` still runs just above it).

The lengths are in samples too: ``--lr-decay-iters``, ``--lr-warmup-iters`` and ``--lr-wsd-decay-iters``
are multiplied by the global batch size, ``--lr-decay-samples``, ``--lr-warmup-samples`` and
``--lr-wsd-decay-samples`` are taken as they are, and ``--lr-warmup-fraction`` is a fraction of the decay
length in samples (not rounded, as Megatron-LM keeps it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from meshtron.config import OptimConfig


@dataclass(frozen=True)
class ScheduleLengths:
    """The schedule's lengths in samples (the unit of its position)."""

    warmup: float
    decay: int
    wsd_decay: int


def schedule_lengths(cfg: OptimConfig, train_iters: int, global_batch_size: int = 1,
                     train_samples: Optional[int] = None) -> ScheduleLengths:
    """Warm-up, decay and WSD cool-down lengths in samples, as Megatron-LM derives them from the flags.

    With ``--train-samples`` (sample-based training) the decay defaults to ``--train-samples``; otherwise to
    ``--train-iters`` x global batch size.
    """
    gbs = max(1, int(global_batch_size))
    if cfg.lr_decay_samples is not None:
        decay = int(cfg.lr_decay_samples)
    elif train_samples is not None and cfg.lr_decay_iters in (None, train_iters):
        decay = int(train_samples)  # sample-based training: --lr-decay-samples defaults to --train-samples
    else:
        decay = int(cfg.lr_decay_iters or train_iters) * gbs
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    elif cfg.lr_warmup_samples is not None:
        warmup = float(cfg.lr_warmup_samples)
    else:
        warmup = float(cfg.lr_warmup_iters * gbs)
    if cfg.lr_wsd_decay_samples is not None:
        wsd = int(cfg.lr_wsd_decay_samples)
    elif cfg.lr_wsd_decay_iters is not None:
        wsd = int(cfg.lr_wsd_decay_iters) * gbs
    else:  # meshtron's default (Megatron-LM requires the flag with WSD): the last 10% of the decay
        wsd = max(1, int(0.1 * decay))
    return ScheduleLengths(warmup=warmup, decay=max(1, decay), wsd_decay=wsd)


def lr_at(cfg: OptimConfig, lengths: ScheduleLengths, num_steps: int) -> float:
    """The learning rate at schedule position ``num_steps`` (samples consumed by applied steps)."""
    max_lr, min_lr, init_lr = float(cfg.lr), float(cfg.min_lr), float(cfg.lr_warmup_init)
    warm, decay = lengths.warmup, lengths.decay
    if warm > 0 and num_steps <= warm:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warm)
    style = cfg.lr_decay_style
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warm, 1) ** 0.5 / (max(num_steps, 1) ** 0.5))
    ratio = float(num_steps - warm) / float(decay - warm)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif style == "WSD":
        anneal_start = decay - lengths.wsd_decay
        if num_steps <= anneal_start:
            coeff = 1.0
        else:
            r = float(num_steps - anneal_start) / float(lengths.wsd_decay)
            wsd_style = cfg.lr_wsd_decay_style
            if wsd_style == "linear":
                coeff = 1.0 - r
            elif wsd_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
            elif wsd_style == "exponential":
                coeff = 2.0 * math.pow(0.5, r) - 1.0
            elif wsd_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(r)
            else:
                raise ValueError(f"unknown --lr-wsd-decay-style {wsd_style}")
    else:
        raise ValueError(f"unknown --lr-decay-style {style}")
    return min_lr + coeff * (max_lr - min_lr)


def schedule_position(iteration: int, global_batch_size: int = 1, skipped_iterations: int = 0) -> int:
    """The schedule position (samples) that training iteration ``iteration`` (1-based) runs at, after
    ``skipped_iterations`` skipped steps."""
    return max(0, iteration - 1 - skipped_iterations) * max(1, int(global_batch_size))


def learning_rate(cfg: OptimConfig, iteration: int, train_iters: int, global_batch_size: int = 1,
                  skipped_iterations: int = 0, train_samples: Optional[int] = None) -> float:
    """The learning rate used by training iteration ``iteration`` (1-based), as Megatron-LM's
    ``OptimizerParamScheduler`` sets it for that iteration."""
    lengths = schedule_lengths(cfg, train_iters, global_batch_size, train_samples)
    return lr_at(cfg, lengths, schedule_position(iteration, global_batch_size, skipped_iterations))
