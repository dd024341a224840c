"""`meshtron preprocess`: formats, skipped input, parallel workers, summary, exit codes."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from _data_helpers import MULTIBYTE_TEXT, write_jsonl
from meshtron.data.indexed_dataset import IndexedDataset
from meshtron.data.preprocess import TokenizerArgs, preprocess, preprocess_main

DOCS = [MULTIBYTE_TEXT, "def f(x):\n    return x * 2\n", "short", "A longer document. " * 50]


def _bpe_args(bpe_dir) -> TokenizerArgs:
    return TokenizerArgs("GPT2BPETokenizer", vocab_file=str(bpe_dir / "vocab.json"),
                         merge_file=str(bpe_dir / "merges.txt"))


def _read_all(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_jsonl_round_trip_with_bad_lines(tmp_path, bpe_dir, bpe):
    records = [{"text": DOCS[0]}, "{not json", {"text": DOCS[1], "id": 3}, {"other": "no text key"}, "",
               {"text": ""}, {"text": 42}, "[1, 2]", {"text": DOCS[2]}, {"text": DOCS[3]}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    summary = preprocess([str(src)], str(tmp_path / "out"), _bpe_args(bpe_dir), append_eod=True, progress=False)
    expected = [bpe.encode(d) + [bpe.eod] for d in DOCS]
    assert _read_all(tmp_path / "out_text_document") == expected
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == 4
    s = summary.skips
    assert (s.not_json, s.missing_key, s.empty, s.not_text) == (2, 1, 1, 1)
    assert summary.documents == {"text": 4} and summary.tokens["text"] == sum(map(len, expected))
    report = summary.report(["text"])
    assert "2 lines not JSON" in report and "1 without key text" in report and "1 empty documents" in report
    assert f"{src}:2" in report  # the first bad line is named


def test_parallel_workers_give_identical_output(tmp_path, bpe_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i} " + DOCS[i % 4]} for i in range(300)])
    args = _bpe_args(bpe_dir)
    preprocess([str(src)], str(tmp_path / "one"), args, workers=1, append_eod=True, progress=False, chunk_bytes=2000)
    preprocess([str(src)], str(tmp_path / "two"), args, workers=2, append_eod=True, progress=False, chunk_bytes=2000)
    for ext in (".bin", ".idx"):
        assert ((tmp_path / f"one_text_document{ext}").read_bytes() ==
                (tmp_path / f"two_text_document{ext}").read_bytes())


def test_compressed_parquet_and_text_inputs(tmp_path, bpe_dir, bpe):
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:2])
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    inputs = [str(tmp_path / "a.jsonl.gz")]
    expected = [bpe.encode(d) for d in DOCS[:2]]
    try:
        import zstandard

        (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        inputs.append(str(tmp_path / "b.jsonl.zst"))
        expected += [bpe.encode(d) for d in DOCS[:2]]
    except ImportError:
        pass
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [DOCS[2], None, DOCS[3]], "n": [1, 2, 3]}), tmp_path / "c.parquet")
        inputs.append(str(tmp_path / "c.parquet"))
        expected += [bpe.encode(DOCS[2]), bpe.encode(DOCS[3])]
    except ImportError:
        pass
    (tmp_path / "d.txt").write_text(DOCS[0], encoding="utf-8")
    inputs.append(str(tmp_path / "d.txt"))
    expected.append(bpe.encode(DOCS[0]))
    summary = preprocess(inputs, str(tmp_path / "out"), _bpe_args(bpe_dir), progress=False)
    assert _read_all(tmp_path / "out_text_document") == expected
    assert summary.files == len(inputs)


def test_several_json_keys_write_one_dataset_each(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"title": "ab", "text": "xyz"}, {"title": "c", "text": "é"}])
    preprocess([str(src)], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"), json_keys=["text", "title"],
               progress=False)
    assert _read_all(tmp_path / "o_text_document") == [list(b"xyz"), list("é".encode())]
    assert _read_all(tmp_path / "o_title_document") == [list(b"ab"), list(b"c")]


def test_cli_success_and_merge(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCS])
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "a"), "--tokenizer-type",
                          "ByteTokenizer", "--append-eod", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "4 documents" in out and "MB/s per worker" in out
    rc = preprocess_main(["--merge", str(tmp_path / "a_text_document"), str(tmp_path / "a_text_document"),
                          "--output-prefix", str(tmp_path / "m")])
    assert rc == 0
    assert len(IndexedDataset(tmp_path / "m")) == 8


@pytest.mark.parametrize("argv, message", [
    (["--input", "/nonexistent/x.jsonl"], "no such file"),
    (["--input", "{tmp}/in.csv"], "unsupported file type"),
    (["--input", "{tmp}/in.jsonl", "--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model"),
    (["--input", "{tmp}/in.jsonl"], "--tokenizer-type"),
    (["--input", "{tmp}/in.jsonl", "--tokenizer-type", "ByteTokenizer", "--workers", "0"], "--workers"),
    (["--tokenizer-type", "ByteTokenizer"], "--input is required"),
    (["--merge", "{tmp}/nothing"], "not found"),
    (["--input", "{tmp}/in.jsonl", "--tokenizer-type", "NoSuch"], "invalid choice"),
])
def test_cli_bad_input_exits_2(tmp_path, capsys, argv, message):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    (tmp_path / "in.csv").write_text("a,b\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--output-prefix", str(tmp_path / "o")]
    assert preprocess_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))  # nothing half-written


@pytest.mark.parametrize("unit, expected", [
    ("file", ["first line\nsecond\n\nnew paragraph\n"]),
    ("line", ["first line", "second", "new paragraph"]),
    ("paragraph", ["first line\nsecond", "new paragraph\n"]),
])
def test_plain_text_units(tmp_path, unit, expected):
    (tmp_path / "t.txt").write_text("first line\nsecond\n\nnew paragraph\n", encoding="utf-8")
    summary = preprocess([str(tmp_path / "t.txt")], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"),
                         txt_unit=unit, progress=False)
    assert _read_all(tmp_path / "o_text_document") == [list(e.encode()) for e in expected]
    assert summary.skips.empty == (1 if unit == "line" else 0)  # the blank line


def test_progress_lines_when_not_on_a_terminal(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCS * 20])
    lines: list[str] = []
    preprocess([str(src)], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"), progress=True, log_interval=0,
               chunk_bytes=500, log=lines.append)
    assert len(lines) > 3
    assert "documents" in lines[-1] and "docs/s" in lines[-1] and "MB/s" in lines[-1]
