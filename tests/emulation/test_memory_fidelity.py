"""An emulated rank holds exactly the memory its real twin holds: the peak of live tensor storages over three
training steps, real gloo ranks against emulated ones, on CPU (tests/emulation/memory_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.resilience.cli_runs import free_port

REPO = Path(__file__).resolve().parents[2]
PROBE = str(REPO / "tests" / "emulation" / "memory_probe.py")
TINY = ["--device", "cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "2", "--vocab-size", "512", "--train-iters", "3",
        "--eval-interval", "0", "--rerun-mode", "disabled", "--hang-timeout-seconds", "0",
        "--no-check-for-nan-in-loss-and-grad"]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2"],
    pytest.param(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], marks=pytest.mark.slow),
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2", "--compile"],
                 marks=pytest.mark.slow),
], ids=["tp2_sp", "pp2", "tp2_sp_compiled"])
def test_emulated_rank_peaks_where_the_real_rank_peaks(tmp_path, flags):
    world = 2
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-port", str(free_port()), PROBE, "real", str(tmp_path / "real"), *TINY, *flags],
                          capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    assert real.returncode == 0, real.stderr[-3000:]
    for rank in range(world):
        emulated = subprocess.run([sys.executable, PROBE, "emulated", str(tmp_path / "emulated"), *TINY, *flags],
                                  capture_output=True, text=True, timeout=300, cwd=REPO,
                                  env=_env(EMULATED_RANK=str(rank), EMULATED_WORLD=str(world)))
        assert emulated.returncode == 0, emulated.stderr[-3000:]
        ours = json.loads((tmp_path / f"real.rank{rank}.json").read_text())["peak_bytes"]
        twin = json.loads((tmp_path / f"emulated.rank{rank}.json").read_text())["peak_bytes"]
        assert ours > 0 and twin == ours, f"rank {rank}: real peak {ours:,} bytes, emulated {twin:,}"
