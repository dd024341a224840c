"""Hang detection: attribution from the ranks' posts, the watchdog's timing, and real stuck jobs.

The multi-process cases run ``meshtron train --nproc-per-node 2`` on CPU (gloo) with a short
``--hang-timeout-seconds`` and a rank made to hang (``--inject-fault hang``) or stopped with
SIGSTOP, and check what the user sees: the exit code, the time it took, and the report.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from meshtron.resilience.hang import (
    HANG_EXIT_CODE, HangSettings, HangWatchdog, Progress, attribute_hang, enable_nccl_flight_recorder,
    format_report, main_thread_state, summary_line,
)
from tests.resilience.job_runs import (
    REPO, hang_events, job_env, meshtron_train, records, tiny_job, train_command, worker_pids,
)

# ----------------------------------------------------------------------------------------------
# Attribution (pure).
# ----------------------------------------------------------------------------------------------


def _entry(rank: int, counts: dict, waiting=None, iteration: int = 3, phase: str = "forward-backward") -> dict:
    return {"rank": rank, "iteration": iteration, "phase": phase, "waiting_in": waiting, "stack": [f"stack {rank}\n"],
            "counts": {name: {"ranks": ranks, "count": c} for name, (ranks, c) in counts.items()}}


def test_the_rank_with_the_lowest_count_is_behind():
    wait = {"collective": "all_reduce", "caller": "trainer.py:120 in _prepare"}
    entries = {
        0: _entry(0, {"world": ([0, 1, 2, 3], 9), "dp": ([0, 2], 12), "tp": ([0, 1], 40)}, wait),
        1: _entry(1, {"world": ([0, 1, 2, 3], 9), "dp": ([1, 3], 12), "tp": ([0, 1], 40)}, wait),
        2: _entry(2, {"world": ([0, 1, 2, 3], 9), "dp": ([0, 2], 11), "tp": ([2, 3], 40)}, None, phase="data"),
        3: _entry(3, {"world": ([0, 1, 2, 3], 9), "dp": ([1, 3], 12), "tp": ([2, 3], 40)},
                  {"collective": "all_gather", "caller": "x"}),
    }
    report = attribute_hang(entries, world_size=4, declared_by=2)
    assert report["ranks_behind"] == [2]
    assert (report["group"], report["group_ranks"], report["collective"]) == ("dp", [0, 2], "all_reduce")
    assert report["caller"] == "trainer.py:120 in _prepare"
    assert (report["iteration"], report["phase"], report["not_reporting"]) == (3, "data", [])
    assert "rank(s) 2 behind" in summary_line(report) and "group dp" in summary_line(report)
    assert "stack 3" in format_report(report)


def test_ranks_that_do_not_report_are_named():
    wait = {"collective": "all_reduce", "caller": "c"}
    entries = {0: _entry(0, {"world": ([0, 1, 2], 5)}, wait), 2: _entry(2, {"world": ([0, 1, 2], 5)}, wait)}
    report = attribute_hang(entries, world_size=3, declared_by=0)
    assert report["not_reporting"] == [1] and report["ranks_behind"] == [1]
    assert report["collective"] == "all_reduce" and report["group"] is None and report["caller"] == "c"
    assert "rank(s) 1 did not report (stopped or dead)" in summary_line(report)


def test_main_thread_state_finds_the_collective():
    stack, waiting = main_thread_state()
    assert stack and waiting is None  # the test's own main thread is in no collective


def test_flight_recorder_settings_keep_the_users():
    env = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    enable_nccl_flight_recorder("/ck", env)
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/ck/nccl_trace_rank_"}
    env = {"TORCH_FR_BUFFER_SIZE": "10", "TORCH_FR_DUMP_TEMP_FILE": "/x"}
    enable_nccl_flight_recorder("/ck", env)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env


# ----------------------------------------------------------------------------------------------
# The watchdog thread, on an in-memory store.
# ----------------------------------------------------------------------------------------------


class _Run:
    """One watchdog on a HashStore; records what it publishes and the exit code it asks for."""

    def __init__(self, progress: Progress, timeout: float, world_size: int = 2, startup: float = 0.0):
        self.reports: list[dict] = []
        self.exited = threading.Event()
        self.code = None
        self.watchdog = HangWatchdog(progress, HangSettings(timeout, startup), rank=0, world_size=world_size,
                                     store=dist.HashStore(), groups=lambda: [], publish=self.reports.append,
                                     exit=self._exit)

    def _exit(self, code: int) -> None:
        self.code = code
        self.exited.set()


def test_watchdog_reports_a_stall_and_exits():
    progress = Progress()
    progress.first_iteration_done, progress.iteration, progress.phase = True, 7, "optimizer"
    run = _Run(progress, timeout=0.6)
    start = time.monotonic()
    run.watchdog.start()
    assert run.exited.wait(30)
    elapsed = time.monotonic() - start
    assert run.code == HANG_EXIT_CODE and 0.6 <= elapsed < 20
    (report,) = run.reports
    assert report["not_reporting"] == [1] and report["declared_by"] == 0
    assert report["ranks"]["0"]["iteration"] == 7 and report["ranks"]["0"]["phase"] == "optimizer"


def test_watchdog_quiet_while_progress_moves():
    progress = Progress()
    run = _Run(progress, timeout=0.6)
    run.watchdog.start()
    for iteration in range(1, 16):  # 1.5 s of progress: more than twice the timeout
        progress.iteration, progress.first_iteration_done = iteration, True
        time.sleep(0.1)
    run.watchdog.stop()
    assert not run.exited.is_set() and run.reports == []


def test_startup_and_checkpoints_get_the_longer_allowance():
    progress = Progress()  # phase "startup", no iteration done
    run = _Run(progress, timeout=0.4, startup=60.0)
    run.watchdog.start()
    time.sleep(1.5)
    progress.first_iteration_done, progress.phase = True, "checkpoint"
    time.sleep(1.5)
    assert not run.exited.is_set()
    progress.phase = "logging"
    assert run.exited.wait(30)
    run.watchdog.stop()


# ----------------------------------------------------------------------------------------------
# Real jobs through the command line.
# ----------------------------------------------------------------------------------------------

HANG_TIMEOUT = 3.0


def test_hung_rank_is_named_and_the_job_exits(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    start = time.monotonic()
    result = meshtron_train(tiny_job("--inject-fault", "hang:1:3", "--hang-timeout-seconds", str(HANG_TIMEOUT),
                                     "--metrics-file", str(metrics), "--save", str(tmp_path / "ck")), timeout=150)
    elapsed = time.monotonic() - start
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-3000:]
    assert elapsed < 120
    (event,) = hang_events(metrics)
    assert event["ranks_behind"] == [1] and event["not_reporting"] == []
    assert (event["group"], event["collective"], event["iteration"]) == ("dp_cp", "all_reduce", 3)
    assert event["phase"] == "data"
    assert "hang detected: rank(s) 1 behind" in result.stderr
    (text,) = glob.glob(str(tmp_path / "ck" / "hang_report_*.txt"))
    report = open(text).read()
    assert "--- rank 0 main thread ---" in report and "--- rank 1 main thread ---" in report
    assert "hang_point" in report  # rank 1's stack shows where it stopped
    assert json.load(open(text[:-4] + ".json"))["ranks_behind"] == [1]


def test_stopped_rank_is_named_as_not_reporting(tmp_path):
    """SIGSTOP one worker (a frozen host): the live rank names it, not a raw gloo timeout."""
    metrics = tmp_path / "metrics.jsonl"
    argv = tiny_job("--hang-timeout-seconds", str(HANG_TIMEOUT), "--metrics-file", str(metrics), iters=100000)
    proc = subprocess.Popen(train_command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(), cwd=REPO)
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(records(metrics, "train")) < 2:
            time.sleep(0.2)
        assert len(records(metrics, "train")) >= 2, "training did not start"
        stopped = worker_pids(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while time.monotonic() < stopped_at + 90 and not hang_events(metrics):
            time.sleep(0.2)
        detected = time.monotonic() - stopped_at
        (event,) = hang_events(metrics)
        assert event["not_reporting"] == [1] and event["ranks_behind"] == [1]
        assert event["collective"] is not None and event["declared_by"] == 0
        assert HANG_TIMEOUT <= detected < 60
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)  # the operator's part: a stopped process ignores SIGTERM
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode not in (0, None), err[-3000:]
    assert "rank(s) 1 did not report (stopped or dead)" in err
