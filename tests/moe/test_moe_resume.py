"""A MoE run with aux-loss-free balancing resumes exactly: the expert bias is part of the checkpoint."""

from __future__ import annotations

import pytest

from meshtron.cli import build_config
from meshtron.training.trainer import run_training

ARGS = ["--mock-data", "--vocab-size", "128", "--model", "tiny", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu", "--train-iters", "6",
        "--log-interval", "1", "--eval-interval", "0", "--no-generate-sample"]


def test_resume_with_expert_bias_equals_uninterrupted(tmp_path):
    full = run_training(build_config(ARGS))
    save = str(tmp_path / "ckpt")
    run_training(build_config(ARGS + ["--save", save, "--exit-interval", "3"]))
    resumed = run_training(build_config(ARGS + ["--load", save]))
    for it in (4, 5, 6):
        assert resumed.train_losses[it] == pytest.approx(full.train_losses[it], rel=1e-6, abs=1e-7), it
