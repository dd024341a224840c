"""Learning-rate schedules: linear warm-up, then constant, linear, cosine, inverse-square-root or WSD decay."""

from __future__ import annotations

import math

from meshtron.config import OptimConfig


def warmup_iters(cfg: OptimConfig, decay_iters: int) -> int:
    if cfg.lr_warmup_fraction is not None:
        return int(cfg.lr_warmup_fraction * decay_iters)
    return cfg.lr_warmup_iters


def learning_rate(cfg: OptimConfig, iteration: int, train_iters: int) -> float:
    """The learning rate used by training iteration ``iteration`` (1-based).

    Warm-up rises linearly from ``--lr-warmup-init`` and reaches ``--lr`` at the last
    warm-up iteration; decay runs from the end of warm-up to ``--lr-decay-iters``, after
    which the rate stays at ``--min-lr``.
    """
    decay_iters = cfg.lr_decay_iters or train_iters
    warm = warmup_iters(cfg, decay_iters)
    max_lr, min_lr = cfg.lr, cfg.min_lr
    if warm > 0 and iteration <= warm:
        return cfg.lr_warmup_init + (max_lr - cfg.lr_warmup_init) * iteration / warm
    style = cfg.lr_decay_style
    if style == "constant":
        return max_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warm, 1)) / math.sqrt(max(iteration, 1)))
    if iteration >= decay_iters:
        return min_lr
    if style == "WSD":
        wsd = cfg.lr_wsd_decay_iters or max(1, int(0.1 * decay_iters))
        stable_end = decay_iters - wsd
        if iteration <= stable_end:
            return max_lr
        ratio = (iteration - stable_end) / wsd
        coeff = {"linear": 1.0 - ratio,
                 "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0),
                 "exponential": 2.0 * (0.5 ** ratio) - 1.0,
                 "minus_sqrt": 1.0 - math.sqrt(ratio)}[cfg.lr_wsd_decay_style]
        return min_lr + coeff * (max_lr - min_lr)
    ratio = (iteration - warm) / max(1, decay_iters - warm)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style}")
    return min_lr + coeff * (max_lr - min_lr)
