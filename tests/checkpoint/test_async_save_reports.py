"""--async-save says "saving" when the background write starts and "saved ... (durable)" only once the
write is published, found at a later iteration boundary without waiting for it; a failed background save
ends the run at the next iteration with exit 1 (as a failed synchronous save does), never silently."""

from __future__ import annotations

import errno
import re
import threading

import pytest
import torch.distributed.checkpoint as dcp

from meshtron import checkpoint
from meshtron.checkpoint import async_save
from meshtron.checkpoint.layout import list_iterations, read_latest
from meshtron.cli import main as meshtron_main

TRAIN = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--device", "cpu", "--log-interval", "1", "--no-generate-sample", "--eval-interval", "0",
         "--train-iters", "6", "--save-interval", "3", "--async-save", "--hang-timeout-seconds", "0"]


def _index(lines: list[str], pattern: str) -> int:
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert len(found) == 1, (pattern, lines)
    return found[0]


def _polls_release(monkeypatch, gate: threading.Event, at_call: int) -> None:
    """Let ``gate`` open at the ``at_call``-th iteration-boundary poll (then poll as usual)."""
    real, calls = checkpoint.poll_async_saves, []

    def poll(device=None):
        calls.append(1)
        if len(calls) == at_call:
            gate.set()
        real(device)

    monkeypatch.setattr(checkpoint, "poll_async_saves", poll)


def test_durable_only_once_published_and_training_goes_on_meanwhile(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    gate = threading.Event()
    real_write = async_save.write_and_publish

    def slow_write(job):
        if job.iteration == 3:
            assert gate.wait(120), "the train loop never reached iteration 5"
        out = real_write(job)
        print(f"[test] published iteration {job.iteration}", flush=True)
        return out

    monkeypatch.setattr(async_save, "write_and_publish", slow_write)
    _polls_release(monkeypatch, gate, at_call=5)  # the boundary of iteration 5: two iterations after the save
    assert meshtron_main(["train", *TRAIN, "--save", str(save)]) == 0
    lines = capsys.readouterr().out.splitlines()
    saving = _index(lines, rf"^saving checkpoint at iteration 3 to {re.escape(str(save))} \(in the background\)$")
    published = _index(lines, r"^\[test\] published iteration 3$")
    durable = _index(lines, rf"^saved checkpoint at iteration 3 to {re.escape(str(save))} \(durable\)$")
    assert saving < _index(lines, r"iteration +4/6") < _index(lines, r"iteration +5/6") < published < durable
    assert _index(lines, r"^saved checkpoint at iteration 6 .*\(durable\)$") > _index(lines, r"iteration +6/6")
    assert not [line for line in lines if re.match(r"^saved checkpoint at iteration \d+ to \S+$", line)]
    assert list_iterations(save) == [3, 6] and read_latest(save) == 6


def test_failed_background_save_ends_the_run_at_the_next_iteration(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    failed = threading.Event()
    real_write = async_save.write_and_publish

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    def failing_write(job):
        try:
            return real_write(job)
        finally:
            failed.set()

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    monkeypatch.setattr(async_save, "write_and_publish", failing_write)
    real_poll, calls = checkpoint.poll_async_saves, []

    def poll_after_the_write(device=None):  # the write (started at iteration 3) has ended by iteration 4's poll
        calls.append(1)
        if len(calls) == 4:
            assert failed.wait(120)
        real_poll(device)

    monkeypatch.setattr(checkpoint, "poll_async_saves", poll_after_the_write)
    assert meshtron_main(["train", *TRAIN, "--save", str(save)]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1, captured.err
    assert f"saving checkpoint iteration 3 to {save} failed: no space left on device" in errors[0], errors
    assert "iteration 4/6" in captured.out and "iteration 5/6" not in captured.out  # stopped at the next boundary
    assert "(durable)" not in captured.out
    assert list_iterations(save) == [] and read_latest(save) is None


@pytest.mark.parametrize("async_save_flag", [[], ["--async-save"]])
def test_a_failed_save_exits_1_either_way(tmp_path, monkeypatch, capsys, async_save_flag):
    """The outcome of a failed save does not depend on --async-save (only when it is known does)."""
    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    argv = [a for a in TRAIN if a != "--async-save"] + async_save_flag
    assert meshtron_main(["train", *argv, "--save", str(tmp_path / "ckpt")]) == 1
    assert "no space left on device" in capsys.readouterr().err
