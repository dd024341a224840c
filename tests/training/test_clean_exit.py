"""Every exit path of `meshtron train` ends cleanly with the exit code of DESIGN.md section 11.

0 done (also after --exit-signal-handler saved on SIGTERM), 1 failure while running, 2 bad input
(also found on one rank after the process groups exist), 128+n on signal n (130 for Ctrl-C); no
"terminate called" abort at exit and no traceback for what is not a bug.

The multi-process cases run the real CLI in subprocesses; the exit-code rules also have fast
in-process tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from meshtron import launcher
from meshtron.config import ConfigError
from meshtron.training.lifecycle import RunLifecycle
from meshtron.training.trainer import TrainingError

TINY = ["--device", "cpu", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1", "--no-generate-sample",
        "--log-interval", "1", "--eval-iters", "1"]
#: The two-process layouts of the repeated-exit test (each also ends with collectives right before exit).
LAYOUTS = {
    "dp": ["--global-batch-size", "2"],
    "dp-distopt": ["--global-batch-size", "2", "--use-distributed-optimizer"],
    "tp": ["--global-batch-size", "1", "--tensor-model-parallel-size", "2"],
    "pp": ["--global-batch-size", "2", "--pipeline-model-parallel-size", "2"],
}
RUNS = 4  # every layout once
SUBPROCESS_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           launcher.EXIT_STATUS_DIR_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _meshtron(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshtron", "train", *args]


# ------------------------------------------------------------------------------------------------
# Repeated two-process runs: every exit code 0, no abort at interpreter exit.
# ------------------------------------------------------------------------------------------------

def _two_worker_run(args: list[str]) -> list[tuple[int, str]]:
    """Two `python -m meshtron train` workers joined by env:// rendezvous (what torchrun gives each
    worker); their (exit code, stderr)."""
    port = str(_free_port())
    procs = [subprocess.Popen(_meshtron(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r),
                                       WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"))
             for r in range(2)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err))
    return out


def test_two_process_runs_exit_cleanly_every_time():
    names = [list(LAYOUTS)[i % len(LAYOUTS)] for i in range(RUNS)]
    runs = [TINY + LAYOUTS[name] + ["--train-iters", "2", "--eval-interval", "2"] for name in names]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two runs at a time keep both cores busy
        results = list(pool.map(_two_worker_run, runs))
    bad = [(name, rank, code, err[-600:]) for name, ranks in zip(names, results)
           for rank, (code, err) in enumerate(ranks)
           if code != 0 or "terminate called" in err or "Traceback" in err]
    assert not bad, f"{len(bad)} of {2 * RUNS} processes did not exit cleanly: {bad}"


# ------------------------------------------------------------------------------------------------
# Signals to the --nproc-per-node launcher.
# ------------------------------------------------------------------------------------------------

def _wait_for_training(proc: subprocess.Popen, metrics: Path, deadline_s: float = 90.0) -> None:
    """Return once the metrics file has a train record (the workers are iterating)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"meshtron train ended early with exit code {proc.returncode}: {proc.communicate()[1]}")
        if metrics.exists() and any(json.loads(line).get("type") == "train"
                                    for line in metrics.read_text().splitlines() if line.strip()):
            return
        time.sleep(0.2)  # polling the file the run writes, not a synchronisation by time
    proc.kill()
    pytest.fail("no training progress in the metrics file within the deadline")


