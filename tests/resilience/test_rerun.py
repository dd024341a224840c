"""NaN handling by re-run, through the command line on two CPU processes (--inject-fault nan / nan-persistent)."""

from __future__ import annotations

import math

import pytest

from meshtron.resilience.rerun import RerunGuard, RerunStats, _first_rank
from meshtron.parallel.context import ParallelContext
from tests.resilience.cli_runs import Run, clean_run, train


@pytest.fixture(scope="session")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return clean_run(str(tmp_path_factory.getbasetemp()))


def test_clean_run_has_no_rerun(clean: Run) -> None:
    assert clean.returncode == 0, clean.stderr
    assert clean.of_type("rerun") == []
    assert len(clean.losses()) == 8 and all(math.isfinite(x) for x in clean.losses().values())


def test_transient_nan_is_rerun_and_training_continues_exactly(tmp_path, clean: Run) -> None:
    run = train(tmp_path, 2, "--inject-fault", "nan:1:4")
    assert run.returncode == 0, run.stderr
    [event] = run.of_type("rerun")
    assert (event["iteration"], event["rank"], event["result"], event["action"]) == (4, 1, "transient", "continued")
    assert "iteration 4" in run.stderr and "first on rank 1" in run.stderr and "transient" in run.stderr
    assert run.losses() == clean.losses()  # the re-run's result is the clean one, bit for bit


def test_persistent_nan_with_stop_exits_1_naming_iteration_rank_and_samples(tmp_path) -> None:
    run = train(tmp_path, 2, "--inject-fault", "nan-persistent:1:4", "--rerun-persistent-action", "stop",
                "--save", str(tmp_path / "ck"), "--save-interval", "2")
    assert run.returncode == 1
    [event] = run.of_type("rerun")
    assert (event["iteration"], event["rank"], event["result"], event["action"]) == (4, 1, "persistent", "stopped")
    # Iteration 4 uses samples 12..15 of the training order (global batch 4).
    assert event["samples"] == [12, 13, 14, 15]
    errors = [line for line in run.stderr.splitlines() if "error: [rank" in line]
    assert errors and all("iteration 4" in e and "first on rank 1" in e and "samples 12..15" in e for e in errors)
    assert not any(r["iteration"] >= 4 for r in run.of_type("train"))
    assert (tmp_path / "ck" / "latest").exists() or any((tmp_path / "ck").iterdir())  # iteration 2's checkpoint


def test_persistent_nan_with_skip_drops_the_batch_and_completes(tmp_path, clean: Run) -> None:
    run = train(tmp_path, 2, "--inject-fault", "nan-persistent:1:4", "--rerun-persistent-action", "skip")
    assert run.returncode == 0, run.stderr
    [event] = run.of_type("rerun")
    assert (event["iteration"], event["rank"], event["result"], event["action"]) == (4, 1, "persistent", "skipped")
    assert event["samples"] == [12, 13, 14, 15] and "samples 12..15" in run.stderr
    losses = run.losses()
    assert sorted(losses) == list(range(1, 9))
    assert {i: losses[i] for i in (1, 2, 3)} == {i: clean.losses()[i] for i in (1, 2, 3)}
    assert losses[4] is None  # the skipped iteration's loss is the NaN it computed
    assert losses[5] != clean.losses()[5]  # one update fewer: the run went on from iteration 3's weights


# -- unit checks of the decision logic ----------------------------------------------------------

def _guard(**kw) -> RerunGuard:
    args = dict(mode="validate_results", check_nan=True, check_spike=True, spike_factor=3.0, spike_window=10,
                persistent_action="skip", global_batch_size=8)
    args.update(kw)
    return RerunGuard(ParallelContext(), None, [], **args)


def test_spike_needs_history_then_compares_with_the_running_median() -> None:
    guard = _guard()
    assert guard.judge([1.0, 100.0]).ok  # no history yet
    for loss in (2.0, 2.1, 1.9, 2.0, 2.2):
        guard.accept([1.0, loss])
    assert guard.judge([1.0, 5.9]).ok
    verdict = guard.judge([1.0, 6.5])
    assert verdict.reason == "spike" and "running median" in verdict.detail
    assert guard.judge([float("nan"), 2.0]).reason == "nonfinite"
    assert _guard(check_nan=False).judge([float("inf")]).ok


def test_the_named_rank_is_the_first_with_a_bad_own_loss_else_bad_own_gradients() -> None:
    assert _first_rank([[0, 1, 0], [1, 1, 0], [1, 0, 0]], "nonfinite") == 1
    assert _first_rank([[0, 0, 0], [0, 0, 0], [0, 1, 0]], "nonfinite") == 2
    assert _first_rank([[0, 0, 0], [0, 0, 0]], "nonfinite") is None
    assert _first_rank([[0, 0, 1.0], [0, 0, 3.0]], "spike") == 1


def test_report_stats_keeps_the_largest_relative_difference() -> None:
    stats = RerunStats()
    stats.add([2.0, 4.0], [2.0, 4.0])
    stats.add([2.0, 4.0], [2.002, 4.0])
    out = stats.pop()
    assert out["rerun_max_loss_diff"] == 0.0 and abs(out["rerun_max_grad_norm_diff"] - 0.002 / 2.002) < 1e-12
    assert stats.pop()["rerun_max_grad_norm_diff"] == 0.0
