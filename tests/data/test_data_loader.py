"""The per-rank loader: DP-invariant sample order, resumption, mock data, build_data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _data_helpers import small_config, write_jsonl
from meshtron.data import build_data
from meshtron.data.batching import BatchOptions
from meshtron.data.errors import DataError
from meshtron.data.loader import RankSampler, iterate, prefetch
from meshtron.data.mock import MockDataset
from meshtron.data.preprocess import TokenizerArgs, preprocess


def _global_batch(batches_by_rank: list[list[dict]], key: str = "tokens") -> torch.Tensor:
    """Concatenate the micro-batches of all ranks, rank after rank, into one global batch."""
    return torch.cat([mb[key] for rank in batches_by_rank for mb in rank])


@pytest.mark.parametrize("mbs", [1, 2])
def test_union_over_dp_ranks_equals_the_dp1_global_batch(mbs):
    G, iters = 8, 5
    ds = MockDataset(500, 16, seed=3, split="train", num_samples=G * iters)
    reference = [RankSampler(ds, G, G, 0, 1, BatchOptions()).iteration(i)[0]["tokens"] for i in range(iters)]
    assert reference[0].tolist() == torch.from_numpy(ds.samples(0, G)[:, :-1]).tolist()
    for dp in (1, 2, 4):
        samplers = [RankSampler(ds, G, mbs, r, dp, BatchOptions()) for r in range(dp)]
        for i in range(iters):
            per_rank = [s.iteration(i) for s in samplers]
            assert all(len(batches) == G // (dp * mbs) for batches in per_rank)
            assert torch.equal(_global_batch(per_rank), reference[i])


def test_resuming_gives_the_same_batches():
    ds = MockDataset(500, 16, seed=3, split="train", num_samples=8 * 10)
    sampler = RankSampler(ds, 8, 2, 1, 2, BatchOptions())
    full = list(iterate(sampler, 0, 10))
    resumed = list(iterate(sampler, 6, 10))
    assert len(full) == 10 and len(resumed) == 4
    for a, b in zip(full[6:], resumed):
        for x, y in zip(a, b):
            assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])


def test_worker_processes_give_the_same_batches_as_the_thread():
    ds = MockDataset(500, 16, seed=4, split="train", num_samples=8 * 6)
    sampler = RankSampler(ds, 8, 2, 0, 2, BatchOptions())
    threaded = list(iterate(sampler, 1, 6, num_workers=0))
    workers = list(iterate(sampler, 1, 6, num_workers=1))
    assert len(threaded) == len(workers) == 5
    for a, b in zip(threaded, workers):
        assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))


def test_prefetch_propagates_errors_and_stops_when_abandoned():
    def produce(i):
        if i == 3:
            raise ValueError("boom at 3")
        return i

    it = prefetch(produce, range(10))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(ValueError, match="boom at 3"):
        next(it)
    abandoned = prefetch(lambda i: i, range(1000), depth=1)
    assert next(abandoned) == 0
    abandoned.close()  # the producer thread notices and ends


def test_mock_data_is_deterministic_per_sample():
    a = MockDataset(100, 8, seed=1, split="train", num_samples=50)
    b = MockDataset(100, 8, seed=1, split="train", num_samples=50)
    assert np.array_equal(a.samples(10, 5), b.samples(10, 5))
    assert np.array_equal(a.samples(10, 5)[2], a.sample(12))
    assert not np.array_equal(a.sample(0), MockDataset(100, 8, seed=1, split="valid", num_samples=1).sample(0))
    assert a.samples(0, 50).max() < 100


def test_build_data_mock():
    cfg = small_config(mock_data=True, vocab_size=1000)
    bundle = build_data(cfg, 1, 2)
    assert bundle.tokenizer is None and bundle.vocab_size == 1000 and bundle.eod is None
    batches = list(bundle.train_batches(18))
    assert len(batches) == 2 and len(batches[0]) == 2  # iterations 18, 19; 8 / (2 ranks x 2) micro-batches
    mb = batches[0][0]
    assert mb["tokens"].shape == (2, 16) and mb["tokens"].dtype == torch.int64
    assert mb["loss_mask"].dtype == torch.float32 and mb["position_ids"].dtype == torch.int64
    valid1 = [m["tokens"] for it in bundle.valid_batches() for m in it]
    valid2 = [m["tokens"] for it in bundle.valid_batches() for m in it]
    assert len(valid1) == 4 and all(torch.equal(a, b) for a, b in zip(valid1, valid2))
    with pytest.raises(DataError, match="--vocab-size"):
        build_data(small_config(mock_data=True), 0, 1)


def _make_dataset(tmp_path, name: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    docs = [" ".join(str(x) for x in rng.integers(0, 50, rng.integers(3, 40))) for _ in range(n)]
    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
    preprocess([str(src)], str(tmp_path / name), TokenizerArgs("NullTokenizer", vocab_size=51), append_eod=True,
               progress=False)
    return str(tmp_path / f"{name}_text_document")


def test_build_data_from_files_blend_split_and_document_ids(tmp_path):
    a, b = _make_dataset(tmp_path, "a", 200, 1), _make_dataset(tmp_path, "b", 100, 2)
    cfg = small_config(data_path=["0.7", a, "0.3", b], tokenizer_type="NullTokenizer", vocab_size=51,
                       split="90,10,0", reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True,
                       data_cache_path=str(tmp_path / "idx-cache"))
    bundle = build_data(cfg, 0, 1)
    assert bundle.vocab_size == 51 and bundle.eod == 50 and bundle.test is None
    assert len(bundle.train) == 20 * 8 and len(bundle.valid) == 2 * 8
    first = next(bundle.train_batches(0))
    mb = first[0]
    assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    eods = mb["tokens"] == 50
    assert bool((mb["loss_mask"][eods] == 0).all())
    # Resuming: a new bundle (as after a restart) serves the same iteration 7.
    again = build_data(cfg, 0, 1)
    x = list(bundle.train_batches(7))[0]
    y = next(again.train_batches(7))
    assert all(torch.equal(p["tokens"], q["tokens"]) for p, q in zip(x, y))
    assert not any(ds.built_indices for ds in again.train.datasets)  # loaded from the cache


def test_build_data_separate_paths_and_errors(tmp_path):
    a, b = _make_dataset(tmp_path, "a", 60, 1), _make_dataset(tmp_path, "b", 30, 2)
    cfg = small_config(train_data_path=[a], valid_data_path=[b], tokenizer_type="NullTokenizer", vocab_size=51)
    bundle = build_data(cfg, 0, 1)
    assert bundle.train.indexed.prefix == a and bundle.valid.indexed.prefix == b and bundle.test is None
    with pytest.raises(DataError, match="not both"):
        build_data(small_config(data_path=[a], train_data_path=[b], tokenizer_type="NullTokenizer",
                                vocab_size=51), 0, 1)
    with pytest.raises(DataError, match="pairs"):
        build_data(small_config(data_path=["0.5", a, "0.5"], tokenizer_type="NullTokenizer", vocab_size=51), 0, 1)
    with pytest.raises(DataError, match="not found"):
        build_data(small_config(data_path=[str(tmp_path / "nope")], tokenizer_type="NullTokenizer",
                                vocab_size=51), 0, 1)
    # Data made with ids up to 50, read with a 10-token vocabulary: refused on the first batch.
    wrong = build_data(small_config(data_path=[a], tokenizer_type="NullTokenizer", vocab_size=10), 0, 1)
    with pytest.raises(DataError, match="another tokenizer"):
        next(wrong.train_batches(0))


def test_non_data_ranks_read_nothing(tmp_path):
    bundle = build_data(small_config(mock_data=True, vocab_size=100), 0, 2, is_data_rank=False)
    items = list(bundle.train_batches(15))
    assert len(items) == 5 and items[0] == [{}, {}]
    assert len(list(bundle.valid_batches())) == 2


def _train_tokens(bundle, iterations: int) -> list[torch.Tensor]:
    return [torch.cat([mb["tokens"] for mb in it]) for it in list(bundle.train_batches(0))[:iterations]]


@pytest.mark.parametrize("blend", [False, True])
def test_a_longer_run_serves_the_shorter_runs_samples_first(tmp_path, blend):
    """--train-iters 6 then 12 (a run extended after a checkpoint): the first 6 iterations see the same data,
    with one dataset and with a blend, also once the longer run needs more epochs than the shorter."""
    a, b = _make_dataset(tmp_path, "a", 30, 1), _make_dataset(tmp_path, "b", 20, 2)
    paths = ["0.6", a, "0.4", b] if blend else [a]
    common = dict(data_path=paths, tokenizer_type="NullTokenizer", vocab_size=51, split="100,0,0",
                  data_cache_path=str(tmp_path / "idx"))
    short = build_data(small_config(train_iters=6, **common), 0, 1)
    long = build_data(small_config(train_iters=60, **common), 0, 1)
    parts = short.train.datasets if blend else [short.train]
    assert max(ds.epochs for ds in (long.train.datasets if blend else [long.train])) > max(ds.epochs for ds in parts)
    for x, y in zip(_train_tokens(short, 6), _train_tokens(long, 6)):
        assert torch.equal(x, y)


def test_an_impossible_request_names_the_flags(tmp_path):
    a = _make_dataset(tmp_path, "a", 30, 1)
    cfg = small_config(data_path=[a], tokenizer_type="NullTokenizer", vocab_size=51, train_iters=10**12)
    with pytest.raises(DataError, match=r"--train-iters 1000000000000 x --global-batch-size 8 = 8,000,000,000,000 "
                                        r"train samples .* GiB of index arrays, more than"):
        build_data(cfg, 0, 1)


@pytest.mark.parametrize("paths, message", [
    (["0.5", "{a}", "x", "{a}"], "expected a weight before '.*a_text_document', got 'x'"),
    (["0.5", "{a}", "-0.5", "{a}"], "the weight of '.*' is -0.5; weights must be finite numbers >= 0"),
    (["0", "{a}", "0.0", "{a}"], "the weights 0 0.0 add up to 0; give at least one positive weight"),
    (["nan", "{a}", "1", "{a}"], "the weight of '.*' is nan; weights must be finite numbers >= 0"),
    (["inf", "{a}"], "the weight of '.*' is inf; weights must be finite"),
    (["{a}", "0.5", "{a}"], "'0.5' looks like a weight, but the first value '.*' is not a number"),
    (["0.5", "{a}", "0.5"], "weighted prefixes come in pairs 'WEIGHT PREFIX', got 3 values"),
])
def test_bad_data_path_weights(tmp_path, paths, message):
    a = _make_dataset(tmp_path, "a", 30, 1)
    cfg = small_config(data_path=[p.replace("{a}", a) for p in paths], tokenizer_type="NullTokenizer", vocab_size=51)
    with pytest.raises(DataError, match="--data-path: " + message):
        build_data(cfg, 0, 1)


def test_weights_in_one_string_and_zero_weights(tmp_path):
    """``--data-path "0.7 A 0.3 B"`` (one YAML string) is a blend; a dataset of weight 0 is left out."""
    a, b = _make_dataset(tmp_path, "a", 30, 1), _make_dataset(tmp_path, "b", 20, 2)
    common = dict(tokenizer_type="NullTokenizer", vocab_size=51, split="100,0,0")
    one_string = build_data(small_config(data_path=[f"0.7 {a} 0.3 {b}"], **common), 0, 1)
    separate = build_data(small_config(data_path=["0.7", a, "0.3", b], **common), 0, 1)
    assert all(torch.equal(x, y) for x, y in zip(_train_tokens(one_string, 3), _train_tokens(separate, 3)))
    only_a = build_data(small_config(data_path=["1", a, "0", b], **common), 0, 1)
    plain_a = build_data(small_config(data_path=[a], **common), 0, 1)
    assert all(torch.equal(x, y) for x, y in zip(_train_tokens(only_a, 3), _train_tokens(plain_a, 3)))
