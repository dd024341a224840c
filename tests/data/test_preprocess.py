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
    # The empty text is a document without sequences (and without an end-of-document token), as in Megatron.
    assert ds.dtype == np.uint16 and ds.num_documents == 5 and ds.document_indices.tolist() == [0, 1, 2, 2, 3, 4]
    s = summary.skips
    assert (s.not_json, s.missing_key, s.empty, s.not_text) == (2, 1, 0, 1)
    assert summary.documents == {"text": 5} and summary.empty_documents == {"text": 1}
    assert summary.tokens["text"] == sum(map(len, expected))
    report = summary.report(["text"])
    assert "2 lines not JSON" in report and "1 without key text" in report and "1 documents have no tokens" in report
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
    assert summary.skips.empty == (1 if unit == "line" else 0)  # the blank line is skipped (not a document)


def test_progress_lines_when_not_on_a_terminal(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCS * 20])
    lines: list[str] = []
    preprocess([str(src)], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"), progress=True, log_interval=0,
               chunk_bytes=500, log=lines.append)
    assert len(lines) > 3
    assert "documents" in lines[-1] and "docs/s" in lines[-1] and "MB/s" in lines[-1]


def _megatron_layout(docs: list[list[int]]) -> tuple[bytes, bytes]:
    """The .idx/.bin that Megatron's preprocess_data.py writes for these token lists with --append-eod:
    a document with tokens is one sequence ending with end-of-document; an empty one adds only a
    document-index entry (Encoder.encode gives it no sentence, IndexedDatasetBuilder.add_document
    appends len(sequence_lengths) to the document index)."""
    from test_indexed_dataset import hand_written_bin, hand_written_idx

    seqs = [d + [256] for d in docs if d]
    doc_index, count = [0], 0
    for d in docs:
        count += 1 if d else 0
        doc_index.append(count)
    return hand_written_idx(seqs, doc_index), hand_written_bin(seqs)


def test_empty_documents_are_kept_as_megatron_keeps_them(tmp_path):
    texts = ["", "ab", "", "", "c", ""]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    summary = preprocess([str(src)], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"), append_eod=True,
                         progress=False)
    idx, binb = _megatron_layout([list(t.encode()) for t in texts])
    assert (tmp_path / "o_text_document.idx").read_bytes() == idx
    assert (tmp_path / "o_text_document.bin").read_bytes() == binb
    assert summary.documents == {"text": 6} and summary.empty_documents == {"text": 4}


def test_empty_documents_match_megatron_core_builder(tmp_path):
    """Runs where megatron-core is installed: its builder, fed as preprocess_data.py feeds it, writes our bytes."""
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    texts = ["ab", "", "c"]
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for t in texts:
        ids = list(t.encode())
        lens = [len(ids) + 1] if ids else []
        builder.add_document(torch.tensor(ids + [256] if ids else [], dtype=torch.int64), lens)
    builder.finalize(str(tmp_path / "theirs.idx"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    preprocess([str(src)], str(tmp_path / "o"), TokenizerArgs("ByteTokenizer"), append_eod=True, progress=False)
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"o_text_document{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


@pytest.mark.parametrize("records, keys, message", [
    ([{"content": "x"}, {"content": "y"}], ["text"], "2 without key text"),
    (["{bad", "[1]"], ["text"], "2 lines not JSON"),
    ([{"text": ""}, {"text": ""}], ["text"], "2 documents with no tokens"),
    ([{"text": "x", "title": ""}], ["text", "title"], "--json-keys title"),
])
def test_no_text_at_all_is_an_error_and_writes_nothing(tmp_path, capsys, records, keys, message):
    src = write_jsonl(tmp_path / "in.jsonl", records)
    rc = preprocess_main(["--input", str(src), "--json-keys", *keys, "--output-prefix", str(tmp_path / "o"),
                          "--tokenizer-type", "ByteTokenizer", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"--input {src}: no document has text under --json-keys" in err and message in err
    assert not list(tmp_path.glob("o*"))  # no empty (or partial) dataset left behind


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl.gz", b"\x1f\x8b\x08garbage", "cannot read {p}"),
    ("cut.jsonl.gz", gzip.compress(b'{"text": "abc"}\n' * 100)[:-20], "cannot read {p}"),
    ("bad.jsonl.zst", b"not zstd at all", "cannot read {p}"),
    ("bad.parquet", b"PAR1garbagePAR1", "cannot read Parquet file {p}"),
])
def test_damaged_input_files_exit_2(tmp_path, capsys, name, content, message):
    if name.endswith(".zst"):
        pytest.importorskip("zstandard")
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_bytes(content)
    rc = preprocess_main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                          "ByteTokenizer", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and message.format(p=path) in err and err.count("\n") == 1
    assert not list(tmp_path.glob("o*"))
