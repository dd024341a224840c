"""Blending datasets in exact proportions: ``--data-path 0.7 A 0.3 B``.

Each dataset ``d`` with normalised weight ``w_d`` owns the sequence of keys
``(k + 0.5) / w_d`` for its k-th sample, k = 0, 1, ...; the blend serves all samples in order of
(key, dataset). Among the first ``n`` blended samples, dataset ``d`` then has ``w_d * n`` samples
to within about ``(K + 1) / 2`` for K datasets, for every ``n``: the proportions never drift.

Nothing is materialised: :meth:`BlendSchedule.assign` finds which samples fill any window of
blended positions in ``O(K log)`` time by bisection on the key, so runs of any length cost no
memory and a resumed run lands on exactly the same samples. The assignment involves no
randomness; the seed enters through the shuffling of each blended dataset.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from meshtron.data.errors import DataError


def _keys(k: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Keys of samples ``k`` of datasets with weights ``w`` (one float expression, used everywhere)."""
    return (k.astype(np.float64) + 0.5) / w


class BlendSchedule:
    """Which dataset, and which of its samples, fills each blended position."""

    def __init__(self, weights: Sequence[float]) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise DataError(f"blend weights must be positive numbers, got {list(weights)}")
        self.weights = w / w.sum()
        self.num_datasets = int(w.size)

    def _count_below(self, t: float) -> np.ndarray:
        """Per dataset, how many of its keys are strictly below ``t``."""
        w = self.weights
        est = np.maximum(np.ceil(t * w - 0.5), 0).astype(np.int64)
        # The estimate is off by at most one from float rounding; settle it on the exact keys.
        for _ in range(4):
            high = (est > 0) & (_keys(np.maximum(est - 1, 0), w) >= t)
            low = _keys(est, w) < t
            if not (high.any() or low.any()):
                break
            est = est - high + low
        return est

    def _state_at(self, n: int) -> np.ndarray:
        """Per dataset, how many of its samples fill blended positions ``0 .. n-1``."""
        w = self.weights
        if n <= 0:
            return np.zeros(self.num_datasets, dtype=np.int64)
        if self.num_datasets == 1:
            return np.array([n], dtype=np.int64)
        # Bisection over the bit patterns of positive doubles (ordered like the values) for the
        # smallest key t with F(t) = #{keys <= t} >= n + 1: the key of position n.
        hi = float((n + 0.5) / w.max())
        while int(self._count_below(np.nextafter(hi, np.inf)).sum()) < n + 1:
            hi *= 2.0
        lo_bits, hi_bits = 0, int(np.float64(hi).view(np.int64))
        while lo_bits < hi_bits:
            mid = (lo_bits + hi_bits) // 2
            t = float(np.int64(mid).view(np.float64))
            if int(self._count_below(np.nextafter(t, np.inf)).sum()) >= n + 1:
                hi_bits = mid
            else:
                lo_bits = mid + 1
        t_n = float(np.int64(hi_bits).view(np.float64))
        below = self._count_below(t_n)
        # Datasets whose next key equals t_n tie at position(s) before..; ties go by dataset order.
        tied = np.flatnonzero(_keys(below, w) == t_n)
        ahead = n - int(below.sum())  # how many tied samples precede position n
        state = below.copy()
        state[tied[:ahead]] += 1
        return state

    def counts(self, n: int) -> np.ndarray:
        """Per dataset, the number of its samples among the first ``n`` blended samples."""
        return self._state_at(n)

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within that dataset) for blended positions ``start .. start + count - 1``."""
        if count <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.num_datasets == 1:
            return np.zeros(count, np.int64), np.arange(start, start + count, dtype=np.int64)
        w = self.weights
        first = self._state_at(start)
        # A window of `count` positions holds at most w_d * (count + K) + 2 samples of dataset d.
        m = np.ceil(w * (count + self.num_datasets)).astype(np.int64) + 2
        ds = np.repeat(np.arange(self.num_datasets, dtype=np.int64), m)
        ks = np.concatenate([first[d] + np.arange(m[d], dtype=np.int64) for d in range(self.num_datasets)])
        order = np.lexsort((ds, _keys(ks, w[ds])))[:count]
        ds, ks = ds[order], ks[order]
        # Guard: every dataset's first unconsidered sample must come after the last one taken.
        last_key, last_d = _keys(ks[-1:], w[ds[-1:]])[0], ds[-1]
        nxt = _keys(first + m, w)
        if np.any((nxt < last_key) | ((nxt == last_key) & (np.arange(self.num_datasets) < last_d))):
            raise RuntimeError("blend schedule window too small (internal error)")
        return ds, ks


class SampleSource(Protocol):
    """What the loader reads: a sized source of fixed-length token samples."""

    def __len__(self) -> int: ...

    def samples(self, start: int, count: int) -> np.ndarray: ...


class BlendedDataset:
    """Several datasets served in the exact proportions of their weights."""

    def __init__(self, datasets: Sequence[SampleSource], weights: Sequence[float], num_samples: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        self.datasets = list(datasets)
        self.schedule = BlendSchedule(weights)
        self.num_samples = int(num_samples)
        need = self.schedule.counts(self.num_samples)
        for d, (ds, n) in enumerate(zip(self.datasets, need)):
            if len(ds) < n:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples but the blend needs {int(n)}")

    def __len__(self) -> int:
        return self.num_samples

    def samples(self, start: int, count: int) -> np.ndarray:
        """Blended samples ``start .. start + count - 1``, shape (count, seq_length + 1)."""
        if start < 0 or start + count > self.num_samples:
            raise IndexError(f"samples [{start}, {start + count}) out of range: the blend has {self.num_samples}")
        ds, ks = self.schedule.assign(start, count)
        out = None
        for d in np.unique(ds):
            rows = np.flatnonzero(ds == d)
            # Within a window each dataset's samples are consecutive and in order.
            part = self.datasets[d].samples(int(ks[rows[0]]), rows.size)
            if out is None:
                out = np.empty((count, part.shape[1]), dtype=part.dtype)
            out[rows] = part
        return out
