"""One job per --save directory: a second job is refused naming the holder (exit 2), a lock left by a dead
job is taken over, one process per job holds it (rank 0), and every exit path releases it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.checkpoint import save_lock
from meshtron.checkpoint.layout import list_iterations, read_latest
from meshtron.checkpoint.save_lock import LOCK_FILE, Holder, SaveDirLock, SaveDirLockedError
from meshtron.cli import main as meshtron_main

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--device", "cpu", "--log-interval", "1", "--no-generate-sample", "--eval-interval", "0",
         "--train-iters", "2", "--hang-timeout-seconds", "0"]
#: A process that holds the lock of argv[1] the way a training job's rank 0 does, until its stdin closes.
HOLDER = ("import sys\nfrom meshtron.checkpoint.save_lock import SaveDirLock\n"
          "lock = SaveDirLock(sys.argv[1])\nlock.acquire()\nprint('held', flush=True)\nsys.stdin.read()\n"
          "lock.release()\n")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def other_job(tmp_path):
    """Another process holding the lock of ``tmp_path / "ckpt"``; yields the Popen (killed at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "ckpt")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    assert proc.stdout.readline().strip() == "held"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def test_second_job_is_refused_then_takes_over_when_the_first_dies(tmp_path, other_job, capsys, caplog):
    save = tmp_path / "ckpt"
    assert meshtron_main(["train", *TRAIN, "--save", str(save)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert f"--save {save} is in use by another job (pid {other_job.pid} on host {socket.gethostname()}, " \
           f"started " in lines[0] and "overwrite each other's checkpoints" in lines[0], lines
    assert list_iterations(save) == []  # refused before any work
    # The holder dies without releasing (SIGKILL): the kernel drops its lock, the next job takes over.
    other_job.send_signal(signal.SIGKILL)
    other_job.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="meshtron.checkpoint.save_lock"):
        assert meshtron_main(["train", *TRAIN, "--save", str(save)]) == 0
    took = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(took) == 1 and f"pid {other_job.pid} on host" in took[0], took
    assert read_latest(save) == 2
    assert (save / LOCK_FILE).read_text() == ""  # released cleanly: nothing to report to the next job


def test_two_rank_job_holds_one_lock_and_is_refused_as_a_whole(tmp_path, other_job):
    save = tmp_path / "ckpt"

    def run(*flags: str) -> subprocess.CompletedProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return subprocess.run([sys.executable, "-m", "meshtron", "train", "--nproc-per-node", "2", "--master-port",
                               str(port), *TRAIN, "--save", str(save), *flags],
                              capture_output=True, text=True, cwd=REPO, env=_env(), timeout=240)

    refused = run()
    assert refused.returncode == 2, refused.stderr
    assert f"in use by another job (pid {other_job.pid} on host" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    other_job.stdin.close()  # the holder ends normally
    other_job.wait(timeout=30)
    # Two ranks, one lock: were rank 1 to lock too, one of the two processes would refuse the other. (With
    # background saves, whose completion every rank checks together at each iteration boundary.)
    done = run("--async-save", "--save-interval", "1")
    assert done.returncode == 0, done.stderr
    assert read_latest(save) == 2 and "took over" not in done.stderr
    for it in (1, 2):
        assert f"saved checkpoint at iteration {it} to {save} (durable)" in done.stdout, done.stdout


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_every_exit_path_releases_the_lock(tmp_path, monkeypatch, capsys, error):
    from meshtron.training.trainer import Trainer

    save = tmp_path / "ckpt"

    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(Trainer, "_run_iterations", fail)
    assert meshtron_main(["train", *TRAIN, "--save", str(save)]) != 0
    capsys.readouterr()
    lock = SaveDirLock(save)  # another open file: flock refuses it while the job's lock is held, even here
    assert lock.acquire() is None
    lock.release()
    monkeypatch.undo()
    assert meshtron_main(["train", *TRAIN, "--save", str(save), "--async-save"]) == 0  # and after a normal end
    assert lock.acquire() is None
    lock.release()


def test_a_lock_file_without_a_lock_is_free(tmp_path, caplog):
    save = tmp_path / "ckpt"
    save.mkdir()
    dead = Holder("somewhere-else", 4242, "2026-01-01T00:00:00+00:00")
    (save / LOCK_FILE).write_text(dead.to_json())  # a crashed job's body; its lock died with it
    lock = SaveDirLock(save)
    assert lock.acquire() == dead
    assert Holder.parse((save / LOCK_FILE).read_text()).pid == os.getpid()
    with pytest.raises(SaveDirLockedError, match=rf"pid {os.getpid()} on host"):
        SaveDirLock(save).acquire()
    lock.release()


def test_without_flock_the_holder_record_decides(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    save.mkdir()

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    host = socket.gethostname()
    (save / LOCK_FILE).write_text(Holder(host, os.getppid(), "2026-01-01T00:00:00+00:00").to_json())
    with pytest.raises(SaveDirLockedError, match=rf"pid {os.getppid()} .*remove {save / LOCK_FILE}"):
        SaveDirLock(save).acquire()  # alive on this host
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    (save / LOCK_FILE).write_text(Holder(host, int(dead_pid), "2026-01-01T00:00:00+00:00").to_json())
    lock = SaveDirLock(save)
    assert lock.acquire().pid == int(dead_pid)  # dead on this host: taken over
    lock.release()


def test_the_lock_outlives_a_background_save_in_flight(tmp_path, monkeypatch):
    import threading

    from meshtron.checkpoint import async_save

    go = threading.Event()
    writer = async_save.AsyncCheckpointer()
    monkeypatch.setattr(async_save, "write_and_publish", lambda job: go.wait(60))
    monkeypatch.setattr(save_lock, "process_writer", lambda: writer)
    lock = SaveDirLock(tmp_path / "ckpt")
    lock.acquire()
    writer.submit(async_save.SaveJob(tmp_path / "ckpt", 1, 0, {}, {}, "", None, None))
    save_lock.JobSaveLock(lock).release()
    assert lock.held  # still writing: the directory is still this job's
    go.set()
    writer.wait()
    assert not lock.held


#: A holder that forks a child (as data-loader workers are) and dies without releasing: the child, which shares
#: the locked open file, keeps the lock until its stdin closes.
FORKING_HOLDER = ("import os, sys\nfrom meshtron.checkpoint.save_lock import SaveDirLock\n"
                  "SaveDirLock(sys.argv[1]).acquire()\n"
                  "if os.fork() == 0:\n    print('child', flush=True)\n    sys.stdin.read()\n    os._exit(0)\n"
                  "os._exit(0)\n")


@pytest.fixture
def dead_holder_with_a_child(tmp_path):
    """(the dead holder's pid, the stdin of its still-running child)."""
    proc = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path / "ckpt")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    assert proc.stdout.readline().strip() == "child"
    proc.wait(timeout=30)  # the holder itself is gone
    yield proc.pid, proc.stdin
    if not proc.stdin.closed:
        proc.stdin.close()


def test_a_dead_holders_children_are_waited_for(tmp_path, dead_holder_with_a_child, monkeypatch):
    pid, child_stdin = dead_holder_with_a_child
    real_pause, pauses = save_lock._pause, []

    def pause(seconds):
        pauses.append(seconds)
        if not child_stdin.closed:
            child_stdin.close()  # the child notices its parent is gone and exits
        real_pause(seconds)

    monkeypatch.setattr(save_lock, "_pause", pause)
    lock = SaveDirLock(tmp_path / "ckpt")
    assert lock.acquire().pid == pid  # taken over once the child let go
    assert pauses  # it did wait for the child
    lock.release()


def test_a_dead_holders_children_that_stay_are_named(tmp_path, dead_holder_with_a_child, monkeypatch):
    pid = dead_holder_with_a_child[0]
    monkeypatch.setattr(save_lock, "LEFTOVER_WAIT_S", 0.3)
    with pytest.raises(SaveDirLockedError, match=rf"is still locked, 0.3 s after its job \(pid {pid} on host .*\) "
                                                 rf"exited, by processes that job started"):
        SaveDirLock(tmp_path / "ckpt").acquire()
