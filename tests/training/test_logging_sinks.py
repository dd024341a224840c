"""Metrics file schema, console/progress-bar modes, TensorBoard and W&B fan-out."""

import errno
import io
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from meshtron.config import ConfigError, LogConfig
from meshtron.training.logging_sinks import (
    EVAL_FIELDS,
    TRAIN_FIELDS,
    MetricsWriter,
    TrainingLogger,
    check_optional_sinks,
    normalize_record,
    read_metrics,
    to_json_line,
)


def train_record(iteration=10, **overrides) -> dict:
    rec = {
        "iteration": iteration,
        "consumed_samples": iteration * 8,
        "loss": torch.tensor(2.5),
        "lr": np.float32(3e-4),
        "grad_norm": torch.tensor(1.25, dtype=torch.float64),
        "step_time_s": 0.125,
        "tokens_per_sec_per_gpu": 8192.0,
        "tflops_per_gpu": 123.4,
        "mfu": 0.45,
        "peak_mem_gib": 12.5,
    }
    rec.update(overrides)
    return rec


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class NotTTY(io.StringIO):
    def isatty(self) -> bool:
        return False


def make_logger(tmp_path=None, stream=None, err=None, rank0=True, total=100, **log_fields):
    cfg = LogConfig(**log_fields)
    if tmp_path is not None and "metrics_file" not in log_fields:
        cfg.metrics_file = str(tmp_path / "metrics.jsonl")
    return TrainingLogger(cfg, rank0, total, stream=stream or NotTTY(), err_stream=err or NotTTY())


# ------------------------------------------------------------------------------- metrics file

def test_train_record_schema_strict(tmp_path):
    path = tmp_path / "m.jsonl"
    with make_logger(metrics_file=str(path)) as log:
        log.log_train(train_record())
        log.log_eval({"iteration": 10, "loss": np.float64(2.0), "ppl": math.exp(2.0)})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    train, ev = (json.loads(line) for line in lines)
    assert list(train) == ["type"] + list(TRAIN_FIELDS)
    assert train["type"] == "train"
    for key, kind in TRAIN_FIELDS.items():
        expected_type = int if kind == "int" else float
        assert type(train[key]) is expected_type, key
    assert train["loss"] == 2.5 and train["lr"] == pytest.approx(3e-4) and train["mfu"] == 0.45
    assert list(ev) == ["type"] + list(EVAL_FIELDS)
    assert ev == {"type": "eval", "iteration": 10, "loss": 2.0, "ppl": pytest.approx(math.exp(2.0))}
    assert "nonfinite" not in train and "nonfinite" not in ev


def test_nonfinite_values_become_null_with_flag(tmp_path):
    path = tmp_path / "m.jsonl"
    with make_logger(metrics_file=str(path)) as log:
        log.log_train(train_record(loss=torch.tensor(float("nan")), grad_norm=float("inf")))
        log.log_eval({"iteration": 10, "loss": 900.0, "ppl": float("inf")})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    train, ev = read_metrics(str(path))
    assert train["loss"] is None and train["grad_norm"] is None and train["nonfinite"] is True
    assert train["lr"] == pytest.approx(3e-4)
    assert ev["ppl"] is None and ev["loss"] == 900.0 and ev["nonfinite"] is True


def test_null_mfu_is_not_nonfinite_and_extra_keys_are_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    with make_logger(metrics_file=str(path)) as log:
        log.log_train(train_record(mfu=None, aux_loss=torch.tensor(0.01), peak_mem_reserved_gib=14.0))
    (rec,) = read_metrics(str(path))
    assert rec["mfu"] is None and "nonfinite" not in rec
    assert rec["aux_loss"] == pytest.approx(0.01) and type(rec["aux_loss"]) is float
    assert list(rec)[-2:] == ["aux_loss", "peak_mem_reserved_gib"]


