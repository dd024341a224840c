"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import pytest

from ckpt_helpers import build_chunks, make_optimizer, tiny_config
from meshtron.checkpoint import save_checkpoint
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState


@pytest.fixture
def first_checkpoint(tmp_path):
    """A one-process checkpoint of the tiny model at iteration 1: (directory, cfg, ctx, chunks, optimizer)."""
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    optimizer, _ = make_optimizer(cfg, chunks)
    save_checkpoint(str(tmp_path), TrainingState(iteration=1), chunks, optimizer, ctx, cfg)
    return tmp_path, cfg, ctx, chunks, optimizer
