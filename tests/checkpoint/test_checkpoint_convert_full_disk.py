"""`meshtron convert` onto a full disk: one line naming the output and the error, exit 1, and no partial
output directory left behind (safetensors reports the disk as its own SafetensorError, not an OSError)."""

from __future__ import annotations

import errno

import pytest
import safetensors.torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError

from meshtron.checkpoint.convert import convert_main

#: What safetensors' Rust writer raises on a full disk (the wording of its I/O errors, errno 28).
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _safetensors_fails(monkeypatch, message: str = FULL) -> None:
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        real(dict(list(tensors.items())[:1]), filename, metadata=metadata)  # part of it reached the disk
        raise SafetensorError(message)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _export(path, out) -> int:
    return convert_main(["--to", "hf", "--input", str(path), "--output", str(out)])


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


@pytest.fixture
def where(tmp_path_factory):
    """An empty directory for the outputs (the checkpoint's own directory is the save directory)."""
    return tmp_path_factory.mktemp("outputs")


def test_export_onto_a_full_disk_leaves_no_output(first_checkpoint, where, monkeypatch, capsys):
    path = first_checkpoint[0]
    out = where / "exports" / "deep" / "hf"
    _safetensors_fails(monkeypatch)
    assert _export(path, out) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"writing {out} failed: no space left on device" in lines[0] and "needs about" in lines[0], lines
    assert list(where.iterdir()) == []  # nor the parents this export created, nor a hidden temporary


def test_export_into_an_empty_directory_keeps_it_empty_on_failure(first_checkpoint, where, monkeypatch, capsys):
    path = first_checkpoint[0]
    out = where / "hf"
    out.mkdir()
    _safetensors_fails(monkeypatch, "Error while serializing: I/O error: Input/output error (os error 5)")
    assert _export(path, out) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and f"writing {out} failed: Input/output error" in lines[0], lines
    assert out.is_dir() and list(out.iterdir()) == [] and list(where.iterdir()) == [out]
    monkeypatch.undo()
    assert _export(path, out) == 0  # the export goes into the user's empty directory
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_import_onto_a_full_disk_leaves_no_output(first_checkpoint, where, monkeypatch, capsys):
    path = first_checkpoint[0]
    hf_dir = where / "model"
    assert _export(path, hf_dir) == 0

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    out = where / "imported" / "ckpt"
    capsys.readouterr()
    assert convert_main(["--from", "hf", "--input", str(hf_dir), "--output", str(out)]) == 1
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "no space left on device" in lines[0], lines
    assert list(where.iterdir()) == [hf_dir]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_export_leaves_no_output_either(first_checkpoint, where, monkeypatch, error):
    path = first_checkpoint[0]

    def save_file(tensors, filename, metadata=None):
        raise error("stopped")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(error):
        _export(path, where / "hf")
    assert list(where.iterdir()) == []
