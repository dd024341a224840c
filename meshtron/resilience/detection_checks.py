"""Checks of the detection flags: straggler detection, the NaN/spike re-run and the weight-hash check.

Called by validation (no torch needed); each error is one line naming the flag.
"""

from __future__ import annotations

import os
from typing import Any

from meshtron.config import ConfigError


def restarts_configured(cfg: Any) -> bool:
    """Whether a failed attempt is restarted: ``--max-restarts`` here, or torchrun's in a worker's environment."""
    if cfg.launcher.max_restarts:
        return True
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def check_detection_flags(cfg: Any) -> None:
    """Raise ConfigError for a bad straggler, re-run or weight-hash setting."""
    t, lg = cfg.train, cfg.log
    if lg.log_straggler_interval < 0:
        raise ConfigError(f"--log-straggler-interval must be >= 0 (0: off), got {lg.log_straggler_interval}")
    if not lg.straggler_threshold > 1.0:
        raise ConfigError(f"--straggler-threshold must be above 1 (a rank's time over the median rank's), "
                          f"got {lg.straggler_threshold:g}")
    if lg.straggler_minmax_count < 0:
        raise ConfigError(f"--straggler-minmax-count must be >= 0, got {lg.straggler_minmax_count}")
    if not t.spiky_loss_factor > 1.0:
        raise ConfigError(f"--spiky-loss-factor must be above 1, got {t.spiky_loss_factor:g}")
    if t.spiky_loss_window < 1:
        raise ConfigError(f"--spiky-loss-window must be at least 1, got {t.spiky_loss_window}")
    interval = t.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 0:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be >= 0 (0: off), got {interval}")
    if interval and t.weight_hash_mismatch == "restart" and not restarts_configured(cfg):
        raise ConfigError("--weight-hash-mismatch restart needs an automatic restart to resume from the last "
                          "checkpoint: add --max-restarts N (or launch with torchrun --max-restarts N)")
