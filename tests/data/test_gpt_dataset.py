"""GPT samples: windows across documents, epochs, seeded shuffles, caching, splits, masks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshtron.data.batching import BatchOptions, make_micro_batch
from meshtron.data.errors import DataError
from meshtron.data.gpt_dataset import GPTDataset, epoch_starts, parse_split, split_ranges
from meshtron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

S = 8


@pytest.fixture()
def indexed(tmp_path) -> IndexedDataset:
    """30 documents of varied lengths (two of zero-length sequences); token j of document k is k * 100 + j."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 25, size=30)
    lengths[[4, 17]] = 0
    with IndexedDatasetWriter(tmp_path / "docs", np.int32) as w:
        for k, n in enumerate(lengths):
            w.add_sequence(k * 100 + np.arange(n))  # a zero-length sequence too, as other tools may write
            w.end_document()
        w.finalize()
    return IndexedDataset(tmp_path / "docs")


def _stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.document_index]).astype(np.int64)


def test_samples_are_consecutive_windows_of_the_shuffled_documents(indexed, tmp_path):
    ds = GPTDataset(indexed, (0, 30), 200, S, seed=1, cache_dir=tmp_path / "c")
    stream = _stream(ds)
    assert len(ds) == 200
    for i in range(len(ds)):
        raw = int(ds.shuffle_index[i])
        assert ds.sample(i).tolist() == stream[raw * S: raw * S + S + 1].tolist()
    assert np.array_equal(ds.samples(5, 7), np.stack([ds.sample(i) for i in range(5, 12)]))


