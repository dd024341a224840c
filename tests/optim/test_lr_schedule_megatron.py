"""The learning-rate schedule equals Megatron-LM's OptimizerParamScheduler step for step.

tests/fixtures/megatron/lr_schedule.json holds megatron-core 0.19.2's rates (make_fixtures.py there); the
oracle test runs megatron-core's scheduler itself where it is installed (the ``megatron-oracle`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_cases  # noqa: E402

from meshtron.config import OptimConfig  # noqa: E402
from meshtron.optim.lr_schedule import learning_rate  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "lr_schedule.json"


@pytest.mark.parametrize("name", sorted(megatron_cases.LR_CASES))
def test_learning_rate_equals_megatron_core_fixture(name):
    want = json.loads(FIXTURES.read_text())["cases"][name]
    got = megatron_cases.meshtron_lrs(megatron_cases.LR_CASES[name])
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_learning_rate_equals_megatron_core():
    want = megatron_cases.megatron_lr_cases()
    for name, case in megatron_cases.LR_CASES.items():
        assert megatron_cases.meshtron_lrs(case) == pytest.approx(want[name], rel=1e-12, abs=1e-15), name


def test_first_and_last_iterations():
    """Iteration 1 runs at --lr-warmup-init, --lr from iteration warm-up + 1; the last iteration of a decay over
    --train-iters runs one step above --min-lr, which comes after it."""
    o = OptimConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=10, lr_decay_iters=100)
    assert learning_rate(o, 1, 100, 16) == 0.0
    assert learning_rate(o, 11, 100, 16) == 1.0
    assert learning_rate(o, 100, 100, 16) == pytest.approx(0.1 + 0.9 / 90)
    assert learning_rate(o, 101, 100, 16) == pytest.approx(0.1)


def test_skipped_steps_do_not_advance_the_schedule():
    o = OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=4, lr_decay_iters=20)
    assert learning_rate(o, 6, 20, 8, skipped_iterations=2) == learning_rate(o, 4, 20, 8)


def test_warmup_fraction_is_not_rounded():
    """--lr-warmup-fraction scales the decay length in samples, unrounded (0.13 x 25 x 3 = 9.75 samples)."""
    o = OptimConfig(lr=1.0, lr_decay_style="constant", lr_warmup_fraction=0.13, lr_decay_iters=25)
    assert learning_rate(o, 4, 25, 3) == pytest.approx(9 / 9.75)
    assert learning_rate(o, 5, 25, 3) == 1.0
