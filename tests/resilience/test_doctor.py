"""`meshtron doctor` on two CPU processes: a rank slowed by --inject-fault is named (exit 1); a clean check passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from meshtron.doctor import SIZES, build_report
from tests.resilience.cli_runs import REPO, free_port


def doctor(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "meshtron", "doctor", "--device", "cpu", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=180)


def test_slow_rank_is_named_and_exit_code_is_1() -> None:
    result = doctor("--nproc-per-node", "2", "--master-port", str(free_port()), "--json",
                    "--inject-fault", "slow:1:1:0.2")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    named = {(f["name"], f["metric"]) for f in report["outliers"] if f["kind"] == "device"}
    assert named == {("rank 1", "matmul_tflops"), ("rank 1", "memory_gbps")}
    assert all(f["below"] > 0.5 for f in report["outliers"])
    assert [(link["src"], link["dst"]) for link in report["links"]] == [(1, 0), (0, 1)]
    assert report["groups"][0]["ranks"] == [0, 1] and report["groups"][0]["all_reduce_busbw_gbps"] > 0
    assert "worker process(es) failed" not in result.stderr  # an expected verdict, not a crash


def test_clean_check_passes_with_a_table() -> None:
    # A generous threshold: the test machine's cores are shared with other work.
    result = doctor("--nproc-per-node", "2", "--master-port", str(free_port()), "--threshold", "0.6",
                    "--trials", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matmul GFLOP/s" in result.stdout and "send/recv GB/s" in result.stdout
    assert "ok: nothing more than 60% below the median" in result.stdout


def test_bad_input_is_one_line_and_exit_2() -> None:
    result = doctor("--inject-fault", "crash:0:1")
    assert result.returncode == 2
    assert result.stderr.strip() == "meshtron doctor: error: --inject-fault crash:0:1: meshtron doctor injects " \
                                    "only slow:RANK:1:SECONDS"


def test_neighbour_groups_compare_with_each_other() -> None:
    sizes = SIZES["cpu"]
    host = [0.0] * 128

    nan = float("nan")

    def row(rank: int, block_reduce: float) -> list[float]:
        # [flops, bytes/s, ring seconds, world (all-reduce, all-to-all), each block (all-reduce, all-to-all)];
        # NaN for the blocks the rank is not in.
        blocks = [[block_reduce, 1e-3] if rank // 2 == b else [nan, nan] for b in range(3)]
        return [1e10, 1e10, 1e-3, 1e-3, 1e-3, *(v for pair in blocks for v in pair), *host]

    table = [row(r, 5e-3 if r in (2, 3) else 1e-3) for r in range(6)]
    report = build_report(table, [list(range(6)), [0, 1], [2, 3], [4, 5]], sizes, "cpu", "gloo", 0.1)
    assert [(f.name, f.metric) for f in report.findings] == [("group 2-3", "all_reduce_busbw_gbps")]


def test_nproc_per_node_zero_is_one_line_naming_the_flag(capsys) -> None:
    """torch.distributed.run used to stop on it with a bare AssertionError traceback."""
    from meshtron.cli import main

    assert main(["doctor", "--device", "cpu", "--nproc-per-node", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshtron doctor: error: --nproc-per-node must be a whole number >= 1 (the processes to start on each node, "
        "e.g. its GPU count), got 0"]
