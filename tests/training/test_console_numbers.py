"""The console's interval line keeps one format per number through a run (integers as integers, no switch
to exponent notation) and names the device its per-device rates are per (tok/s/CPU on a CPU run)."""

from __future__ import annotations

import os
import re

from meshtron.cli import build_config
from meshtron.training.logging_sinks import format_train_line
from meshtron.training.trainer import run_training


def _record(**extra) -> dict:
    rec = {"type": "train", "iteration": 1, "consumed_samples": 4, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0,
           "step_time_s": 0.5, "tokens_per_sec_per_gpu": 100.0, "tflops_per_gpu": 0.0000433, "mfu": None,
           "peak_mem_gib": 0.3}
    rec.update(extra)
    return rec


def test_integers_stay_integers_and_small_floats_stay_positional() -> None:
    small = format_train_line(_record(consumed_tokens=128, aux_loss=0.000012345), 10)
    large = format_train_line(_record(consumed_tokens=1228800, aux_loss=0.0123, tflops_per_gpu=0.000739), 10)
    assert "consumed_tokens: 128" in small and "consumed_tokens: 1228800" in large
    assert "aux_loss: 0.00001234" in small and "aux_loss: 0.01230" in large
    assert "TFLOP/s/GPU: 0.0000433" in small and "TFLOP/s/GPU: 0.000739" in large
    assert not re.search(r"\de[+-]\d", small + large), (small, large)


def test_the_device_kind_is_named() -> None:
    line = format_train_line(_record(), 10, device_label="CPU")
    assert "tok/s/CPU: 100" in line and "TFLOP/s/CPU: " in line and "GPU" not in line


def test_a_cpu_run_prints_cpu_rates_and_integer_token_counts(capsys) -> None:
    os.environ.pop("WORLD_SIZE", None)
    # 160 samples x 64 tokens a step: consumed_tokens passes 10,000 at once (where '.4g' went to 1.024e+04).
    run_training(build_config(["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
                               "--num-attention-heads", "2", "--seq-length", "64", "--micro-batch-size", "80",
                               "--global-batch-size", "160", "--train-iters", "2", "--log-interval", "1",
                               "--eval-interval", "0", "--device", "cpu", "--no-generate-sample", "--no-compile"]))
    lines = [line for line in capsys.readouterr().out.splitlines() if "consumed samples" in line]
    assert len(lines) == 2
    assert "consumed_tokens: 10240" in lines[0] and "consumed_tokens: 20480" in lines[1]
    for line in lines:
        assert "tok/s/CPU: " in line and "TFLOP/s/CPU: " in line and "/GPU" not in line
