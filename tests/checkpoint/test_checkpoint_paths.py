"""Checkpoint paths that are not what they should be are named for what they are, exit 2: a regular file
given as --load, a symbolic link loop as --save, a ``latest`` marker holding a negative iteration."""

from __future__ import annotations

import os

import pytest

from meshtron.checkpoint import CheckpointError, resolve_checkpoint
from meshtron.cli import main as meshtron_main

TRAIN = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--num-layers", "2", "--hidden-size", "64",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--device", "cpu", "--log-interval", "1", "--no-generate-sample", "--eval-interval", "0",
         "--train-iters", "1"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_load_of_a_regular_file_says_it_is_a_file(tmp_path, capsys):
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint")
    assert meshtron_main(["train", *TRAIN, "--load", str(path)]) == 2
    line = _one_error_line(capsys)
    assert f"--load: {path} is a file, not a checkpoint directory" in line, line
    assert "does not exist" not in line
    # the same with --load and --save naming the file (the resumable-run spelling)
    assert meshtron_main(["train", *TRAIN, "--load", str(path), "--save", str(path)]) == 2
    assert f"{path} is a file, not a checkpoint directory" in _one_error_line(capsys)


def test_save_into_a_symlink_loop_names_the_loop(tmp_path, capsys):
    loop = tmp_path / "ckpt"
    os.symlink(loop, loop)  # ckpt -> ckpt
    assert meshtron_main(["train", *TRAIN, "--save", str(loop / "run1")]) == 2
    line = _one_error_line(capsys)
    assert f"{loop} is a symbolic link loop: {loop} -> {loop}" in line, line
    assert meshtron_main(["train", *TRAIN, "--save", str(loop)]) == 2
    line = _one_error_line(capsys)
    assert "symbolic link loop" in line and "File exists" not in line, line


def test_save_onto_a_dangling_symlink_says_so(tmp_path, capsys):
    link = tmp_path / "ckpt"
    os.symlink(tmp_path / "gone" / "away", link)
    assert meshtron_main(["train", *TRAIN, "--save", str(link)]) == 2
    assert f"{link} is a dangling symbolic link" in _one_error_line(capsys)


@pytest.mark.parametrize("text", ["-1", "-7\n"])
def test_negative_latest_marker_is_refused_as_corrupt(tmp_path, capsys, text):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text(text)
    with pytest.raises(CheckpointError, match=r"latest holds '-\d', which is not a valid latest-checkpoint marker"):
        resolve_checkpoint(save)
    assert meshtron_main(["train", *TRAIN, "--load", str(save)]) == 2
    line = _one_error_line(capsys)
    assert f"{save / 'latest'} holds" in line and "corrupt" in line and "iter_-" not in line, line
