"""Helpers of the hang and restart tests: a tiny two-process ``meshtron train`` job run through the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[2]

#: A model small enough that a two-process CPU run takes seconds.
TINY = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "128",
        "--log-interval", "1", "--eval-interval", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_job(*extra: str, iters: int = 6) -> list[str]:
    """``meshtron train`` arguments of a two-process job (later flags override earlier ones)."""
    return [*TINY, "--train-iters", str(iters), "--nproc-per-node", "2", "--master-port", str(free_port()), *extra]


def train_command(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "meshtron", "train", *argv]


def job_env() -> dict[str, str]:
    """The test's environment without any torchrun worker variables it may run under."""
    return {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}


def meshtron_train(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Run the job to its end; a job that outlives ``timeout`` fails the test (TimeoutExpired)."""
    return subprocess.run(train_command(argv), capture_output=True, text=True, timeout=timeout, env=job_env(),
                          cwd=REPO)


def records(metrics: Path, kind: Optional[str] = None) -> list[dict]:
    """The metrics file's records (of one ``type``)."""
    if not os.path.exists(metrics):
        return []
    with open(metrics, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if kind is None or r.get("type") == kind]


def hang_events(metrics: Path) -> list[dict]:
    return records(metrics, "hang")


def final_losses(metrics: Path) -> dict[int, float]:
    """The last logged loss of each iteration (a restarted run logs some iterations twice)."""
    return {r["iteration"]: r["loss"] for r in records(metrics, "train")}


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{global rank: pid} of the workers a ``--nproc-per-node`` launcher started (Linux /proc)."""
    out: dict[int, int] = {}
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        try:
            children = Path(f"/proc/{launcher_pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
            if b"RANK" in env:
                out[int(env[b"RANK"])] = child
    return out
