"""Training progress and random-number-generator states: what a checkpoint restores besides tensors.

The capture and restore of the generator states live with the RNG tracker (:mod:`meshtron.parallel.random`), below
the trainer, the checkpoint code and the re-run guard that use them; they are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from meshtron.parallel.random import capture_rng_state, restore_rng_state  # noqa: F401 (re-exported)


@dataclass
class TrainingState:
    """Where training stands; saved in every checkpoint."""

    iteration: int = 0
    consumed_samples: int = 0
    nonfinite_in_a_row: int = 0
    skipped_iterations: int = 0
    rng: Optional[dict] = None  # this rank's RNG states (see capture_rng_state)
    extra: dict = field(default_factory=dict)
