"""SLURM launches with one task per GPU: torch.distributed's variables derived from SLURM's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.errors import ConfigError
from meshtron.slurm import check_not_doubly_launched, first_host, torchrun_variables


def _task(rank: int, tasks: int = 16, local: int | None = None, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(rank % 8 if local is None
                                                                                       else local),
           "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NUM_NODES": "2"}
    env.update(extra)
    return env


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[007-008]", "gpu007"), ("node1,node2", "node1"), ("a[3,5-7]-ib", "a3-ib"), ("localhost", "localhost"),
    ("rack1-[10-12],rack2-[1-4]", "rack1-10"),
])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_variables_of_every_task_agree():
    tasks = [torchrun_variables(_task(r)) for r in range(16)]
    assert [t["RANK"] for t in tasks] == [str(r) for r in range(16)]
    assert {t["WORLD_SIZE"] for t in tasks} == {"16"} and {t["LOCAL_WORLD_SIZE"] for t in tasks} == {"8"}
    assert [t["LOCAL_RANK"] for t in tasks] == [str(r % 8) for r in range(16)]
    assert {(t["MASTER_ADDR"], t["MASTER_PORT"]) for t in tasks} == {("gpu007", str(20000 + 123456 % 20000))}


def test_set_master_address_and_port_are_kept():
    out = torchrun_variables(_task(3, MASTER_ADDR="10.0.0.1", MASTER_PORT="29400"))
    assert "MASTER_ADDR" not in out and "MASTER_PORT" not in out


def test_not_needed_outside_slurm_for_one_task_or_under_torchrun():
    assert torchrun_variables({}) is None
    assert torchrun_variables(_task(0, tasks=1, local=0)) is None
    assert torchrun_variables({**_task(1), "RANK": "1", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}) is None


@pytest.mark.parametrize("env, words", [
    (_task(16), "SLURM_PROCID=16 is not below SLURM_NTASKS=16"),
    (_task(3, local=9), "SLURM_LOCALID=9"),
    ({**_task(9, local=8)}, "SLURM_LOCALID=8 is not below SLURM_NTASKS_PER_NODE=8"),
    ({k: v for k, v in _task(1).items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID is not set"),
    (_task(1, SLURM_NTASKS="many"), "SLURM_NTASKS='many' is not an integer"),
    ({k: v for k, v in _task(1).items() if k != "SLURM_JOB_NODELIST"}, "MASTER_ADDR"),
    ({k: v for k, v in _task(1).items() if k != "SLURM_JOB_ID"}, "MASTER_PORT"),
    ({**_task(1), "RANK": "1"}, "RANK set but WORLD_SIZE, LOCAL_RANK not"),
])
def test_inconsistent_variables_are_named(env, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        torchrun_variables(env)


def test_nproc_per_node_under_one_task_per_gpu_is_refused():
    with pytest.raises(ConfigError, match="--nproc-per-node 8"):
        check_not_doubly_launched(_task(0), 8)
    check_not_doubly_launched(_task(0, tasks=2, local=0, SLURM_NTASKS_PER_NODE="1(x2)"), 8)  # one task per node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_srun_tasks_train_as_one_job(tmp_path: Path):
    """Two processes with only SLURM's variables (as srun --ntasks-per-node 2 starts them) form one DP=2 job."""
    port = str(_free_port())
    metrics = tmp_path / "m.jsonl"
    argv = [sys.executable, "-m", "meshtron", "train", "--device", "cpu", "--mock-data", "--vocab-size", "128",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1",
            "--eval-interval", "0", "--metrics-file", str(metrics)]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT") and not k.startswith("SLURM_")}
    procs = []
    for rank in range(2):
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "77",
               "SLURM_JOB_NUM_NODES": "1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=tmp_path))
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "DP=2" in outputs[0][1] + outputs[0][0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if r["type"] == "train"] == [1, 2, 3]
