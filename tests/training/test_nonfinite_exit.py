"""A run whose model ended non-finite fails (exit code 1, one line naming the iteration); a run that skipped
one transient non-finite step and recovered still succeeds. Through the command line, as a user sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--log-interval", "4", "--no-generate-sample", "--no-compile", "--hang-timeout-seconds", "0",
        # many skipped steps in a row would stop the run earlier (a failure too); here it must reach its end
        "--max-nonfinite-steps", "100"]


def _train(*flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "meshtron", "train", *TINY, *flags], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)


def _errors(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if "error:" in line]


def test_weights_that_became_nonfinite_fail_the_run() -> None:
    # Weights drawn with a standard deviation beyond float32: inf/NaN from the start, every step skipped.
    run = _train("--train-iters", "4", "--eval-interval", "0", "--init-method-std", "1e39")
    assert run.returncode == 1, run.stderr
    [error] = _errors(run)
    assert "weights hold NaN/inf values at iteration 4" in error and "4 of 4 iterations were skipped" in error
    assert "Traceback" not in run.stderr


def test_a_nonfinite_validation_loss_at_the_end_fails_the_run() -> None:
    # A flipped exponent bit after iteration 1's step: the weights stay finite but the model yields NaN.
    run = _train("--train-iters", "8", "--eval-interval", "4", "--eval-iters", "1", "--split", "90,10,0",
                 "--inject-fault", "bitflip:0:1:30")
    assert run.returncode == 1, run.stderr
    [error] = _errors(run)
    assert "validation loss at iteration 8 is nan" in error and "iterations were skipped as non-finite" in error


def test_one_skipped_transient_step_still_succeeds() -> None:
    run = _train("--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", "--rerun-mode", "disabled",
                 "--inject-fault", "nan:0:3")
    assert run.returncode == 0, run.stderr
    assert _errors(run) == []
    assert "iteration 3: non-finite loss or gradient norm" in run.stderr
    assert "1 of 6 iterations were skipped as non-finite" in run.stderr
