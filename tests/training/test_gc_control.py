"""--manual-gc: automatic collection off during training, collections at fixed iterations, same losses."""

from __future__ import annotations

import gc

import pytest

from meshtron.cli import build_config
from meshtron.training import gc_control
from meshtron.training.gc_control import ManualGC
from meshtron.training.trainer import run_training

MOCK = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--device", "cpu", "--log-interval", "1", "--no-generate-sample"]


class CountingGC:
    """Stands in for the gc module inside gc_control: counts collections, tracks enable/disable."""

    def __init__(self):
        self.collections, self.enabled = 0, True

    def collect(self):
        self.collections += 1

    def disable(self):
        self.enabled = False

    def enable(self):
        self.enabled = True

    def isenabled(self):
        return self.enabled


def test_manual_gc_collects_at_the_interval_and_restores_automatic_collection(monkeypatch):
    fake = CountingGC()
    monkeypatch.setattr(gc_control, "gc", fake)
    with ManualGC(True, interval=3, around_eval=True) as manual:
        assert not fake.enabled and fake.collections == 1  # one at the start
        for iteration in range(1, 10):
            manual.after_step(iteration)
        assert fake.collections == 1 + 3  # iterations 3, 6, 9
        manual.around_evaluation()
        assert fake.collections == 5
    assert fake.enabled and fake.collections == 6  # one at the end


def test_disabled_manual_gc_touches_nothing(monkeypatch):
    fake = CountingGC()
    monkeypatch.setattr(gc_control, "gc", fake)
    with ManualGC(False, interval=1) as manual:
        manual.after_step(1)
        manual.around_evaluation()
    assert fake.enabled and fake.collections == 0


@pytest.mark.slow
def test_training_with_manual_gc_has_the_same_losses_and_reenables_gc():
    plain = run_training(build_config(MOCK + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]))
    manual = run_training(build_config(MOCK + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                                               "--manual-gc", "--manual-gc-interval", "2"]))
    assert gc.isenabled()
    for it, loss in plain.train_losses.items():
        assert manual.train_losses[it] == pytest.approx(loss, rel=1e-6)
