"""GPT samples: windows across documents, epochs, seeded shuffles, caching, splits, masks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshtron.data.batching import BatchOptions, make_micro_batch
from meshtron.data.errors import DataError
from meshtron.data.gpt_dataset import GPTDataset, parse_split, split_ranges
from meshtron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

S = 8


@pytest.fixture()
def indexed(tmp_path) -> IndexedDataset:
    """30 documents of varied lengths (two empty); token j of document k is k * 100 + j."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 25, size=30)
    lengths[[4, 17]] = 0
    with IndexedDatasetWriter(tmp_path / "docs", np.int32) as w:
        for k, n in enumerate(lengths):
            w.add_document(k * 100 + np.arange(n))
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
    epochs = len(ds.document_index) // per_epoch
    tokens = int(indexed.sequence_lengths[3:27].sum())
    assert epochs == -(-(300 * S + 1) // tokens)
    for e in range(epochs):
        assert sorted(ds.document_index[e * per_epoch:(e + 1) * per_epoch].tolist()) == list(range(3, 27))
    # Samples are served in epoch order: the raw samples that start in epoch e come before those of e + 1.
    epoch_of = (np.asarray(ds.shuffle_index) * S) // tokens
    assert np.all(np.diff(epoch_of) >= 0)
    assert sorted(ds.shuffle_index.tolist()) == list(range(300))


def test_seed_determines_order_and_longer_runs_keep_earlier_epochs(indexed):
    a = GPTDataset(indexed, (0, 30), 150, S, seed=5)
    b = GPTDataset(indexed, (0, 30), 150, S, seed=5)
    c = GPTDataset(indexed, (0, 30), 150, S, seed=6)
    assert np.array_equal(a.samples(0, 150), b.samples(0, 150))
    assert not np.array_equal(a.samples(0, 150), c.samples(0, 150))
    # Samples that start in the first two epochs: served identically by a run of 2+ and one of 4+ epochs.
    tokens = int(indexed.sequence_lengths.sum())
    first_two = -(-2 * tokens // S)
    shorter = GPTDataset(indexed, (0, 30), first_two + 5, S, seed=5)
    longer = GPTDataset(indexed, (0, 30), 4 * first_two, S, seed=5)
    assert len(longer.document_index) > len(shorter.document_index)
    assert np.array_equal(shorter.samples(0, first_two), longer.samples(0, first_two))


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
    assert desc["num_samples"] == 100 and desc["seq_length"] == S and desc["documents"] == [0, 30]
    # Another sequence length is another cache entry.
    assert GPTDataset(indexed, (0, 30), 100, S + 1, seed=1, split="valid", cache_dir=cache).built_indices


def test_one_epoch_when_no_sample_count_is_given(indexed):
    ds = GPTDataset(indexed, (0, 30), None, S, seed=1)
    assert len(ds) == (int(indexed.sequence_lengths.sum()) - 1) // S


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    # Megatron's rounding: the rounding difference shifts every boundary after the first.
    assert split_ranges(10, parse_split("1,1,1")) == [(0, 4), (4, 7), (7, 10)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


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