def _start_launcher(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(
        _meshtron("--nproc-per-node", "2", "--master-port", str(_free_port()), *TINY, "--global-batch-size", "2",
                  "--train-iters", "100000", "--eval-interval", "0", "--metrics-file", str(metrics), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    return proc, metrics


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def _assert_complete_checkpoint(save: Path) -> int:
    """The newest checkpoint in ``save`` is complete and loads; its iteration."""
    from meshtron.checkpoint import load_for_inference, resolve_checkpoint

    ckpt = resolve_checkpoint(save)
    assert ckpt is not None, f"no checkpoint in {save}"
    meta = json.loads((ckpt / "meshtron_checkpoint.json").read_text())
    assert int((save / "latest").read_text().strip()) == meta["iteration"] >= 1
    load_for_inference(save, "cpu")  # every tensor present (and verified where checksums are kept)
    return meta["iteration"]


def test_sigterm_to_launcher_saves_on_every_rank_and_exits_zero(tmp_path: Path):
    save = tmp_path / "ckpt"
    proc, metrics = _start_launcher(tmp_path, "--exit-signal-handler", "--save", str(save))
    _wait_for_training(proc, metrics)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 0, err
    assert "Traceback" not in err, err
    assert "every worker saved and exited cleanly" in err
    _assert_complete_checkpoint(save)


def test_sigterm_single_process_saves_and_exits_zero(tmp_path: Path):
    """The same as one process: the signal handler's clean save-and-exit is exit code 0."""
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(_meshtron(*TINY, "--global-batch-size", "1", "--train-iters", "100000",
                                      "--eval-interval", "0", "--metrics-file", str(metrics),
                                      "--exit-signal-handler", "--save", str(save)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for_training(proc, metrics)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 0 and "Traceback" not in err, err
    _assert_complete_checkpoint(save)


def test_sigint_to_launcher_ends_every_rank_with_130_and_one_line(tmp_path: Path):
    proc, metrics = _start_launcher(tmp_path)
    _wait_for_training(proc, metrics)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code == 130, err
    assert "Traceback" not in err and "terminate called" not in err, err
    meshtron_lines = [line for line in err.splitlines() if line.startswith("meshtron")]
    assert meshtron_lines == ["meshtron train: interrupted"], err


# ------------------------------------------------------------------------------------------------
# Bad input found on one rank after the process groups exist.
# ------------------------------------------------------------------------------------------------

#: Loaded by every worker through PYTHONPATH: rank 1 finds "bad input" once its process groups exist.
_ONE_RANK_BAD_INPUT = '''
import os
if os.environ.get("RANK") == "1":
    import meshtron.data as data
    from meshtron.config import ConfigError

    def build_data(*args, **kwargs):
        import torch.distributed as dist
        assert dist.is_initialized()
        raise ConfigError("--data-path: this node cannot read the dataset (expected a readable .bin/.idx prefix)")

    data.build_data = build_data
'''


def test_bad_input_on_one_rank_after_groups_exist_exits_2(tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text(_ONE_RANK_BAD_INPUT)
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(_meshtron("--nproc-per-node", "2", "--master-port", str(_free_port()), *TINY,
                                    "--global-batch-size", "2", "--train-iters", "2"),
                          capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert "meshtron train: error: [rank 1] --data-path: this node cannot read the dataset" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------------
# The exit-code rules, in process.
# ------------------------------------------------------------------------------------------------

def _lifecycle(world_size: int = 1, **kwargs) -> RunLifecycle:
    return RunLifecycle("meshtron train", rank=0, world_size=world_size, timeout_s=10.0,
                        bad_input=(ConfigError,), failures=(TrainingError,), **kwargs)


def _raise(err: BaseException):
    def body():
        raise err
    return body


@pytest.mark.parametrize("err,code,line", [
    (ConfigError("--data-path x: no such file"), 2, "meshtron train: error: --data-path x: no such file"),
    (TrainingError("3 consecutive non-finite steps"), 1, "meshtron train: error: 3 consecutive non-finite steps"),
    (dist.DistBackendError("Connection closed by peer\ndetails"), 1,
     "meshtron train: error: lost contact with another rank: Connection closed by peer"),
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4596"), 1,
     "meshtron train: error: lost contact with another rank: Connection closed by peer [127.0.0.1]:4596"),
    (KeyboardInterrupt(), 130, "meshtron train: interrupted"),
])
def test_lifecycle_exit_codes_and_one_line(err, code, line, capsys):
    assert _lifecycle().run(_raise(err)) == code
    assert capsys.readouterr().err.splitlines() == [line]


def test_lifecycle_keeps_the_traceback_of_a_bug(capsys):
    assert _lifecycle(world_size=2).run(_raise(ZeroDivisionError("oops"))) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: oops" in err
    assert err.splitlines()[-1] == "meshtron train: error: [rank 0] unexpected ZeroDivisionError (traceback above)"


def test_lifecycle_returns_the_body_result_and_silent_interrupt_under_the_launcher(capsys):
    assert _lifecycle().run(lambda: None) == 0
    assert _lifecycle().run(lambda: 3) == 3
    assert _lifecycle(quiet_interrupt=True).run(_raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == ""


class _Failure:
    def __init__(self, exitcode: int):
        self.exitcode = exitcode


class _ChildFailed:
    """What torch.distributed.run raises when workers fail: failures by rank, the first one."""

    def __init__(self, codes: dict[int, int], first: int):
        self.failures = {r: _Failure(c) for r, c in codes.items()}
        self._first = first

    def get_first_failure(self):
        return self._first, self.failures[self._first]


@pytest.mark.parametrize("codes,first,statuses,expected", [
    ({1: 2, 0: -15}, 0, [], 2),  # rank 1 found bad input; the launcher then stopped rank 0 with SIGTERM
    ({1: 2, 0: 1}, 0, [], 2),    # ... or rank 0 lost its peer
    # rank 1 reported bad input, rank 0 lost it as rank 1 tore down, and the launcher stopped rank 1 then
    ({0: 1, 1: -15}, 0, [2], 2),
    ({0: 1, 1: -15}, 0, [], 1),
    ({0: 1, 1: -15}, 0, [1], 1),
    ({0: -9}, 0, [], 137),       # killed (e.g. out of memory): 128 + 9
    ({0: -6, 1: -15}, 0, [], 134),
])
def test_launcher_exit_code_of_failed_workers(codes: dict, first: int, statuses: list, expected: int):
    assert launcher._failure_exit_code(_ChildFailed(codes, first), statuses) == expected


def test_the_exit_code_is_reported_before_the_teardown(monkeypatch):
    import meshtron.training.lifecycle as lifecycle

    order = []
    monkeypatch.setattr(lifecycle, "shutdown_distributed", lambda timeout_s: order.append("teardown") or True)
    code = _lifecycle(world_size=2, on_exit_code=lambda c: order.append(c)).run(_raise(ConfigError("--x: bad")))
    assert code == 2 and order == [2, "teardown"]


@pytest.mark.parametrize("statuses,expected_workers,code", [
    ([0, 0], 2, 0),           # every worker saved and exited cleanly
    ([0], 2, 143),            # one never reported: it was killed
    ([0, 1], 2, 143),
    ([], 2, 143),
])
def test_launcher_exit_code_after_sigterm(statuses: list, expected_workers: int, code: int, capsys):
    assert launcher._signal_exit_code(signal.SIGTERM, statuses, expected_workers) == code
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_worker_exit_status_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(launcher.EXIT_STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, code in ((0, 0), (1, 2)):
        monkeypatch.setenv("RANK", str(rank))
        launcher.report_exit_status(code)
    assert sorted(launcher._read_exit_statuses(str(tmp_path))) == [0, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
