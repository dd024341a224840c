"""The .bin/.idx format, field by field against Megatron-Core's documented layout."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from meshtron.data.errors import DataError
from meshtron.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, merge_datasets,
                                           token_dtype_for_vocab)

# Three documents; the second is made of two sequences. Tokens as uint16 (dtype code 8).
SEQS = [[5, 6, 7], [1000, 2], [3], [65000, 0, 9, 9]]
DOC_INDEX = [0, 1, 3, 4]


def hand_written_idx(seqs=SEQS, doc_index=DOC_INDEX, code=8, itemsize=2, magic=b"MMIDIDX\x00\x00", version=1,
                     lengths=None, pointers=None) -> bytes:
    """The index bytes, written directly from the layout description (not with meshtron's code);
    ``lengths`` / ``pointers`` replace the fields derived from ``seqs`` (to write corrupt entries)."""
    out = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    out += struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_index))
    pointer = 0
    derived = []
    for s in seqs:
        derived.append(pointer)
        pointer += len(s) * itemsize
    pointers = derived if pointers is None else pointers
    lengths = [len(s) for s in seqs] if lengths is None else lengths
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_index)
    return out


def hand_written_bin(seqs=SEQS) -> bytes:
    return b"".join(struct.pack("<H", t) for s in seqs for t in s)


@pytest.fixture()
def fixture_prefix(tmp_path):
    prefix = tmp_path / "fixture"
    (tmp_path / "fixture.idx").write_bytes(hand_written_idx())
    (tmp_path / "fixture.bin").write_bytes(hand_written_bin())
    return prefix


def test_reads_hand_written_fixture_field_by_field(fixture_prefix):
    ds = IndexedDataset(fixture_prefix)
    assert ds.dtype == np.uint16
    assert len(ds) == 4 and ds.num_documents == 3
    assert ds.sequence_lengths.tolist() == [3, 2, 1, 4]
    assert ds.sequence_pointers.tolist() == [0, 6, 10, 12]
    assert ds.document_indices.tolist() == DOC_INDEX
    assert [ds[i].tolist() for i in range(4)] == SEQS
    assert ds.get(3, offset=1, length=2).tolist() == [0, 9]
    assert ds.num_tokens == 10


def test_writer_output_is_byte_identical_to_the_layout(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as w:
        w.add_document(SEQS[0])
        w.add_sequence(SEQS[1])
        w.add_sequence(SEQS[2])
        w.end_document()
        w.add_document(np.array(SEQS[3]))
        w.finalize()
    assert (tmp_path / "ours.idx").read_bytes() == hand_written_idx()
    assert (tmp_path / "ours.bin").read_bytes() == hand_written_bin()
    assert not list(tmp_path.glob("*.tmp"))


def test_header_offsets_are_megatrons():
    raw = hand_written_idx()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9)[0] == 1
    assert raw[17] == 8
    assert struct.unpack_from("<QQ", raw, 18) == (4, 4)
    assert len(raw) == 34 + 12 * 4 + 8 * 4


def test_int32_dataset_and_dtype_choice(tmp_path):
    assert token_dtype_for_vocab(50257) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32
    docs = [[0, 70000, 128255], [5]]
    with IndexedDatasetWriter(tmp_path / "big", token_dtype_for_vocab(128256)) as w:
        w.add_documents(np.concatenate(docs), np.array([3, 1]))
        w.finalize()
    raw = (tmp_path / "big.idx").read_bytes()
    assert raw[17] == 4  # int32
    assert raw == hand_written_idx(docs, [0, 1, 2], code=4, itemsize=4)
    ds = IndexedDataset(tmp_path / "big.bin")  # an extension on the prefix is tolerated
    assert [ds[i].tolist() for i in range(2)] == docs


def test_token_out_of_dtype_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([70000])
    assert not list(tmp_path.iterdir())  # the partial output is removed


def test_merge_concatenates_documents(tmp_path, fixture_prefix):
    with IndexedDatasetWriter(tmp_path / "second", np.uint16) as w:
        w.add_document([11, 12])
        w.finalize()
    out = merge_datasets([fixture_prefix, tmp_path / "second", fixture_prefix], tmp_path / "merged")
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == SEQS + [[11, 12]] + SEQS
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5, 6, 8, 9]
    # Same bytes as writing the merged layout by hand.
    assert (tmp_path / "merged.idx").read_bytes() == hand_written_idx(SEQS + [[11, 12]] + SEQS,
                                                                      [0, 1, 3, 4, 5, 6, 8, 9])


def test_pickle_reopens_by_path(fixture_prefix):
    ds = pickle.loads(pickle.dumps(IndexedDataset(fixture_prefix)))
    assert ds[3].tolist() == SEQS[3]
    assert len(pickle.dumps(IndexedDataset(fixture_prefix))) < 300


@pytest.mark.parametrize("case, message", [
    ("magic", "magic"),
    ("version", "version 2"),
    ("dtype", "dtype code 9"),
    ("truncated_idx", "truncated or corrupt"),
    ("short_idx", "shorter than the 34-byte header"),
    ("short_bin", "sequence 3 \\(4 tokens from byte 12\\) ends at byte 20, past the end of .*18 bytes.*truncated"),
    ("long_bin", "truncated or do not belong together"),
    ("doc_index", "document index"),
    ("doc_index_decreasing", "document index entry 2 is 1, below entry 1 \\(3\\)"),
    ("pointer_past_end", "sequence 2 starts at byte 1000000, past the end of"),
    ("negative_pointer", "sequence 1 has a negative byte offset \\(-6\\)"),
    ("overlapping_pointer", "sequence 2 starts at byte 6, but the sequences before it end at byte 10"),
    ("negative_length", "sequence 1 has a negative length \\(-2 tokens\\)"),
    ("huge_length", "sequence 1 \\(2147483647 tokens from byte 6\\) ends at byte 4294967300, past the end"),
    ("missing_bin", "not found"),
    ("missing_idx", "not found"),
])
def test_corrupt_files_give_clear_errors(tmp_path, case, message):
    idx, binb = hand_written_idx(), hand_written_bin()
    if case == "magic":
        idx = b"NOTMAGIC!" + idx[9:]
    elif case == "version":
        idx = hand_written_idx(version=2)
    elif case == "dtype":
        idx = hand_written_idx(code=9)
    elif case == "truncated_idx":
        idx = idx[:-3]
    elif case == "short_idx":
        idx = idx[:20]
    elif case == "short_bin":
        binb = binb[:-2]
    elif case == "long_bin":
        binb = binb + b"\x00\x00"
    elif case == "doc_index":
        idx = hand_written_idx(doc_index=[0, 1, 3, 5])
    elif case == "doc_index_decreasing":
        idx = hand_written_idx(doc_index=[0, 3, 1, 4])
    elif case == "pointer_past_end":
        idx = hand_written_idx(pointers=[0, 6, 1_000_000, 12])
    elif case == "negative_pointer":
        idx = hand_written_idx(pointers=[0, -6, 10, 12])
    elif case == "overlapping_pointer":
        idx = hand_written_idx(pointers=[0, 6, 6, 12])
    elif case == "negative_length":
        idx = hand_written_idx(lengths=[3, -2, 1, 4])
    elif case == "huge_length":
        idx = hand_written_idx(lengths=[3, 2**31 - 1, 1, 4])
    if case != "missing_idx":
        (tmp_path / "d.idx").write_bytes(idx)
    if case != "missing_bin":
        (tmp_path / "d.bin").write_bytes(binb)
    with pytest.raises(DataError, match=message) as err:
        IndexedDataset(tmp_path / "d")
    assert str(tmp_path / "d.") in str(err.value)  # the message names the file
    assert "\n" not in str(err.value)


def test_every_entry_is_checked_across_blocks(tmp_path, monkeypatch):
    """A bad entry deep inside a large index is found and named, whatever the block it falls in."""
    import meshtron.data.indexed_dataset as ix

    monkeypatch.setattr(ix, "CHECK_BLOCK", 7)
    lengths = np.arange(1, 101) % 5  # zero-length sequences included
    with IndexedDatasetWriter(tmp_path / "big", np.uint16) as w:
        for n in lengths:
            w.add_sequence(np.zeros(n, np.uint16))
            w.end_document()
        w.finalize()
    IndexedDataset(tmp_path / "big")  # valid
    raw = bytearray((tmp_path / "big.idx").read_bytes())
    n = struct.unpack_from("<Q", raw, 18)[0]
    for entry in (0, 6, 7, 50, n - 1):
        bad = raw.copy()
        struct.pack_into("<i", bad, 34 + 4 * entry, -1)
        (tmp_path / "bad.idx").write_bytes(bytes(bad))
        (tmp_path / "bad.bin").write_bytes((tmp_path / "big.bin").read_bytes())
        with pytest.raises(DataError, match=f"sequence {entry} has a negative length"):
            IndexedDataset(tmp_path / "bad")


def test_empty_documents_are_valid(tmp_path):
    """Documents without sequences (repeated document-index entries), as Megatron writes empty texts."""
    (tmp_path / "e.idx").write_bytes(hand_written_idx(doc_index=[0, 1, 1, 3, 3, 4]))
    (tmp_path / "e.bin").write_bytes(hand_written_bin())
    ds = IndexedDataset(tmp_path / "e")
    assert ds.num_documents == 5 and len(ds) == 4 and [ds[i].tolist() for i in range(4)] == SEQS


def test_a_copy_in_a_worker_notices_a_changed_bin(fixture_prefix):
    ds = IndexedDataset(fixture_prefix)
    state = pickle.dumps(ds)
    with open(str(fixture_prefix) + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match="changed size"):
        pickle.loads(state)


def test_interoperates_with_megatron_core(tmp_path):
    """Runs where megatron-core is installed (not a dependency): each side reads the other's files."""
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    builder.add_document(torch.tensor([1, 2, 3]), [3])
    builder.add_document(torch.tensor([4, 5, 6, 100000]), [2, 2])
    builder.finalize(str(tmp_path / "theirs.idx"))
    with IndexedDatasetWriter(tmp_path / "ours", np.int32) as w:
        w.add_document([1, 2, 3])
        w.add_sequence([4, 5])
        w.add_sequence([6, 100000])
        w.end_document()
        w.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    theirs = mcore.IndexedDataset(str(tmp_path / "ours"))
    assert [theirs[i].tolist() for i in range(3)] == [[1, 2, 3], [4, 5], [6, 100000]]
    assert IndexedDataset(tmp_path / "theirs").document_indices.tolist() == [0, 1, 3]


def test_an_unreadable_file_is_a_data_error(fixture_prefix, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error", str(fixture_prefix) + ".idx")

    monkeypatch.setattr(np, "memmap", fail)
    with pytest.raises(DataError, match=r"cannot read dataset .*fixture.idx: Input/output error"):
        IndexedDataset(fixture_prefix)
