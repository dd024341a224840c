"""Straggler detection through the command line on two CPU processes (--inject-fault slow), and its scoring."""

from __future__ import annotations

import pytest

from meshtron.resilience.straggler import SECTIONS, score
from tests.resilience.cli_runs import Run, clean_run, train


@pytest.fixture(scope="session")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return clean_run(str(tmp_path_factory.getbasetemp()))


def test_slow_rank_is_named_and_the_waiting_rank_is_not(tmp_path) -> None:
    run = train(tmp_path, 2, "--inject-fault", "slow:1:3:0.3")
    assert run.returncode == 0, run.stderr
    events = run.of_type("straggler")
    assert [e["iteration"] for e in events] == [4, 8]
    for e in events:
        assert e["ranks"] == [1] and e["slow_sections"] == [["data"]]
        assert e["sections"] == list(SECTIONS)
        assert len(e["relative"]) == len(e["individual"]) == 2 and all(len(row) == 4 for row in e["relative"])
        assert e["relative"][1][0] > 10  # 0.3 s of sleep against a data section of milliseconds
    # Rank 0 waited for rank 1 in the communication section, which does not name a rank.
    assert events[0]["relative"][0][SECTIONS.index("communication")] > 3
    assert "straggler(s): rank 1 (data" in run.stderr and "rank 0 (" not in run.stderr


def test_clean_run_names_no_straggler(clean: Run) -> None:
    assert clean.returncode == 0, clean.stderr
    events = clean.of_type("straggler")
    assert [e["iteration"] for e in events] == [4, 8]
    assert all(e["ranks"] == [] for e in events)
    assert "straggler(s)" not in clean.stderr


def test_scores_use_the_lower_median_and_ignore_negligible_sections() -> None:
    # Seconds per step [data, forward_backward, communication, optimizer] of three ranks.
    times = [[0.001, 0.100, 0.050, 0.010],
             [0.001, 0.180, 0.002, 0.010],   # slow forward/backward: others wait in communication
             [0.003, 0.100, 0.050, 0.010]]   # data 3x the median, but 2 ms of a 160 ms step: not named
    best = [[0.001, 0.090, 0.002, 0.010]] * 3
    report = score(times, best, iteration=10, threshold=1.2)
    assert report.ranks == [1] and report.slow_sections == [["forward_backward"]]
    assert report.relative[1][1] == 1.8 and report.relative[2][0] == 3.0
    assert report.individual[1][1] == 2.0
    two = score([[0.1, 0.1, 0.0, 0.0], [0.1, 0.25, 0.0, 0.0]], [[0.1, 0.1, 0.0, 0.0]] * 2, 2, 1.2)
    assert two.ranks == [1] and two.relative[1][1] == 2.5  # two ranks: against the faster one
    assert "rank 1 (forward_backward 2.50x)" in two.message(1.2)
