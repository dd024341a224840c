"""Exact blend proportions, window consistency, and the blended dataset's samples."""

from __future__ import annotations

import numpy as np
import pytest

from meshtron.data.blended import BlendedDataset, BlendSchedule
from meshtron.data.errors import DataError
from meshtron.data.mock import MockDataset

WEIGHTS = [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.2, 0.05], [0.001, 1.0], [3, 7, 11, 13, 17]]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_proportions_exact_over_10000_samples_and_every_prefix(weights):
    sched = BlendSchedule(weights)
    ds, ks = sched.assign(0, 10_000)
    w = np.asarray(weights) / np.sum(weights)
    counts = np.bincount(ds, minlength=len(weights))
    assert np.all(np.abs(counts / 10_000 - w) <= 0.005)
    # No drift: after every prefix, each dataset is within (K + 1) / 2 samples of its exact share.
    cum = np.cumsum(np.eye(len(weights), dtype=np.int64)[ds], axis=0)
    exact = np.arange(1, 10_001)[:, None] * w
    assert np.abs(cum - exact).max() <= (len(weights) + 1) / 2
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for d in range(len(weights)):
        assert ks[ds == d].tolist() == list(range(counts[d]))
    assert sched.counts(10_000).tolist() == counts.tolist()


@pytest.mark.parametrize("weights", WEIGHTS)
def test_any_window_matches_the_full_assignment(weights):
    sched = BlendSchedule(weights)
    ds, ks = sched.assign(0, 5_000)
    rng = np.random.default_rng(0)
    for start in [0, 1, 2, 4_990] + rng.integers(0, 4_900, 20).tolist():
        wd, wk = sched.assign(start, 64 if start < 4_936 else 5_000 - start)
        assert np.array_equal(wd, ds[start:start + wd.size]) and np.array_equal(wk, ks[start:start + wk.size])


def test_far_positions_stay_exact():
    sched = BlendSchedule([0.7, 0.2, 0.1])
    n = 10**12
    counts = sched.counts(n)
    assert counts.sum() == n and np.all(np.abs(counts - np.array([0.7, 0.2, 0.1]) * n) <= 2)
    ds, ks = sched.assign(n, 1000)
    assert np.all(ks[ds == 0] == counts[0] + np.arange((ds == 0).sum()))


def test_bad_weights():
    for bad in ([], [0.5, 0], [-1, 2], [float("nan")]):
        with pytest.raises(DataError, match="positive"):
            BlendSchedule(bad)


def test_blended_dataset_serves_each_sources_samples_in_order():
    sources = [MockDataset(1000, 4, seed=s, split="train", num_samples=800) for s in range(3)]
    weights = [0.5, 0.3, 0.2]
    blend = BlendedDataset(sources, weights, 1000)
    out = blend.samples(100, 50)
    ds, ks = blend.schedule.assign(100, 50)
    for row, (d, k) in enumerate(zip(ds, ks)):
        assert np.array_equal(out[row], sources[d].sample(k))
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset(sources, [0.9, 0.05, 0.05], 1000)  # source 0 would need 900 of its 800 samples