def test_epochs_are_permutations_and_served_epoch_by_epoch(indexed):
    ds = GPTDataset(indexed, (3, 27), 300, S, seed=2)
    per_epoch = 24
    tokens = int(indexed.sequence_lengths[3:27].sum())
    bounds = epoch_starts(ds.epochs, tokens, S)
    assert bounds[-2] < 300 <= bounds[-1]  # the fewest whole epochs that hold 300 samples
    # Documents: one permutation per epoch, as many epochs as the last raw sample's tokens reach.
    doc_epochs = len(ds.document_index) // per_epoch
    assert doc_epochs == -(-(int(bounds[-1]) * S + 1) // tokens)
    for e in range(doc_epochs):
        assert sorted(ds.document_index[e * per_epoch:(e + 1) * per_epoch].tolist()) == list(range(3, 27))
    # Serving: positions B(e) .. B(e+1) - 1 are a permutation of the raw samples that start in epoch e.
    for e in range(ds.epochs):
        lo, hi = int(bounds[e]), int(bounds[e + 1])
        assert sorted(ds.shuffle_index[lo:hi].tolist()) == list(range(lo, hi))
        assert np.all(np.asarray(ds.shuffle_index[lo:hi]) * S // tokens == e)
    assert len(ds) == 300


def test_seed_determines_order_and_every_prefix_is_stable(indexed):
    a = GPTDataset(indexed, (0, 30), 150, S, seed=5)
    b = GPTDataset(indexed, (0, 30), 150, S, seed=5)
    c = GPTDataset(indexed, (0, 30), 150, S, seed=6)
    assert np.array_equal(a.samples(0, 150), b.samples(0, 150))
    assert not np.array_equal(a.samples(0, 150), c.samples(0, 150))
    # Asking for more samples (within the same epoch, into the next epochs, from a partial epoch)
    # serves the same samples first: the order never depends on the number requested.
    per_epoch = -(-int(indexed.sequence_lengths.sum()) // S)
    longest = GPTDataset(indexed, (0, 30), 5 * per_epoch + 7, S, seed=5)
    reference = longest.samples(0, len(longest))
    for n in (1, 2, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3, 4 * per_epoch):
        shorter = GPTDataset(indexed, (0, 30), n, S, seed=5)
        assert len(shorter) == n
        assert np.array_equal(shorter.samples(0, n), reference[:n]), n


def test_index_arrays_are_cached_and_reused(indexed, tmp_path):
    cache = tmp_path / "cache"
    first = GPTDataset(indexed, (0, 30), 100, S, seed=1, split="valid", cache_dir=cache)
    assert first.built_indices and first.is_cached()
    second = GPTDataset(indexed, (0, 30), 100, S, seed=1, split="valid", cache_dir=cache)
    assert not second.built_indices
    assert np.array_equal(first.samples(0, 100), second.samples(0, 100))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and any(f.endswith("-valid-description.json") for f in files)
    desc = json.loads(next(cache.glob("*-description.json")).read_text())
    assert desc["key"]["epochs"] == first.epochs and desc["key"]["seq_length"] == S
    assert desc["key"]["documents"] == [0, 30] and set(desc["arrays"]) == {"document_index", "sample_index",
                                                                             "shuffle_index"}
    # Fewer samples from the same epochs: the same cache entry.
    fewer = GPTDataset(indexed, (0, 30), 95, S, seed=1, split="valid", cache_dir=cache)
    assert fewer.epochs == first.epochs and not fewer.built_indices and len(fewer) == 95
    # Another sequence length is another cache entry.
    assert GPTDataset(indexed, (0, 30), 100, S + 1, seed=1, split="valid", cache_dir=cache).built_indices


def _write_docs(prefix, docs) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in docs:
            w.add_document(np.asarray(d))
        w.finalize()
    return IndexedDataset(prefix)


def test_cache_is_keyed_on_the_document_lengths_not_on_file_sizes(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 20, size=40)
    old = _write_docs(tmp_path / "d", [np.arange(n) for n in lengths])
    cache = tmp_path / "cache"
    GPTDataset(old, (0, 40), 80, S, seed=3, cache_dir=cache)
    # Rewritten in place: same sizes and document count, other document lengths.
    moved = lengths.copy()
    moved[0], moved[1] = moved[0] + moved[1] - 1, 1
    assert moved.sum() == lengths.sum() and not np.array_equal(moved, lengths)
    new = _write_docs(tmp_path / "d", [1000 + np.arange(n) for n in moved])
    reread = GPTDataset(new, (0, 40), 80, S, seed=3, cache_dir=cache)
    assert reread.built_indices
    assert np.array_equal(reread.samples(0, 80), GPTDataset(new, (0, 40), 80, S, seed=3).samples(0, 80))
    # Same lengths, other tokens: the index arrays are still right, and the new tokens are read.
    retokenized = _write_docs(tmp_path / "d", [5000 + np.arange(n) for n in moved])
    again = GPTDataset(retokenized, (0, 40), 80, S, seed=3, cache_dir=cache)
    assert not again.built_indices
    assert np.array_equal(again.samples(0, 80), GPTDataset(retokenized, (0, 40), 80, S, seed=3).samples(0, 80))
    assert again.samples(0, 80).min() >= 5000


@pytest.mark.parametrize("damage", ["edited_array", "truncated_array", "not_json", "other_key", "missing_arrays"])
def test_damaged_cache_files_are_ignored_with_a_warning_and_rebuilt(indexed, tmp_path, caplog, damage):
    cache = tmp_path / "cache"
    fresh = GPTDataset(indexed, (0, 30), 100, S, seed=1, cache_dir=cache)
    expected = fresh.samples(0, 100)
    shuffle = next(cache.glob("*-shuffle_index.npy"))
    description = next(cache.glob("*-description.json"))
    if damage == "edited_array":  # a valid .npy whose values were changed
        arr = np.load(shuffle)
        arr[[0, 1]] = arr[[1, 0]]
        np.save(shuffle, arr)
    elif damage == "truncated_array":
        shuffle.write_bytes(shuffle.read_bytes()[:-10])
    elif damage == "not_json":
        description.write_text("{not json")
    elif damage == "other_key":
        desc = json.loads(description.read_text())
        desc["key"]["seed"] = 2
        description.write_text(json.dumps(desc))
    elif damage == "missing_arrays":
        desc = json.loads(description.read_text())
        del desc["arrays"]
        description.write_text(json.dumps(desc))
    with caplog.at_level("WARNING", logger="meshtron.data.gpt_dataset"):
        rebuilt = GPTDataset(indexed, (0, 30), 100, S, seed=1, cache_dir=cache)
    assert rebuilt.built_indices
    assert "ignoring the dataset index cache" in caplog.text and "rebuilding" in caplog.text
    assert np.array_equal(rebuilt.samples(0, 100), expected)
    assert not GPTDataset(indexed, (0, 30), 100, S, seed=1, cache_dir=cache).built_indices  # repaired


def test_one_epoch_when_no_sample_count_is_given(indexed):
    ds = GPTDataset(indexed, (0, 30), None, S, seed=1)
    assert len(ds) == -(-int(indexed.sequence_lengths.sum()) // S) and ds.epochs == 1


def test_an_impossible_request_is_refused_before_allocating(indexed, monkeypatch):
    with pytest.raises(DataError) as err:
        GPTDataset(indexed, (0, 30), 8 * 10**12, S, seed=1, request="--train-iters 1000000000000 x --global-batch-size 8")
    message = str(err.value)
    assert "--train-iters 1000000000000 x --global-batch-size 8 = 8,000,000,000,000 train samples" in message
    assert "375 tokens" in message and "GiB of index arrays" in message and "memory available" in message
    assert "\n" not in message
    # The check compares with the memory available: with 1 MiB left, a modest request is refused too.
    import meshtron.data.gpt_dataset as gd

    monkeypatch.setattr(gd, "available_memory", lambda: 1 << 20)
    with pytest.raises(DataError, match="more than the 0.0 GiB"):
        GPTDataset(indexed, (0, 30), 100_000, S, seed=1)
    GPTDataset(indexed, (0, 30), 1000, S, seed=1)  # a few kB fit


def test_a_split_smaller_than_one_sample_warns(indexed, caplog):
    with caplog.at_level("WARNING", logger="meshtron.data.gpt_dataset"):
        ds = GPTDataset(indexed, (0, 2), 40, 64, seed=1)  # 37 tokens, samples of 65
    assert "fewer than one sample of --seq-length 64" in caplog.text and "about 2 times" in caplog.text
    assert ds.samples(0, 40).shape == (40, 65)
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshtron.data.gpt_dataset"):
        GPTDataset(indexed, (0, 30), 40, S, seed=1)
    assert caplog.text == ""


def test_empty_documents_and_sequences_never_shorten_a_sample(tmp_path):
    # Documents without sequences (empty texts, as Megatron writes them) and zero-length sequences.
    with IndexedDatasetWriter(tmp_path / "e", np.int32) as w:
        w.add_document([])
        w.add_document([1, 2, 3])
        w.add_document([])
        w.add_sequence([])
        w.end_document()
        w.add_document([4, 5])
        w.add_document([])
        w.finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert ds.num_documents == 6 and len(ds) == 3 and ds.sequence_lengths.tolist() == [3, 0, 2]
    gpt = GPTDataset(ds, (0, 3), 50, 4, seed=0)
    out = gpt.samples(0, 50)
    assert out.shape == (50, 5) and set(out.ravel().tolist()) <= {1, 2, 3, 4, 5}
    for row in out:  # each sample is a window of the stream of whole documents
        text = " ".join(map(str, row))
        assert all(pair not in text for pair in ("1 3", "2 4", "3 5", "5 2"))
    with pytest.raises(DataError, match="holds no tokens"):
        GPTDataset(ds, (1, 2), 10, 4, seed=0)  # only the zero-length sequence


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    # Megatron-Core's rounding: each cumulative boundary rounded on its own.
    assert split_ranges(10, parse_split("1,1,1")) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges(49, parse_split("969,30,1")) == [(0, 47), (47, 49), (49, 49)]
    assert split_ranges(7, parse_split("100,0,0")) == [(0, 7), (7, 7), (7, 7)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2", "nan,1", "inf,1"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


def _megatron_core_split(split: str, n: int) -> list[tuple[int, int]]:
    """Megatron-Core's arithmetic (parse_and_normalize_split, convert_split_vector_to_split_matrix, and the
    builder's int(round(bookend * float(num_elements)))), restated here step by step."""
    import functools
    import re

    vector = list(map(float, re.findall(r"[.0-9]+", split)))
    vector += [0.0] * (3 - len(vector))
    vector = (np.array(vector, dtype=np.float64) / np.sum(np.array(vector, dtype=np.float64))).tolist()
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    out = []
    for lo, hi in zip(expansion[:-1], expansion[1:]):
        if hi <= lo:
            out.append(None)
        else:
            out.append((int(round(lo * float(n))), int(round(hi * float(n)))))
    return out


@pytest.mark.parametrize("split", ["969,30,1", "1,1,1", "98,2,0", "90,5,5", "7,2,1", "1", "3,1", "0.5,0.25,0.25"])
def test_split_ranges_match_megatron_core_for_many_sizes(split):
    for n in range(1, 400):
        ours = split_ranges(n, parse_split(split))
        theirs = _megatron_core_split(split, n)
        for o, t in zip(ours, theirs):
            if t is None:
                assert o[0] == o[1]
            else:
                assert o == t, (split, n)


def test_empty_split_is_an_error(indexed):
    with pytest.raises(DataError, match="no documents"):
        GPTDataset(indexed, (5, 5), 10, S, seed=1, split="valid")


def _reference_positions_and_docs(tokens: list[int], eod: int) -> tuple[list[int], list[int]]:
    pos, doc, p, d = [], [], 0, 0
    for t in tokens:
        pos.append(p)
        doc.append(d)
        p += 1
        if t == eod:
            p, d = 0, d + 1
    return pos, doc


def test_micro_batch_masks_and_positions():
    eod = 0
    rng = np.random.default_rng(3)
    samples = rng.integers(0, 5, size=(3, 21))  # many end-of-document tokens (0)
    plain = make_micro_batch(samples, BatchOptions(eod=eod))
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert plain["tokens"].tolist() == samples[:, :-1].tolist() and plain["labels"].tolist() == samples[:, 1:].tolist()
    assert plain["position_ids"].tolist() == [list(range(20))] * 3 and bool((plain["loss_mask"] == 1).all())
    full = make_micro_batch(samples, BatchOptions(eod=eod, reset_position_ids=True, reset_attention_mask=True,
                                                  eod_mask_loss=True))
    for r in range(3):
        pos, doc = _reference_positions_and_docs(samples[r, :-1].tolist(), eod)
        assert full["position_ids"][r].tolist() == pos
        assert full["document_ids"][r].tolist() == doc
        assert full["loss_mask"][r].tolist() == [0.0 if t == eod else 1.0 for t in samples[r, :-1]]
    assert full["document_ids"].dtype.is_floating_point is False and str(full["document_ids"].dtype) == "torch.int32"
    assert str(full["loss_mask"].dtype) == "torch.float32" and str(full["tokens"].dtype) == "torch.int64"


def test_padding_labels_leave_the_loss_as_megatron_cores_dataset_does():
    """megatron-core's GPTDataset zeroes the loss where the label is the tokenizer's padding id, unless that id
    is also another special token (then no label is masked): here the end-of-document id stands for that case."""
    samples = np.array([[5, 7, 7, 0, 3, 7], [7, 1, 2, 0, 7, 4]])
    masked = make_micro_batch(samples, BatchOptions(eod=0, pad=7))["loss_mask"]
    assert masked.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0]]
    for same_as_eod in (BatchOptions(eod=7, pad=7), BatchOptions(eod=0, pad=None)):
        assert bool((make_micro_batch(samples, same_as_eod)["loss_mask"] == 1).all())
    both = make_micro_batch(samples, BatchOptions(eod=0, pad=7, eod_mask_loss=True))["loss_mask"]
    assert both.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0]]


def test_out_of_vocabulary_tokens_are_reported():
    with pytest.raises(DataError, match="another tokenizer"):
        make_micro_batch(np.array([[1, 2, 300]]), BatchOptions(eod=0, vocab_size=258))


def test_flags_needing_an_end_of_document_token():
    with pytest.raises(DataError, match="--eod-mask-loss"):
        BatchOptions(eod=None, eod_mask_loss=True).check()


def test_building_in_blocks_gives_the_same_indices(indexed, monkeypatch):
    import meshtron.data.gpt_dataset as gd

    whole = GPTDataset(indexed, (0, 30), 123, S, seed=9)
    monkeypatch.setattr(gd, "SAMPLE_BLOCK", 7)
    blocked = GPTDataset(indexed, (0, 30), 123, S, seed=9)
    assert np.array_equal(whole.sample_index, blocked.sample_index)
    assert whole.sample_index.dtype == np.int32


def test_pickled_copies_reopen_the_cache_only_when_it_holds_these_arrays(indexed, tmp_path, monkeypatch):
    import pickle

    import meshtron.data.gpt_dataset as gd

    cache = tmp_path / "cache"
    ds = GPTDataset(indexed, (0, 30), 60, S, seed=1, cache_dir=cache)
    small = pickle.dumps(ds)
    assert np.array_equal(pickle.loads(small).samples(0, 60), ds.samples(0, 60))
    # A damaged cache that cannot be rewritten: the copy carries the rebuilt arrays, not the damaged files.
    shuffle = next(cache.glob("*-shuffle_index.npy"))
    arr = np.load(shuffle)
    np.save(shuffle, arr[::-1].copy())
    monkeypatch.setattr(gd, "save_npy_atomic", lambda *a: (_ for _ in ()).throw(PermissionError(13, "read-only")))
    rebuilt = GPTDataset(indexed, (0, 30), 60, S, seed=1, cache_dir=cache)
    copy = pickle.loads(pickle.dumps(rebuilt))
    assert len(pickle.dumps(rebuilt)) > len(small)
    assert np.array_equal(copy.samples(0, 60), ds.samples(0, 60))
