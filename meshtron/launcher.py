"""The ``meshtron train --nproc-per-node N`` shortcut: start the workers through torch.distributed.run.

meshtron never implements its own launcher protocol: the shortcut re-runs
``python -m meshtron train <args>`` through ``torch.distributed.run`` (the code
behind ``torchrun``), so rendezvous, multi-node (``--nnodes``, ``--node-rank``,
``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``) and SLURM launches behave
exactly as with torchrun. Inside a torchrun worker (``WORLD_SIZE`` is set) the
launcher flags are ignored.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence

from meshtron.config import ConfigError, LauncherConfig, MeshtronConfig, flag_name

#: The launcher's settings (LauncherConfig), which configure how the workers start rather than the run itself.
LAUNCHER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LauncherConfig))


def launcher_option_strings(field_name: str) -> tuple[str, ...]:
    """Every spelling of a launcher flag: ``--nproc-per-node``, its aliases and torchrun's ``--nproc_per_node``."""
    meta = {f.name: f.metadata for f in dataclasses.fields(LauncherConfig)}[field_name]
    spellings = [flag_name(field_name), *meta.get("aliases", ()), "--" + field_name]
    return tuple(dict.fromkeys(spellings))  # ordered, without duplicates


def running_under_torchrun() -> bool:
    """True inside a worker started by torchrun / torch.distributed.run (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    """The world size set by the launcher, or 1 in a plain process."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable WORLD_SIZE={value!r} is not an integer") from None


def should_launch(p: LauncherConfig) -> bool:
    """True when this process is the ``--nproc-per-node`` shortcut and must start the workers itself."""
    return p.nproc_per_node is not None and not running_under_torchrun()


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4) (elastic range). Raises ConfigError naming --nnodes."""
    text = str(nnodes).strip()
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise ConfigError(f"--nnodes {text!r}: expected a number of nodes N or a range MIN:MAX") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ConfigError(f"--nnodes {text!r}: expected N >= 1 or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def planned_world_size(p: LauncherConfig) -> Optional[int]:
    """World size the shortcut will start (nproc x nnodes), or None for an elastic node range."""
    low, high = parse_nnodes(p.nnodes)
    if low != high or p.nproc_per_node is None:
        return None
    return p.nproc_per_node * low


def check_launcher(p: LauncherConfig) -> None:
    """Check the launcher flags (called by validation). Raises ConfigError naming the flag."""
    low, high = parse_nnodes(p.nnodes)
    if p.nproc_per_node is not None and p.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be a whole number >= 1 (the processes to start on each node, "
                          f"e.g. its GPU count), got {p.nproc_per_node}")
    if p.node_rank < 0 or (low == high and p.node_rank >= high):
        raise ConfigError(f"--node-rank {p.node_rank} must be in [0, {high - 1}] with --nnodes {p.nnodes}")
    if not 0 < p.master_port < 65536:
        raise ConfigError(f"--master-port must be in 1..65535, got {p.master_port}")
    if not p.rdzv_backend:
        raise ConfigError("--rdzv-backend must not be empty (static or c10d)")


def check_local_gpus(cfg: MeshtronConfig) -> None:
    """Check that this node has a GPU for each process the shortcut will start on it (``cfg`` already validated).

    The CLI validates the configuration for the planned world size first, in the launching process, so that a bad
    configuration fails once, before any worker starts; the launcher itself never calls validation.
    """
    nproc = cfg.launcher.nproc_per_node
    if cfg.train.device == "cuda":
        import torch

        found = torch.cuda.device_count()
        if nproc > found:
            raise ConfigError(f"--nproc-per-node {nproc} needs {nproc} GPUs on this node, found {found}")


def strip_launcher_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launcher flags and their values (``--nnodes 2`` and ``--nnodes=2`` forms)."""
    spellings = {s for f in LAUNCHER_FIELDS for s in launcher_option_strings(f)}
    out: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in spellings:
            skip_value = "=" not in arg  # every launcher flag takes exactly one value
            continue
        out.append(arg)
    return out


def torchrun_args(p: LauncherConfig, entry: Sequence[str]) -> list[str]:
    """torch.distributed.run's argument list for the launcher flags, followed by ``entry``.

    ``entry`` is what each worker runs, e.g. ``["-m", "meshtron", "train", ...]``.
    """
    args = [
        "--nproc-per-node", str(p.nproc_per_node),
        "--nnodes", str(p.nnodes),
        "--node-rank", str(p.node_rank),
        "--master-addr", p.master_addr,
        "--master-port", str(p.master_port),
        "--rdzv-backend", p.rdzv_backend,
        "--max-restarts", str(p.max_restarts),  # each restart resumes from the latest checkpoint
    ]
    if p.rdzv_endpoint:
        args += ["--rdzv-endpoint", p.rdzv_endpoint]
    return args + list(entry)


