"""Verified checkpoints through ``meshtron train``: a verified resume equals an uninterrupted run, a damaged
checkpoint named by --load exits 2 with the file named (``--no-verify-checkpoint`` loads it), ``meshtron
generate`` refuses it too."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from meshtron.cli import main as meshtron_main
from tamper import flip_tensor_byte, stored_tensor_and_file

TRAIN = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--num-layers", "2", "--hidden-size", "64",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--device", "cpu", "--log-interval", "1", "--no-generate-sample", "--eval-interval", "0",
         "--train-iters", "4"]


def _losses(metrics: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
            if r["type"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-iteration run, and one that saved at iteration 2 and stopped."""
    root = tmp_path_factory.mktemp("runs")
    assert meshtron_main(["train", *TRAIN, "--metrics-file", str(root / "full.jsonl")]) == 0
    assert meshtron_main(["train", *TRAIN, "--exit-interval", "2", "--save", str(root / "ckpt")]) == 0
    return root


def test_verified_resume_equals_uninterrupted(runs, tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(runs / "ckpt", save)
    metrics = tmp_path / "resumed.jsonl"
    assert meshtron_main(["train", *TRAIN, "--load", str(save), "--metrics-file", str(metrics)]) == 0
    full, resumed = _losses(runs / "full.jsonl"), _losses(metrics)
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(full[it], rel=1e-6, abs=1e-7)


def test_damaged_checkpoint_is_refused_by_train_and_generate(runs, tmp_path, capsys, caplog):
    save = tmp_path / "ckpt"
    shutil.copytree(runs / "ckpt", save)
    data_file, stored = stored_tensor_and_file(save / "iter_0000002", "model.layers.1.mlp.down.weight")
    flip_tensor_byte(data_file, stored)
    capsys.readouterr()
    assert meshtron_main(["train", *TRAIN, "--load", str(save)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{data_file} does not match its checksum" in errors[0], err
    assert meshtron_main(["generate", "--load", str(save), "--prompt", "x", "--device", "cpu"]) == 2
    assert f"{data_file} does not match its checksum" in capsys.readouterr().err
    # The user who accepts the risk loads it anyway, with one warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshtron.checkpoint.verify"):
        assert meshtron_main(["train", *TRAIN, "--load", str(save), "--no-verify-checkpoint"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "--no-verify-checkpoint" in r.getMessage()]
    assert len(warnings) == 1 and str(save) in warnings[0], warnings
    capsys.readouterr()
    # generate with the flag gets past the check to the next question (this mock-data run saved no tokenizer)
    assert meshtron_main(["generate", "--load", str(save), "--prompt", "x", "--device", "cpu", "--max-new-tokens",
                          "2", "--no-verify-checkpoint"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "checksum" not in err, err
