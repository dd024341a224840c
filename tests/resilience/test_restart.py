"""Automatic restart through the command line: a rank crashes, torchrun restarts the job
(``--max-restarts``), the new attempt resumes from the latest complete checkpoint and trains
exactly as a run that never failed."""

from __future__ import annotations

import glob

from tests.resilience.job_runs import final_losses, hang_events, meshtron_train, records, tiny_job

# Dropout stays on: the checkpoint's RNG state must make the resumed iterations identical too.
JOB = ("--save-interval", "2", "--hang-timeout-seconds", "5")


def test_crash_restart_gives_the_uninterrupted_losses(tmp_path):
    clean_metrics = tmp_path / "clean.jsonl"
    clean = meshtron_train(tiny_job(*JOB, "--save", str(tmp_path / "clean_ck"), "--metrics-file",
                                    str(clean_metrics)), timeout=180)
    assert clean.returncode == 0, clean.stderr[-3000:]
    # The watchdog watched a healthy run: no false alarm.
    assert hang_events(clean_metrics) == [] and not glob.glob(str(tmp_path / "clean_ck" / "hang_report_*"))

    metrics = tmp_path / "crash.jsonl"
    # --exit-signal-handler: torchrun SIGTERMs the surviving rank, which must not publish a checkpoint
    # of its own (the save needs every rank); the restart resumes from the last complete one.
    crashed = meshtron_train(tiny_job(*JOB, "--save", str(tmp_path / "ck"), "--metrics-file", str(metrics),
                                      "--inject-fault", "crash:1:4", "--max-restarts", "1",
                                      "--exit-signal-handler"), timeout=240)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert records(metrics, "restart") == [{"type": "restart", "attempt": 1, "iteration": 2}]
    assert "restart attempt 1: resuming at iteration 2" in crashed.stdout
    assert final_losses(metrics) == final_losses(clean_metrics)
    assert sorted(final_losses(metrics)) == list(range(1, 7))


def test_crash_without_restarts_fails_and_names_the_rank(tmp_path):
    result = meshtron_train(tiny_job("--inject-fault", "crash:1:2", "--hang-timeout-seconds", "5"), timeout=180)
    assert result.returncode != 0
    launcher_line = [line for line in result.stderr.splitlines() if "worker process(es) failed" in line]
    assert launcher_line and "rank 1" in launcher_line[-1], result.stderr[-3000:]