#: Set by the shortcut for its workers: the folder where each worker leaves its exit code (see
#: :func:`report_exit_status`). torch.distributed.run forwards a signal the launcher receives to the
#: workers and then raises, without their exit codes; these files say whether they ended cleanly.
EXIT_STATUS_DIR_ENV = "MESHTRON_EXIT_STATUS_DIR"


def launched_by_meshtron() -> bool:
    """True in a worker started by the ``--nproc-per-node`` shortcut (which reports for all ranks)."""
    return bool(os.environ.get(EXIT_STATUS_DIR_ENV)) and running_under_torchrun()


def report_exit_status(code: int) -> None:
    """Leave this worker's exit code where the shortcut that started it will read it (if it did): once when
    the code is known, before the teardown (whose end a peer may not wait for), and again at the exit."""
    folder = os.environ.get(EXIT_STATUS_DIR_ENV)
    if not folder or not running_under_torchrun():
        return
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(str(int(code)))
        os.replace(path + ".tmp", path)  # the reader sees a whole number or nothing
    except OSError:
        pass  # the launcher then counts this worker as not ended cleanly, which is the safe side


def _read_exit_statuses(folder: str) -> list[int]:
    codes = []
    for name in os.listdir(folder):
        if not name.endswith(".tmp"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    codes.append(int(f.read().strip()))
            except (OSError, ValueError):
                codes.append(1)
    return codes


def _exit_code_of(exitcode: object) -> int:
    """A worker's exit code as a shell would give it: 128 + n for a death by signal n."""
    if not isinstance(exitcode, int):
        return 1
    return 128 - exitcode if exitcode < 0 else exitcode


def _failure_exit_code(err, statuses: Sequence[int] = ()) -> int:
    """The launcher's exit code for failed workers: 2 when a worker found bad input (the other ranks'
    failures are then its consequence: a peer left, or the launcher stopped them), else the first
    failure's code. ``statuses`` are the codes the workers reported (:func:`report_exit_status`): a worker
    reports its code before its teardown, so a bad-input worker that the launcher stopped during the teardown,
    after a peer had already failed on its departure, is still counted as bad input."""
    codes = [_exit_code_of(f.exitcode) for f in err.failures.values()]
    if 2 in codes or 2 in statuses:
        return 2
    _, first = err.get_first_failure()
    code = _exit_code_of(first.exitcode)
    return code if code > 0 else 1


def _signal_exit_code(signum: int, statuses: list[int], expected: Optional[int]) -> int:
    """The launcher's exit code after it received signal ``signum`` and forwarded it to its workers:
    0 when each of them ended cleanly (``--exit-signal-handler`` saved a checkpoint), else 128 + n."""
    import signal

    name = signal.Signals(signum).name
    clean = bool(statuses) and all(code == 0 for code in statuses) and (expected is None or len(statuses) == expected)
    if clean:
        print(f"meshtron train: {name} received; every worker saved and exited cleanly", file=sys.stderr)
        return 0
    if signum == signal.SIGINT:
        print("meshtron train: interrupted", file=sys.stderr)
    else:
        print(f"meshtron train: stopped by {name} (not every worker saved and exited cleanly)", file=sys.stderr)
    return 128 + signum


def run_torchrun(args: Sequence[str], nproc_per_node: Optional[int] = None) -> int:
    """Run torch.distributed.run in this process; returns the exit code (DESIGN.md section 11).

    0 when every worker finished (or, after a signal, each saved and exited cleanly); 2 when a worker
    found bad input; 128 + n when the launcher was stopped by signal n; else the first failed
    worker's code (1 for a failure while running). Errors are one line, without a traceback.
    """
    import shutil
    import tempfile

    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    status_dir = tempfile.mkdtemp(prefix="meshtron-exit-")
    previous = os.environ.get(EXIT_STATUS_DIR_ENV)
    os.environ[EXIT_STATUS_DIR_ENV] = status_dir  # the workers inherit the launcher's environment
    try:
        torch_run.run(torch_run.parse_args(list(args)))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = _failure_exit_code(err, _read_exit_statuses(status_dir))
        print(f"meshtron train: error: {len(err.failures)} worker process(es) failed "
              f"(first: rank {rank}, exit code {_exit_code_of(failure.exitcode)}); their output is above",
              file=sys.stderr)
        return code
    except SignalException as err:
        return _signal_exit_code(int(err.sigval), _read_exit_statuses(status_dir), nproc_per_node)
    finally:
        if previous is None:
            os.environ.pop(EXIT_STATUS_DIR_ENV, None)
        else:
            os.environ[EXIT_STATUS_DIR_ENV] = previous
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0


def launch(p: LauncherConfig, argv: Sequence[str]) -> int:
    """Start ``--nproc-per-node`` workers running ``python -m meshtron train <argv minus launcher flags>``."""
    entry = ["-m", "meshtron", "train", *strip_launcher_flags(argv)]
    return run_torchrun(torchrun_args(p, entry), p.nproc_per_node)
