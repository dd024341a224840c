"""RNG states for dropout under tensor parallelism.

Dropout outside tensor-parallel regions (on activations that every TP rank holds
in full) must draw the same mask on every TP rank; dropout inside them (on a
rank's own heads) or on sequence-parallel shards must draw different masks. The
tracker keeps a second generator state, seeded per TP rank, and swaps it in for
the duration of a ``fork()`` block. Both states derive from ``--seed`` only.

:func:`capture_rng_state` and :func:`restore_rng_state` save and restore every generator of this process
(Python, NumPy, torch, CUDA and the tracker's), for checkpoints and for the re-run of a suspect iteration.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch

_TP_SEED_OFFSET = 2718


class RNGTracker:
    """Holds the tensor-parallel generator state of one rank."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device):
        self.device = device
        self.default_seed = seed + 100 * pp_rank
        self.tp_seed = seed + _TP_SEED_OFFSET + 100 * pp_rank + tp_rank
        self._tp_state = self._fresh_state(self.tp_seed)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen.get_state()

    def seed_default(self) -> None:
        """Seed the process's default generators (dropout outside TP regions)."""
        torch.manual_seed(self.default_seed)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block with the tensor-parallel generator state, then restore the default one."""
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._tp_state, self.device)
            try:
                yield
            finally:
                self._tp_state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved, self.device)
        else:
            saved = torch.get_rng_state()
            torch.set_rng_state(self._tp_state)
            try:
                yield
            finally:
                self._tp_state = torch.get_rng_state()
                torch.set_rng_state(saved)

    def state_dict(self) -> dict:
        return {"tp_state": self._tp_state.clone()}

    def load_state_dict(self, state: dict) -> None:
        self._tp_state = state["tp_state"].clone()


def capture_rng_state(tracker: Any = None) -> dict:
    """Python, NumPy, torch CPU and CUDA generator states of this process (plus the TP tracker's)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        state["tracker"] = tracker.state_dict()
    return state


def restore_rng_state(state: dict, tracker: Any = None) -> None:
    """Inverse of :func:`capture_rng_state` (the tracker's states only when both were captured)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and "tracker" in state:
        tracker.load_state_dict(state["tracker"])
