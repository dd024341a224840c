"""The quick-start job: what ``meshtron train`` runs with neither a model, nor data, nor ``--config``.

Its settings (:data:`meshtron.presets.QUICKSTART`) are defaults like any other: each flag given replaces one of
them. A flag must still give a run that works, so the defaults that depend on a given value follow it
(:func:`adapt`), and the notice that lists the settings in use (:func:`notice`) says how each one was adapted:

- ``--load DIR`` without ``--save`` saves nothing (Megatron's meaning of ``--load`` alone) rather than into
  runs/quickstart; with ``--save DIR`` the metrics file goes beside those checkpoints.
- ``--load DIR`` holding a checkpoint: the sequence, batch and schedule settings not given come from the
  checkpoint's configuration, so that the resumed run continues the run that made it.
- ``--max-position-embeddings`` below the sequence length shortens the sequence; ``--seq-length`` above the
  positions lengthens them; ``--lr`` below the default ``--min-lr`` brings ``--min-lr`` to a tenth of it.
- the warm-up is at most a tenth of the decay iterations (30 of the 1,200-iteration job, 0 of a 6-iteration one);
  ``--lr-warmup-fraction`` or ``--lr-warmup-samples`` replace it.
- the global batch of 8 is kept when the data-parallel size divides it, with smaller micro-batches (the same
  samples per step, so the same losses), else it grows to the next multiple of DP; a given micro batch grows the
  global batch to a multiple of micro batch x DP; a given global batch shrinks the micro batch to fit it.

A default that cannot be adapted is left alone; validation then names it, after the notice that listed it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

from meshtron.config import ConfigError, MeshtronConfig, flag_name
from meshtron.presets import QUICKSTART

#: Without any of these (or --config), a run is the quick-start job.
SHAPE_FIELDS: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads")
DATA_FIELDS: tuple[str, ...] = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "mock_data")

#: The quick-start settings that a resumed checkpoint's configuration replaces: what the run it continues used.
#: Not the length of the run, its logging or where it saves: those belong to this invocation.
RESUMED_FIELDS: tuple[str, ...] = ("seq_length", "max_position_embeddings", "micro_batch_size", "global_batch_size",
                                   "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay", "clip_grad")

#: The quick-start warm-up is at most this share of the decay iterations (the full job's 30 of 1,200 is below it).
WARMUP_SHARE = 10


def quickstart_base(given: dict[str, Any], config_file: Optional[str]) -> dict[str, Any]:
    """The quick-start job's settings when neither a model, nor data, nor a config file is given; otherwise nothing.

    Flags then override them one by one, so that ``meshtron train --train-iters 50`` is the quick-start job with 50
    iterations, not a different job.
    """
    chooses_model = "model" in given or "use_checkpoint_args" in given or any(n in given for n in SHAPE_FIELDS)
    chooses_data = any(name in given for name in DATA_FIELDS)
    return {} if config_file or chooses_model or chooses_data else dict(QUICKSTART)


class _Adapter:
    """Changes quick-start defaults in use (never a given value) and remembers why."""

    def __init__(self, cfg: MeshtronConfig, in_use: Sequence[str]) -> None:
        self.cfg = cfg
        self.in_use = set(in_use)
        self.reasons: dict[str, str] = {}
        self.resumed: set[str] = set()  # defaults taken from the resumed checkpoint (even when equal)

    def set(self, name: str, value: Any, why: str) -> None:
        if name in self.in_use and self.cfg.get(name) != value:
            self.cfg.set(name, value)
            self.reasons[name] = why


def adapt(cfg: MeshtronConfig, given: dict[str, Any], in_use: Sequence[str],
          world_size: Optional[int]) -> dict[str, str]:
    """Adapt, in place, the quick-start defaults ``in_use`` (the names no flag gave) to the flags ``given``.

    ``world_size``: the run's number of processes (None when not known yet: the batch is then left alone).
    Returns {field name: how its value was adapted} (see the module docstring for the rules).
    """
    a = _Adapter(cfg, in_use)
    if not a.in_use:
        return {}
    _adapt_checkpoints(a, given)
    _adapt_positions_and_lr(a, given)
    dp = _data_parallel_size(cfg, world_size)
    if dp is not None:
        _adapt_batch(a, dp)
    _adapt_warmup(a, given)
    return a.reasons


def _adapt_checkpoints(a: _Adapter, given: dict[str, Any]) -> None:
    c = a.cfg.checkpoint
    if "load" in given and c.load:
        saved = _resumed_config(c.load)
        if saved is not None:
            for name in RESUMED_FIELDS:
                if name in a.in_use:
                    a.resumed.add(name)
                    a.set(name, saved.get(name), f"from the checkpoint in {c.load}")
        if "save" not in given:
            a.set("save", None, "--load without --save saves nothing; add --save DIR to keep checkpoints")
    if "save" in given and c.save:
        a.set("metrics_file", os.path.join(c.save, "metrics.jsonl"), "beside the checkpoints of --save")


def _resumed_config(load_dir: str) -> Optional[MeshtronConfig]:
    """The configuration of the checkpoint ``--load`` designates; None when there is none (yet) or it cannot be
    read: the load itself then names what is wrong with it."""
    from meshtron.checkpoint import latest_checkpoint_config
    from meshtron.checkpoint.errors import CheckpointError

    try:
        return latest_checkpoint_config(load_dir)
    except (CheckpointError, OSError):
        return None


def _adapt_positions_and_lr(a: _Adapter, given: dict[str, Any]) -> None:
    m, o = a.cfg.model, a.cfg.optim
    if "max_position_embeddings" in given and m.max_position_embeddings is not None:
        if m.seq_length > m.max_position_embeddings:
            a.set("seq_length", m.max_position_embeddings, "no longer than --max-position-embeddings")
    if "seq_length" in given and m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        a.set("max_position_embeddings", m.seq_length, "as long as --seq-length")
    if "lr" in given and o.lr < o.min_lr:
        a.set("min_lr", o.lr / 10, "a tenth of --lr")


def _data_parallel_size(cfg: MeshtronConfig, world_size: Optional[int]) -> Optional[int]:
    """DP of the run, or None when unknown or when the layout does not factor (validation names the flag)."""
    from meshtron.validation import data_parallel_size  # validation imports the launcher: import it late

    if world_size is None:
        return None
    try:
        return data_parallel_size(cfg, world_size)
    except (ConfigError, TypeError, ZeroDivisionError):
        return None


def _largest_divisor_up_to(n: int, limit: int) -> int:
    return next(d for d in range(max(1, min(n, limit)), 0, -1) if n % d == 0)


def _adapt_batch(a: _Adapter, dp: int) -> None:
    """Fit micro batch x DP into the global batch, changing only defaults (module docstring)."""
    t = a.cfg.train
    micro, gbs = t.micro_batch_size, t.global_batch_size
    if not (isinstance(micro, int) and isinstance(gbs, int) and micro > 0 and gbs > 0) or gbs % (micro * dp) == 0:
        return
    micro_free, global_free = "micro_batch_size" in a.in_use, "global_batch_size" in a.in_use
    why_micro = f"to divide --global-batch-size over data-parallel size {dp}"
    if micro_free and global_free:
        new_gbs = math.ceil(gbs / dp) * dp  # unchanged when DP divides it
        a.set("global_batch_size", new_gbs, f"a multiple of data-parallel size {dp}")
        a.set("micro_batch_size", _largest_divisor_up_to(new_gbs // dp, micro), why_micro)
    elif micro_free and gbs % dp == 0:
        a.set("micro_batch_size", _largest_divisor_up_to(gbs // dp, micro), why_micro)
    elif global_free:
        step = micro * dp
        a.set("global_batch_size", math.ceil(gbs / step) * step,
              f"a multiple of --micro-batch-size {micro} x data-parallel size {dp}")


def _decay_iterations(cfg: MeshtronConfig) -> Optional[int]:
    """The iterations the learning rate decays over, as validation will resolve them (None if not computable)."""
    t, o = cfg.train, cfg.optim
    gbs = t.global_batch_size
    if o.lr_decay_iters is not None:
        return o.lr_decay_iters
    for samples in (o.lr_decay_samples, t.train_samples):
        if samples is not None:
            return samples // gbs if isinstance(gbs, int) and gbs > 0 else None
    return t.train_iters


def _adapt_warmup(a: _Adapter, given: dict[str, Any]) -> None:
    replaced_by = next((flag_name(n) for n in ("lr_warmup_fraction", "lr_warmup_samples") if n in given), None)
    if replaced_by:
        a.set("lr_warmup_iters", 0, f"replaced by {replaced_by}")
        return
    decay = _decay_iterations(a.cfg)
    warmup = a.cfg.optim.lr_warmup_iters
    if decay is None or not isinstance(warmup, int):
        return
    limit = max(decay, 0) // WARMUP_SHARE
    if "lr_warmup_iters" in a.resumed:  # the checkpoint's own warm-up: kept while it fits
        if warmup >= decay:
            a.set("lr_warmup_iters", limit, f"the checkpoint's {warmup} clipped to a tenth of {decay} decay "
                                            f"iterations")
    elif warmup > limit:
        a.set("lr_warmup_iters", limit, f"{warmup} clipped to a tenth of {decay} decay iterations")


def notice(cfg: MeshtronConfig, in_use: Sequence[str], adapted: dict[str, str], prog: str = "meshtron") -> Optional[str]:
    """The one line that lists the quick-start settings a run uses, and how each adapted one was (None: none)."""
    if not in_use:
        return None
    shown = []
    for name in in_use:
        flag = "--model" if name == "model" else flag_name(name)
        value = cfg.get(name)
        text = f"no {flag}" if value is None else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
        shown.append(f"{text} ({adapted[name]})" if name in adapted else text)
    return (f"{prog} train: note: no --model, data or --config given: the quick-start job's settings apply, each "
            f"flag given replaces one: {', '.join(shown)}")
