"""Where training metrics go: the JSONL metrics file, the console, TensorBoard and W&B.

:class:`TrainingLogger` is what the trainer talks to. It fans each record out to the sinks
that the :class:`~meshtron.config.LogConfig` asks for, and only on the logging rank
(rank 0): on every other rank it does nothing. TensorBoard and Weights & Biases are imported
only when asked for, so meshtron imports and runs without them.

The metrics file is a contract (docs/metrics.md): one JSON object per line, plain numbers,
NaN/inf written as null with ``"nonfinite": true``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import sys
import time
from typing import Any, Callable, Optional, Protocol, TextIO

from meshtron.config import ConfigError, LogConfig
from meshtron.metrics_line import to_json_line

#: Required keys of a train record and their kinds ("int": an integer; "number": a number or null).
TRAIN_FIELDS: dict[str, str] = {
    "iteration": "int",
    "consumed_samples": "int",
    "loss": "number",
    "lr": "number",
    "grad_norm": "number",
    "step_time_s": "number",
    "tokens_per_sec_per_gpu": "number",
    "tflops_per_gpu": "number",
    "mfu": "number",
    "peak_mem_gib": "number",
}
#: Required keys of an eval record (validation split) and of a test record (test split, at the end of a run).
EVAL_FIELDS: dict[str, str] = {"iteration": "int", "loss": "number", "ppl": "number"}
RECORD_FIELDS: dict[str, dict[str, str]] = {"train": TRAIN_FIELDS, "eval": EVAL_FIELDS, "test": EVAL_FIELDS}

TB_INSTALL_HINT = "--tensorboard-dir needs the tensorboard package: pip install 'meshtron[tb]'"
WANDB_INSTALL_HINT = "--wandb-project needs the wandb package: pip install wandb"


# ---------------------------------------------------------------------------------------------
# Records: conversion to plain Python values and schema checks.
# ---------------------------------------------------------------------------------------------

def to_plain(value: Any) -> Any:
    """A tensor / numpy scalar / Python number as a plain ``int``, ``float`` or ``bool``.

    Strings and None pass through. Anything else is a programming error (TypeError), since
    the metrics file holds plain numbers only.
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if hasattr(value, "item") and callable(value.item):  # torch.Tensor, numpy scalars and 0-d arrays
        numel = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
        if numel != 1:
            raise TypeError(f"metric values must be scalars, got a tensor/array with {numel} elements")
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric values must be numbers, strings or None, got {type(value).__name__}")


def normalize_record(record: dict, kind: str) -> dict:
    """Check a train/eval record against the schema and convert its values to plain Python.

    The returned dict starts with ``"type"``, then the required keys in schema order, then any
    extra keys (e.g. ``"aux_loss"``) in their given order. NaN and inf are kept here (the
    console shows them); :class:`MetricsWriter` turns them into null.
    """
    fields = RECORD_FIELDS.get(kind)
    if fields is None:
        raise ValueError(f"unknown metrics record type {kind!r}; expected one of {sorted(RECORD_FIELDS)}")
    given_type = record.get("type", kind)
    if given_type != kind:
        raise ValueError(f"a {kind} record carries type {given_type!r}")
    missing = [k for k in fields if k not in record]
    if missing:
        raise ValueError(f"{kind} metrics record lacks {', '.join(missing)}")
    out: dict[str, Any] = {"type": kind}
    for key, field_kind in fields.items():
        value = to_plain(record[key])
        if field_kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{kind} record field {key!r} must be an integer, got {value!r}")
        if field_kind == "number" and value is not None and (isinstance(value, bool) or isinstance(value, str)):
            raise TypeError(f"{kind} record field {key!r} must be a number or None, got {value!r}")
        out[key] = value
    for key, value in record.items():
        if key not in out and key != "type":
            out[key] = to_plain(value)
    return out


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file, in order (for tools and tests)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# Sinks.
# ---------------------------------------------------------------------------------------------

