"""`meshtron preprocess` onto a full disk: one line naming the file and the error, exit 1 (a failure while
running, not bad input), and no partial output left behind."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from _data_helpers import write_jsonl
from meshtron.data import indexed_dataset
from meshtron.data.preprocess import preprocess_main

TEXTS = [{"text": f"document {i}: " + "some words to tokenize " * 20} for i in range(40)]


class _Disk:
    """A file system with ``capacity`` bytes: the write that crosses it writes what fits, then fails ENOSPC."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity

    def open(self, path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FileOnDisk(f, self) if "w" in mode else f


class _FileOnDisk:
    def __init__(self, f, disk: _Disk) -> None:
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self._disk.free:
            self._f.write(data[:self._disk.free])
            self._disk.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a buffered write reports it: no file name
        self._disk.free -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _run(tmp_path, monkeypatch, capacity: int, extra=()) -> tuple[int, str]:
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    monkeypatch.setattr(indexed_dataset, "open", _Disk(capacity).open, raising=False)
    out = tmp_path / "out" / "corpus"
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(out), "--tokenizer-type", "ByteTokenizer",
                          "--no-progress", *extra])
    return rc, str(out)


def _bin_size(tmp_path) -> int:
    """Bytes of the tokens of TEXTS (the .bin a run without a limit writes)."""
    src = write_jsonl(tmp_path / "sized.jsonl", TEXTS)
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "sized" / "c"),
                            "--tokenizer-type", "ByteTokenizer", "--no-progress"]) == 0
    return (tmp_path / "sized" / "c_text_document.bin").stat().st_size


@pytest.mark.parametrize("failing", [".bin", ".idx"])
def test_full_disk_names_the_file_exits_1_and_leaves_nothing(tmp_path, monkeypatch, capsys, failing):
    capacity = 1000 if failing == ".bin" else _bin_size(tmp_path) + 10  # room for the tokens, not the index
    capsys.readouterr()
    rc, out = _run(tmp_path, monkeypatch, capacity)
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"writing {out}_text_document{failing}" in err and "No space left on device" in err, err
    assert list((tmp_path / "out").iterdir()) == []  # no .bin.tmp/.idx.tmp nor half a dataset


def test_full_disk_while_creating_the_output_is_a_failure_too(tmp_path, monkeypatch, capsys):
    def no_room(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return builtins.open(path, mode, *args, **kwargs)

    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    monkeypatch.setattr(indexed_dataset, "open", no_room, raising=False)
    out = tmp_path / "corpus"
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(out), "--tokenizer-type", "ByteTokenizer",
                          "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and f"{out}_text_document.bin.tmp" in err and "No space left on device" in err, err


def test_unwritable_output_path_stays_bad_input(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(blocker / "corpus"),
                          "--tokenizer-type", "ByteTokenizer", "--no-progress"])
    assert rc == 2 and str(blocker) in capsys.readouterr().err


def test_merge_onto_a_full_disk_exits_1_naming_the_output(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "a"),
                            "--tokenizer-type", "ByteTokenizer", "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(indexed_dataset, "open", _Disk(1000).open, raising=False)
    merged = tmp_path / "merged" / "m"
    rc = preprocess_main(["--merge", str(tmp_path / "a_text_document"), "--output-prefix", str(merged)])
    err = capsys.readouterr().err
    assert rc == 1 and f"writing {merged}.bin" in err and "No space left on device" in err, err
    assert list(merged.parent.iterdir()) == []