@pytest.mark.parametrize("bad,exc,match", [
    ({"loss": None, "drop": "lr"}, ValueError, "lacks lr"),
    ({"iteration": 10.0}, TypeError, "iteration"),
    ({"consumed_samples": True}, TypeError, "consumed_samples"),
    ({"loss": "2.5"}, TypeError, "loss"),
    ({"loss": torch.ones(2)}, TypeError, "scalars"),
    ({"aux_loss": [1.0]}, TypeError, "numbers"),
    ({"type": "eval"}, ValueError, "carries type"),
])
def test_schema_violations_raise(bad, exc, match):
    bad = dict(bad)
    rec = train_record()
    drop = bad.pop("drop", None)
    rec.update(bad)
    if drop:
        del rec[drop]
    with pytest.raises(exc, match=match):
        normalize_record(rec, "train")


def test_writer_appends_and_flushes_each_line(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"  # the folder is created
    w = MetricsWriter(str(path))
    w.write(normalize_record(train_record(1), "train"))
    assert len(path.read_text().splitlines()) == 1  # visible before close
    w.close()
    w2 = MetricsWriter(str(path))  # a resumed run appends
    w2.write(normalize_record(train_record(2), "train"))
    w2.close()
    assert [r["iteration"] for r in read_metrics(str(path))] == [1, 2]


def test_unwritable_metrics_file_names_the_flag(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--metrics-file"):
        MetricsWriter(str(blocker / "metrics.jsonl"))


class FullDisk:
    """``os.write`` for the files opened while it is installed fails with ENOSPC while ``full`` is set; the
    first failing call writes ``partial`` bytes first (a write cut off by the disk filling up)."""

    def __init__(self, monkeypatch, partial: int = 0) -> None:
        self.full, self.partial, self.fds = False, partial, set()
        self._open, self._write = os.open, os.write
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "write", self.write)

    def open(self, path, flags, *args, **kwargs):
        fd = self._open(path, flags, *args, **kwargs)
        if str(path).endswith(".jsonl"):
            self.fds.add(fd)
        return fd

    def write(self, fd, data):
        if fd in self.fds and self.full:
            if self.partial:
                n, self.partial = self._write(fd, bytes(data)[:self.partial]), 0
                return n
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._write(fd, data)


def test_full_disk_is_warned_once_and_writing_resumes_with_whole_lines(tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch, partial=7)
    err = NotTTY()
    log = make_logger(tmp_path, err=err)
    log.log_train(train_record(1))
    disk.full = True
    for it in (2, 3, 4):
        log.log_train(train_record(it))  # 2 is cut off after 7 bytes, 3 and 4 are refused
    log.log_eval({"iteration": 4, "loss": 1.0, "ppl": math.e})
    disk.full = False  # someone made room
    log.log_train(train_record(5))
    log.close()  # nothing buffered fails again here
    path = tmp_path / "metrics.jsonl"
    warnings = err.getvalue().splitlines()
    assert warnings == [f"WARNING: --metrics-file {path}: cannot write (No space left on device); metrics are not "
                        "recorded there until it takes data again; training goes on",
                        f"WARNING: --metrics-file {path}: writing again; 4 record(s) were lost"], warnings
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == to_json_line(normalize_record(train_record(2), "train"))[:7]
    assert [json.loads(lines[i])["iteration"] for i in (0, 2)] == [1, 5]  # the cut line is ended, the next whole


def test_a_sink_whose_disk_fails_is_dropped_with_one_warning(tmp_path):
    class FailingSink:
        closed = False

        def log_train(self, record):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        log_eval = log_train

        def close(self):
            self.closed = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # flushing what it buffered fails again

    err = NotTTY()
    log = make_logger(tmp_path, err=err)
    sink = FailingSink()
    log._sinks.append(sink)
    log.log_train(train_record(1))
    log.log_eval({"iteration": 1, "loss": 1.0, "ppl": math.e})
    log.close()
    assert err.getvalue() == ("WARNING: FailingSink: cannot write (No space left on device); it records nothing "
                              "more in this run; training goes on\n")
    assert sink.closed and len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 2  # the other sinks went on


def test_full_disk_under_metrics_file_never_ends_the_run(tmp_path, monkeypatch, capsys):
    from meshtron.checkpoint.layout import list_iterations, read_latest
    from meshtron.cli import main as meshtron_main

    disk = FullDisk(monkeypatch, partial=5)
    disk.full = True  # from the first line on
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    assert meshtron_main(["train", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
                          "--global-batch-size", "1", "--device", "cpu", "--log-interval", "1",
                          "--no-generate-sample", "--eval-interval", "2", "--eval-iters", "1", "--train-iters", "4",
                          "--save", str(save), "--save-interval", "2", "--metrics-file", str(metrics)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "error:" not in captured.err, captured.err
    warnings = [line for line in captured.err.splitlines() if "--metrics-file" in line]
    assert len(warnings) == 1 and str(metrics) in warnings[0] and "No space left on device" in warnings[0], warnings
    assert "iteration 4/4" in captured.out  # training went on
    assert list_iterations(save) == [2, 4] and read_latest(save) == 4  # and so did the checkpoints


# ------------------------------------------------------------------------------- ranks and console

def test_non_logging_rank_writes_nothing(tmp_path):
    out, err = NotTTY(), NotTTY()
    log = make_logger(tmp_path, stream=out, err=err, rank0=False, progress_bar=True)
    log.log_train(train_record())
    log.log_eval({"iteration": 1, "loss": 1.0, "ppl": math.e})
    log.info("hello")
    log.warning("careful")
    log.close()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert out.getvalue() == "" and err.getvalue() == ""


def test_console_plain_mode_when_not_a_terminal():
    out, err = NotTTY(), NotTTY()
    with make_logger(stream=out, err=err, total=100) as log:
        assert not log.has_progress_bar
        log.log_train(train_record(aux_loss=0.0123))
        log.log_eval({"iteration": 10, "loss": 2.0, "ppl": math.exp(2.0)})
        log.info("saved checkpoint")
        log.warning("skipped a step")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    train = lines[0]
    for piece in ("iteration  10/100", "consumed samples: 80", "lr: 3.000E-04", "loss: 2.5000",
                  "grad norm: 1.250", "step: 125.0 ms", "tok/s/GPU: 8,192", "TFLOP/s/GPU: 123.4",
                  "MFU: 45.0%", "mem: 12.50 GiB", "aux_loss: 0.0123"):
        assert piece in train, piece
    assert "validation at iteration 10" in lines[1] and "ppl: 7.389" in lines[1]
    assert lines[2] == "saved checkpoint"
    assert err.getvalue() == "WARNING: skipped a step\n"


def test_console_shows_nan_missing_mfu_and_small_tflops():
    out = NotTTY()
    with make_logger(stream=out) as log:
        log.log_train(train_record(loss=float("nan"), mfu=None, tflops_per_gpu=0.003854))
    assert "loss: nan" in out.getvalue() and "MFU: n/a" in out.getvalue()
    assert "TFLOP/s/GPU: 0.00385" in out.getvalue()


def test_progress_bar_on_a_terminal():
    out = TTY()
    with make_logger(stream=out, total=100) as log:
        assert log.has_progress_bar
        for it in range(1, 11):
            log.advance(it)
        log.log_train(train_record(10))
    text = out.getvalue()
    assert "\r" in text  # redrawn in place
    assert "10/100" in text and "ETA" in text
    assert "iteration  10/100 | consumed samples: 80" in text  # the interval line is printed above the bar


def test_progress_bar_resumes_at_a_checkpoint_iteration():
    out = TTY()
    with make_logger(stream=out, total=100) as log:
        log.resume_at(40)
        assert out.getvalue().rstrip().split("\r")[-1].startswith("training  40%")
        log.advance(41)
        log.advance(30)  # never moves backwards
        bar = log._bar
        assert (bar.initial, bar.n) == (40, 41)  # the rate and ETA count from the resumed iteration
    assert "30/100" not in out.getvalue()


@pytest.mark.parametrize("setting,stream_cls,expected", [
    (None, TTY, True), (None, NotTTY, False), (False, TTY, False), (True, NotTTY, True)])
def test_progress_bar_setting(setting, stream_cls, expected):
    with make_logger(stream=stream_cls(), progress_bar=setting) as log:
        assert log.has_progress_bar is expected


def test_quiet_hides_lines_but_not_warnings_or_summary(tmp_path):
    out, err = TTY(), NotTTY()
    with make_logger(tmp_path, stream=out, err=err, quiet=True) as log:
        assert not log.has_progress_bar
        log.log_train(train_record())
        log.info("hidden")
        log.warning("shown")
        log.summary("done: 100 iterations")
    assert out.getvalue() == "done: 100 iterations\n"
    assert "WARNING: shown" in err.getvalue()
    assert len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 1  # the file is still written


# ------------------------------------------------------------------------------- TensorBoard / W&B

def test_tensorboard_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"--tensorboard-dir .*pip install 'meshtron\[tb\]'"):
        make_logger(tensorboard_dir=str(tmp_path / "tb"))


def test_tensorboard_scalars_through_summary_writer(monkeypatch, tmp_path):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    with make_logger(tensorboard_dir=str(tmp_path / "tb")) as log:
        log.log_train(train_record(10, mfu=None))
        log.log_eval({"iteration": 10, "loss": 2.0, "ppl": 7.0})
    assert calls[0] == ("init", str(tmp_path / "tb"))
    assert ("train/loss", 2.5, 10) in calls and ("eval/ppl", 7.0, 10) in calls
    assert not any(c[0] in ("train/mfu", "train/iteration", "train/type") for c in calls)
    assert calls[-1] == ("close",)


def test_tensorboard_real_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    with make_logger(tensorboard_dir=str(tmp_path / "tb")) as log:
        log.log_train(train_record())
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_wandb_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="--wandb-project .*pip install wandb"):
        make_logger(wandb_project="proj")


def test_wandb_logging(monkeypatch):
    logged, finished, init_args = [], [], {}

    class Run:
        def log(self, data, step):
            logged.append((data, step))

        def finish(self):
            finished.append(True)

    def init(**kwargs):
        init_args.update(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = LogConfig(wandb_project="proj", wandb_exp_name="run1", wandb_save_dir="/tmp/wb")
    with TrainingLogger(cfg, True, 100, stream=NotTTY(), run_config={"hidden_size": 64}) as log:
        log.log_train(train_record(20))
        log.log_eval({"iteration": 20, "loss": 2.0, "ppl": 7.0})
    assert init_args == {"project": "proj", "name": "run1", "config": {"hidden_size": 64}, "dir": "/tmp/wb"}
    (train, step), (ev, step2) = logged
    assert step == step2 == 20
    assert train["train/loss"] == 2.5 and "train/iteration" not in train
    assert ev == {"eval/loss": 2.0, "eval/ppl": 7.0}
    assert finished == [True]


def test_check_optional_sinks(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    check_optional_sinks(LogConfig())  # nothing asked, nothing needed
    with pytest.raises(ConfigError, match="--tensorboard-dir"):
        check_optional_sinks(LogConfig(tensorboard_dir="tb"))
    with pytest.raises(ConfigError, match="--wandb-project"):
        check_optional_sinks(LogConfig(wandb_project="p"))


def test_optional_packages_not_imported_unless_asked(tmp_path):
    code = (
        "import sys, io\n"
        "from meshtron.config import LogConfig\n"
        "from meshtron.training.logging_sinks import TrainingLogger\n"
        f"log = TrainingLogger(LogConfig(metrics_file={str(tmp_path / 'm.jsonl')!r}), True, 10, stream=io.StringIO())\n"
        "log.info('x'); log.close()\n"
        "bad = [m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