class Sink(Protocol):
    """Something that receives normalised train/eval records."""

    def log_train(self, record: dict) -> None: ...

    def log_eval(self, record: dict) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends one JSON object per line to ``path``, each line handed to the OS as it is logged.

    The file is opened (and its folder created) at construction, so an unwritable
    ``--metrics-file`` fails before training starts. Lines are appended: a resumed run
    continues the same file.

    A line that cannot be written (a full disk, a quota, an I/O error) never ends the run: the
    first failure is reported once through ``warn`` (naming the file and the error), the lines
    logged meanwhile are dropped, and writing resumes as soon as the file takes data again
    (then ``warn`` says how many were lost). A line cut off by the failure is ended with a
    newline first, so that every later line is whole.
    """

    def __init__(self, path: str, warn: Optional[Callable[[str], None]] = None) -> None:
        self.path = path
        self._warn = warn if warn is not None else _warn_on_stderr
        self._lost = 0  # lines dropped since the current outage began
        self._mid_line = False  # the file ends inside a line that a failed write cut off
        try:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            # Unbuffered appends: nothing waits in a buffer to fail again at close, and a failed write is
            # known at once, to the byte.
            self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"--metrics-file {path}: cannot open for appending ({e.strerror or e})") from e

    def write(self, record: dict) -> None:
        """Write one record (already plain Python values; see :func:`normalize_record`)."""
        if self._fd is None:
            raise ValueError(f"metrics file {self.path} is closed")
        data = (b"\n" if self._mid_line else b"") + (to_json_line(record) + "\n").encode()
        try:
            self._append(data)
        except OSError as err:
            if self._lost == 0:
                self._warn(f"--metrics-file {self.path}: cannot write ({err.strerror or err}); metrics are not "
                           "recorded there until it takes data again; training goes on")
            self._lost += 1
            return
        if self._lost:
            self._warn(f"--metrics-file {self.path}: writing again; {self._lost} record(s) were lost")
            self._lost = 0

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            if n > 0:
                self._mid_line = view[n - 1] != ord("\n")
            view = view[n:]

    def log_train(self, record: dict) -> None:
        self.write(record)

    def log_eval(self, record: dict) -> None:
        self.write(record)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:  # nothing is buffered: every line written is in the file already
                pass


def _warn_on_stderr(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


class TensorBoardSink:
    """Scalars ``train/<key>`` and ``eval/<key>`` at step = iteration, through torch's SummaryWriter."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(TB_INSTALL_HINT) from e
        try:
            self._writer = SummaryWriter(log_dir=log_dir)
        except OSError as e:
            raise ConfigError(f"--tensorboard-dir {log_dir}: cannot write there ({e.strerror or e})") from e

    def _scalars(self, prefix: str, record: dict) -> None:
        step = record["iteration"]
        for key, value in record.items():
            if key in ("type", "iteration") or isinstance(value, (str, bool)) or value is None:
                continue
            self._writer.add_scalar(f"{prefix}/{key}", value, step)
        self._writer.flush()

    def log_train(self, record: dict) -> None:
        self._scalars("train", record)

    def log_eval(self, record: dict) -> None:
        self._scalars(record.get("type", "eval"), record)  # "eval" or "test"

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases: ``train/<key>`` and ``eval/<key>`` logged at step = iteration."""

    def __init__(self, project: str, run_name: Optional[str], run_config: Optional[dict],
                 save_dir: Optional[str] = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(WANDB_INSTALL_HINT) from e
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, config=run_config, dir=save_dir)

    def _log(self, prefix: str, record: dict) -> None:
        data = {f"{prefix}/{k}": v for k, v in record.items()
                if k not in ("type", "iteration") and not isinstance(v, str) and v is not None}
        self._run.log(data, step=record["iteration"])

    def log_train(self, record: dict) -> None:
        self._log("train", record)

    def log_eval(self, record: dict) -> None:
        self._log(record.get("type", "eval"), record)  # "eval" or "test"

    def close(self) -> None:
        self._run.finish()


def _close_quietly(sink: Sink) -> None:
    """Close a sink; an I/O error while closing (a full disk) is not worth more than the warning already given."""
    try:
        sink.close()
    except OSError:
        pass


def check_optional_sinks(log_cfg: LogConfig) -> None:
    """Raise ConfigError when TensorBoard or W&B is asked for but not installed.

    Cheap (no import), so it can run on every rank during validation, before any process
    starts waiting for rank 0.
    """
    if log_cfg.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TB_INSTALL_HINT)
    if log_cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_INSTALL_HINT)


# ---------------------------------------------------------------------------------------------
# Console lines.
# ---------------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf / -inf
    return format(value, spec) + suffix


def _positional(value: float, digits: int) -> str:
    """``value`` with at least ``digits`` significant digits, never in exponent notation (so that a
    field keeps one look through a run: '0.0000433', not '4.33e-05' after '0.000739')."""
    if value == 0 or abs(value) >= 10 ** (digits - 1):
        return f"{value:.0f}" if value else "0"
    decimals = min(digits - 1 - math.floor(math.log10(abs(value))), 15)
    return f"{value:.{decimals}f}"


def _fmt_extra(value: Any) -> str:
    """An optional field: integers as integers (consumed_tokens: 1228800, never 1.229e+06), floats positional."""
    if isinstance(value, float) and math.isfinite(value):
        return _positional(value, 4)
    return str(value)  # an int, nan/inf, a bool or a string


def format_train_line(record: dict, total_iters: int, device_label: str = "GPU") -> str:
    """The human line printed every log interval (Megatron's order of fields). ``device_label`` names what
    the per-device rates are per ("GPU", or "CPU" for a CPU run); the metrics file's keys keep ``_per_gpu``."""
    width = len(str(total_iters))
    mfu = record["mfu"]
    mem = _fmt(record["peak_mem_gib"], ".2f", " GiB")
    if record.get("peak_mem_reserved_gib") is not None:
        mem += f" (reserved {_fmt(record['peak_mem_reserved_gib'], '.2f')})"
    tflops = record["tflops_per_gpu"]
    step_ms = None if record["step_time_s"] is None else record["step_time_s"] * 1000.0
    parts = [
        f"iteration {record['iteration']:>{width}}/{total_iters}",
        f"consumed samples: {record['consumed_samples']}",
        f"lr: {_fmt(record['lr'], '.3E')}",
        f"loss: {_fmt(record['loss'], '.4f')}",
        f"grad norm: {_fmt(record['grad_norm'], '.3f')}",
        f"step: {_fmt(step_ms, '.1f', ' ms')}",
        f"tok/s/{device_label}: {_fmt(record['tokens_per_sec_per_gpu'], ',.0f')}",
        f"TFLOP/s/{device_label}: {_fmt_tflops(tflops)}",
        f"MFU: {_fmt(None if mfu is None else mfu * 100.0, '.1f', '%')}",
        f"mem: {mem}",
    ]
    for key, value in record.items():
        if key in TRAIN_FIELDS or key in ("type", "peak_mem_reserved_gib"):
            continue
        parts.append(f"{key}: {'n/a' if value is None else _fmt_extra(value)}")
    return " | ".join(parts)


def _fmt_tflops(tflops: Optional[float]) -> str:
    if tflops is None or not math.isfinite(tflops) or abs(tflops) >= 10:
        return _fmt(tflops, ".1f")
    return _positional(tflops, 3)


def format_eval_line(record: dict) -> str:
    """The human line printed after each evaluation (a ``test`` record: on the test split)."""
    split = "test" if record.get("type") == "test" else "validation"
    parts = [f"{split} at iteration {record['iteration']}", f"loss: {_fmt(record['loss'], '.4f')}",
             f"ppl: {_fmt(record['ppl'], '.3f')}"]
    for key, value in record.items():
        if key not in EVAL_FIELDS and key != "type":
            parts.append(f"{key}: {value}")
    return " | ".join(parts)


def _timestamp() -> str:
    return time.strftime("[%Y-%m-%d %H:%M:%S]")


# ---------------------------------------------------------------------------------------------
# The logger the trainer uses.
# ---------------------------------------------------------------------------------------------

class TrainingLogger:
    """Fans train/eval records and messages out to the configured sinks, on the logging rank only.

    - console: a line every log interval, on ``stream`` (stdout), plain when it is not a
      terminal; with a terminal (or ``--progress-bar``) a tqdm bar with ETA stays under the lines;
    - ``--metrics-file``: :class:`MetricsWriter`;
    - ``--tensorboard-dir``: TensorBoard scalars; ``--wandb-project``: Weights & Biases;
    - ``--quiet``: no bar, no interval lines, no info messages (warnings, errors and
      :meth:`summary` still print).

    Use as a context manager or call :meth:`close` at the end.
    """

    def __init__(self, log_cfg: LogConfig, is_logging_rank: bool, total_iters: int, *,
                 start_iter: int = 0, stream: Optional[TextIO] = None, err_stream: Optional[TextIO] = None,
                 run_config: Optional[dict] = None, device_label: str = "GPU") -> None:
        self.enabled = is_logging_rank
        self.total_iters = total_iters
        self.device_label = device_label  # the console's per-device unit: "GPU", or "CPU" on a CPU run
        self._stream = stream if stream is not None else sys.stdout
        self._err = err_stream if err_stream is not None else sys.stderr
        self._quiet = log_cfg.quiet
        self._sinks: list[Sink] = []
        self._bar = None
        if not self.enabled:
            return
        try:
            if log_cfg.metrics_file:
                self._sinks.append(MetricsWriter(log_cfg.metrics_file, warn=self.warning))
            if log_cfg.tensorboard_dir:
                self._sinks.append(TensorBoardSink(log_cfg.tensorboard_dir))
            if log_cfg.wandb_project:
                self._sinks.append(WandbSink(log_cfg.wandb_project, log_cfg.wandb_exp_name, run_config,
                                             log_cfg.wandb_save_dir))
        except BaseException:
            self.close()
            raise
        if self._want_bar(log_cfg.progress_bar):
            from tqdm import tqdm

            self._bar = tqdm(total=total_iters, initial=start_iter, file=self._stream, dynamic_ncols=True,
                             unit="it", desc="training",
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "[elapsed {elapsed}, ETA {remaining}, {rate_fmt}{postfix}]")

    def _want_bar(self, setting: Optional[bool]) -> bool:
        if self._quiet:
            return False
        if setting is not None:
            return setting
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    @property
    def has_progress_bar(self) -> bool:
        return self._bar is not None

    # -- output helpers ---------------------------------------------------------------------

    def _emit(self, msg: str, err: bool = False) -> None:
        target = self._err if err else self._stream
        if self._bar is not None:
            self._bar.write(msg, file=target)  # keeps the bar below the printed lines
        else:
            print(msg, file=target, flush=True)

    # -- records ----------------------------------------------------------------------------

    def resume_at(self, iteration: int) -> None:
        """Start the progress bar (and its rate and ETA) at ``iteration``, e.g. after loading a checkpoint."""
        if self._bar is not None:
            bar = self._bar
            bar.reset(total=self.total_iters)
            bar.initial = bar.n = bar.last_print_n = iteration
            bar.refresh()

    def advance(self, iteration: int) -> None:
        """Move the progress bar to ``iteration`` (cheap; call every iteration)."""
        if self._bar is not None and iteration > self._bar.n:
            self._bar.update(iteration - self._bar.n)

    def log_train(self, record: dict) -> None:
        """A train record (DESIGN section 6 keys, plus optional extras such as ``aux_loss``)."""
        if not self.enabled:
            return
        rec = normalize_record(record, "train")
        self._to_sinks("log_train", rec)
        if self._bar is not None:
            self.advance(rec["iteration"])
            self._bar.set_postfix_str(f"loss {_fmt(rec['loss'], '.4f')}", refresh=True)
        if not self._quiet:
            self._emit(f"{_timestamp()} {format_train_line(rec, self.total_iters, self.device_label)}")

    def log_eval(self, record: dict) -> None:
        """An eval record: ``iteration``, ``loss``, ``ppl``; with ``"type": "test"``, the test split's."""
        if not self.enabled:
            return
        rec = normalize_record(record, "test" if record.get("type") == "test" else "eval")
        self._to_sinks("log_eval", rec)
        if not self._quiet:
            self._emit(f"{_timestamp()} {format_eval_line(rec)}")

    def _to_sinks(self, method: str, record: dict) -> None:
        """Hand ``record`` to every sink. A sink whose storage fails (TensorBoard's folder on a full disk)
        is dropped with one warning: a log line must never end a run."""
        for sink in list(self._sinks):
            try:
                getattr(sink, method)(record)
            except OSError as err:
                self._sinks.remove(sink)
                self.warning(f"{type(sink).__name__}: cannot write ({err.strerror or err}); it records nothing "
                             "more in this run; training goes on")
                _close_quietly(sink)

    def log_event(self, record: dict) -> None:
        """An event line of the metrics file (``restart``, ``hang``, ``rerun``, ...: DESIGN section 6),
        written as given (it may nest lists and dicts of plain values)."""
        if not self.enabled:
            return
        for sink in self._sinks:
            if isinstance(sink, MetricsWriter):
                sink.write(record)

    # -- messages ---------------------------------------------------------------------------

    def info(self, msg: str) -> None:
        """A progress message (hidden by --quiet)."""
        if self.enabled and not self._quiet:
            self._emit(msg)

    def warning(self, msg: str) -> None:
        """A warning, on stderr (shown even with --quiet)."""
        if self.enabled:
            self._emit(f"WARNING: {msg}", err=True)

    def error(self, msg: str) -> None:
        """An error message, on stderr."""
        if self.enabled:
            self._emit(f"ERROR: {msg}", err=True)

    def summary(self, msg: str) -> None:
        """The final summary (shown even with --quiet)."""
        if self.enabled:
            self._emit(msg)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the bar and every sink (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            _close_quietly(sink)

    def __enter__(self) -> "TrainingLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
