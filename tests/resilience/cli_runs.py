"""Real multi-process `meshtron train` runs on CPU for the detection tests (straggler, re-run, weight hash).

Each run goes through the command line with ``--nproc-per-node N`` and a tiny model; the clean
reference run is made once per test session and shared by the tests that compare against it.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]

#: A tiny dropout-free model: the re-run and the clean run must agree exactly.
TINY = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-interval", "0", "--log-interval", "1", "--hang-timeout-seconds", "0"]
#: The detection features every run of these tests turns on (so that the clean run serves them all). The
#: straggler threshold is high because the test machine's cores are shared: a tiny step can be several times
#: slower on one process for a while; the injected 0.3 s sleep is hundreds of times the data section.
DETECTION = ["--log-straggler-interval", "4", "--straggler-threshold", "10",
             "--check-weight-hash-across-dp-replicas-interval", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """What a user sees of one run: exit code, output, and the metrics file's records."""

    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("type") == kind]

    def losses(self) -> dict[int, Optional[float]]:
        return {r["iteration"]: r["loss"] for r in self.of_type("train")}


def train(tmp_dir: Path, nproc: int, *flags: str, iters: int = 8, timeout: float = 180.0) -> Run:
    """``meshtron train --nproc-per-node nproc`` with the tiny model, the detection flags and ``flags``."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    metrics = tmp_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    argv = [sys.executable, "-m", "meshtron", "train", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), *TINY, *DETECTION, "--train-iters", str(iters), "--metrics-file", str(metrics), *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    return Run(proc.returncode, proc.stdout, proc.stderr, records)


@functools.lru_cache(maxsize=None)
def clean_run(tmp_root: str) -> Run:
    """The fault-free two-process run (once per session)."""
    return train(Path(tmp_root) / "clean", 2)
