"""The quick-start job (`meshtron train` without a model, data or --config): a flag given changes only what it
names and the defaults that must follow it, and the notice listing the settings in use comes before any error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron import cli, launcher, quickstart, validation
from meshtron.cli import main, parse_train_args
from meshtron.presets import QUICKSTART
from tests.resilience.cli_runs import free_port

NOTICE = "meshtron train: note: no --model, data or --config given"
#: Cheaper runs of the real trainer that keep the cases' point: short sequences, no evaluation, no sample.
CHEAP = ["--seq-length", "32", "--eval-iters", "0", "--no-generate-sample", "--log-interval", "1"]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh directory (runs/quickstart lands there), on the CPU, as a plain process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(validation, "_cuda_available", lambda: False)
    for name in ("WORLD_SIZE", "RANK", launcher.EXIT_STATUS_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _train_without_training(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture) -> tuple[int, list, list[str]]:
    """``meshtron train ARGV`` through the CLI, with a trainer that only records the validated config."""
    seen: list = []
    monkeypatch.setattr(cli, "_load_entry", lambda *a: lambda cfg, layout=None: seen.append(cfg) or 0)
    code = main(["train", *argv])
    return code, seen, capsys.readouterr().err.splitlines()


def _adapted(argv: list[str], world_size: int = 1):
    args = parse_train_args(argv)
    cli.adapt_quickstart(args, world_size)
    return args


def test_train_iters_below_the_warmup_clips_the_warmup(in_tmp, monkeypatch, capsys) -> None:
    code, seen, err = _train_without_training(["--train-iters", "6"], monkeypatch, capsys)
    assert code == 0, err
    assert seen[0].optim.lr_warmup_iters == 0 and seen[0].train.train_iters == 6
    assert err[0].startswith(NOTICE)
    assert "--lr-warmup-iters 0 (30 clipped to a tenth of 6 decay iterations)" in err[0]
    # the full job keeps its 30: a tenth of 1,200 is more
    assert _adapted([]).config.optim.lr_warmup_iters == QUICKSTART["lr_warmup_iters"]
    assert _adapted(["--train-iters", "100"]).config.optim.lr_warmup_iters == 10


@pytest.mark.parametrize("argv,warmup", [(["--lr-warmup-fraction", "0.1"], 0), (["--lr-warmup-samples", "16"], 2),
                                         (["--train-samples", "40"], 0), (["--lr-decay-iters", "50"], 5)])
def test_other_warmup_and_length_flags_adapt_the_warmup(in_tmp, argv, warmup) -> None:
    cfg = validation.validate_config(_adapted(argv).config, 1)
    assert cfg.optim.lr_warmup_iters == warmup


def test_load_alone_does_not_save_into_the_quickstart_directory(in_tmp, monkeypatch, capsys) -> None:
    (in_tmp / "ck").mkdir()
    code, seen, err = _train_without_training(["--load", "ck"], monkeypatch, capsys)
    assert code == 0, err
    assert seen[0].checkpoint.save is None and seen[0].checkpoint.load == "ck"
    assert "no --save (--load without --save saves nothing; add --save DIR to keep checkpoints)" in err[0]
    # --save given: the metrics file goes beside its checkpoints, not into runs/quickstart
    assert _adapted(["--save", "elsewhere"]).config.log.metrics_file == os.path.join("elsewhere", "metrics.jsonl")


def test_resume_takes_the_checkpoints_warmup(in_tmp, monkeypatch, capsys) -> None:
    """A run of 4 iterations with a warm-up of 3, resumed to 5 iterations: the warm-up is the checkpoint's, not
    the quick-start's 30 (which no longer fits) nor a tenth of 5."""
    first = main(["train", *CHEAP, "--train-iters", "4", "--lr-warmup-iters", "3", "--save", "ck"])
    assert first == 0, capsys.readouterr().err
    capsys.readouterr()
    code = main(["train", *CHEAP, "--load", "ck", "--train-iters", "5", "--metrics-file", "resumed.jsonl"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0, err
    assert "--lr-warmup-iters 3 (from the checkpoint in ck)" in err[0]
    records = [json.loads(line) for line in open("resumed.jsonl")]
    assert [r["iteration"] for r in records if r["type"] == "train"] == [5]
    assert not (in_tmp / "runs").exists()  # --load alone saved nothing into runs/quickstart


def test_nproc_per_node_alone_keeps_the_global_batch(tmp_path: Path) -> None:
    """The real launcher, two workers: the quick-start's global batch of 8 is kept with micro-batches of 4."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "--device", "cpu", "--train-iters", "2", *CHEAP],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    notices = [line for line in result.stderr.splitlines() if line.startswith(NOTICE)]
    assert len(notices) == 1  # said once, by the launching process
    assert "--micro-batch-size 4 (to divide --global-batch-size over data-parallel size 2)" in notices[0]
    assert "--global-batch-size 8," in notices[0]
    records = [json.loads(line) for line in open(tmp_path / "runs" / "quickstart" / "metrics.jsonl")]
    assert [r["consumed_samples"] for r in records if r["type"] == "train"] == [8, 16]


@pytest.mark.parametrize("argv,world,micro,global_batch", [
    ([], 2, 4, 8), ([], 3, 3, 9), ([], 16, 1, 16),
    (["--micro-batch-size", "16"], 1, 16, 16), (["--micro-batch-size", "3"], 2, 3, 12),
    (["--global-batch-size", "12"], 1, 6, 12), (["--global-batch-size", "12"], 2, 6, 12),
    (["--micro-batch-size", "8", "--global-batch-size", "8"], 1, 8, 8),
])
def test_batch_follows_the_data_parallel_size(in_tmp, argv, world, micro, global_batch) -> None:
    cfg = validation.validate_config(_adapted(argv, world).config, world)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (micro, global_batch)


def test_given_batch_values_are_never_changed() -> None:
    args = _adapted(["--micro-batch-size", "8", "--global-batch-size", "12"], 2)
    assert (args.config.train.micro_batch_size, args.config.train.global_batch_size) == (8, 12)
    with pytest.raises(validation.ConfigError, match="--global-batch-size \\(12\\) must be divisible"):
        validation.validate_config(args.config, 2)


@pytest.mark.parametrize("argv,field,value", [
    (["--max-position-embeddings", "128"], "seq_length", 128),
    (["--seq-length", "512"], "max_position_embeddings", 512),
    (["--lr", "1e-4"], "min_lr", 1e-5),
])
def test_dependent_defaults_follow_a_given_value(in_tmp, argv, field, value) -> None:
    cfg = validation.validate_config(_adapted(argv).config, 1)
    assert cfg.get(field) == pytest.approx(value)


def test_notice_comes_before_the_error(in_tmp, monkeypatch, capsys) -> None:
    code, _, err = _train_without_training(["--lr-warmup-iters", "5000"], monkeypatch, capsys)
    assert code == 2
    assert err[0].startswith(NOTICE) and "--train-iters 1200" in err[0]
    assert err[-1].startswith("meshtron train: error: --lr-warmup-iters (5000) must be smaller")


def test_no_quickstart_no_adaptation() -> None:
    args = _adapted(["--mock-data", "--vocab-size", "64", "--train-iters", "6"], 2)
    assert args.quickstart_adapted == {} and cli.quickstart_notice(args) is None
    assert quickstart.adapt(args.config, args.given, (), 2) == {}
