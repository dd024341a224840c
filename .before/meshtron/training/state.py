"""Training progress and random-number-generator states: what a checkpoint restores besides tensors."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class TrainingState:
    """Where training stands; saved in every checkpoint."""

    iteration: int = 0
    consumed_samples: int = 0
    nonfinite_in_a_row: int = 0
    skipped_iterations: int = 0
    rng: Optional[dict] = None  # this rank's RNG states (see capture_rng_state)
    extra: dict = field(default_factory=dict)


def capture_rng_state(tracker: Any = None) -> dict:
    """Python, NumPy, torch CPU and CUDA generator states of this process (plus the TP tracker's)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        state["tracker"] = tracker.state_dict()
    return state


def restore_rng_state(state: dict, tracker: Any = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and "tracker" in state:
        tracker.load_state_dict(state["tracker"])
