"""Synthetic data for benchmarks: uniformly random token ids, reproducible per sample."""

from __future__ import annotations

import zlib

import numpy as np

from meshtron.data.errors import DataError


class MockDataset:
    """``num_samples`` samples of ``seq_length + 1`` random ids below ``vocab_size``.

    Sample ``i`` depends only on (seed, split, i), so any sample can be produced on its own, in
    any process, in any order.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, split: str, num_samples: int) -> None:
        if not vocab_size or vocab_size < 2:
            raise DataError("--mock-data needs --vocab-size (the number of token ids to draw from), e.g. --vocab-size 32000")
        self.vocab_size = int(vocab_size)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split = split
        self.num_samples = int(num_samples)
        self._split_code = zlib.crc32(split.encode())

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        """Token ids of sample ``i`` (int64, length seq_length + 1)."""
        rng = np.random.default_rng([self.seed, self._split_code, int(i)])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)

    def samples(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start + count - 1``, shape (count, seq_length + 1)."""
        if start < 0 or start + count > self.num_samples:
            raise IndexError(f"samples [{start}, {start + count}) out of range: "
                             f"the mock {self.split} set has {self.num_samples}")
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for j in range(count):
            out[j] = self.sample(start + j)
        return out
