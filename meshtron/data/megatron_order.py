"""Megatron-Core's sample order (``--data-order megatron``): the batches Megatron-LM serves from the same data.

meshtron's own order (:mod:`meshtron.data.gpt_dataset`) is prefix-stable: a longer run serves a shorter
run's samples first. Megatron-Core's ``GPTDataset`` and ``BlendedDataset`` build theirs for the number of
samples asked for, so a run that moves between the two frameworks must build the same arrays to continue on
the same batches. This module builds them with numpy from the rules Megatron-Core documents and implements:

* split: document ``[round(a * n), round(b * n))`` for each split's share ``(a, b)`` of ``--split`` (a split
  with no share has no dataset);
* samples per split: ``--train-iters`` x global batch (or ``--train-samples``), validation
  ``(--train-iters // --eval-interval + 1) x --eval-iters`` x global batch (every evaluation continues where
  the previous one stopped), test ``--eval-iters`` x global batch;
* epochs: the fewest whose tokens cover ``num_samples * seq_length + 1``;
* document index: the split's documents repeated once per epoch and shuffled by one
  ``numpy.random.RandomState(--seed)``; when the last epoch contributes fewer than 80% of an epoch's samples,
  it is shuffled on its own after the others ("separate final epoch");
* sample index: the (document-index position, offset) where each sample of ``seq_length`` tokens starts in
  the concatenated documents, one row more than there are samples (each sample reads one extra token, the
  next sample's first, for the shifted labels);
* shuffle index: a permutation of the samples from the same random state (the final epoch's samples
  permuted separately when it is separate);
* blends: the dataset and dataset-sample indices of Megatron-Core's ``build_blending_indices`` (each
  position goes to the dataset furthest below its share), each dataset asked for
  ``ceil(ceil(size * weight) * 1.005)`` samples, prefixes without weights blended in proportion to their
  one-epoch sample counts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from meshtron.data.errors import DataError
from meshtron.data.gpt_dataset import GPTDataset, _digest
from meshtron.data.indexed_dataset import IndexedDataset

#: Megatron-Core's default ``mid_level_dataset_surplus``: a blended dataset asks each component for this much more.
MID_LEVEL_SURPLUS = 0.005
#: The final epoch is shuffled on its own when it contributes fewer than this share of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_BLOCK = 1 << 22  # sample-index rows per vectorised block (bounds temporary memory)
_INT32_MAX = int(np.iinfo(np.int32).max)
_UINT32_MAX = int(np.iinfo(np.uint32).max)


# ---------------------------------------------------------------------------------------------
# Split and sizes.
# ---------------------------------------------------------------------------------------------

def split_shares(split: str) -> list[float]:
    """``"969,30,1"`` -> the three normalised shares (missing ones are 0), as Megatron-Core parses ``--split``."""
    values = [float(x) for x in re.findall(r"[.0-9]+", str(split))]
    values = values + [0.0] * (3 - len(values))
    if len(values) != 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise DataError(f"--split {split}: expected up to three non-negative proportions with a positive sum")
    w = np.asarray(values, dtype=np.float64)
    return (w / w.sum()).tolist()


def split_document_ranges(num_documents: int, split: str) -> list[Optional[tuple[int, int]]]:
    """Per split (train, valid, test), the documents ``(begin, end)`` it owns, or None for a split with no share."""
    bounds = [0.0]
    for share in split_shares(split):
        bounds.append(bounds[-1] + share)
    out: list[Optional[tuple[int, int]]] = []
    n = float(num_documents)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            out.append(None)
        else:
            out.append((int(round(lo * n)), int(round(hi * n))))
    return out


def split_sample_counts(train_iters: int, global_batch_size: int, eval_iters: int, eval_interval: int,
                        train_samples: Optional[int] = None, skip_train: bool = False) -> tuple[int, int, int]:
    """Samples requested of the train, validation and test splits, by Megatron-LM's rule.

    Validation holds one ``--eval-iters`` batch block per evaluation: ``--train-iters // --eval-interval``
    during training plus the one after it (``--eval-interval 0``, which meshtron reads as "no periodic
    evaluation", counts as that last one only).
    """
    train = int(train_samples) if train_samples is not None else int(train_iters) * global_batch_size
    if skip_train or not eval_interval:
        points = 1
    else:
        points = int(train_iters) // int(eval_interval) + 1
    valid = points * max(int(eval_iters), 0) * global_batch_size
    test = max(int(eval_iters), 0) * global_batch_size
    return train, valid, test


def sizes_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples a weighted blend of ``size`` asks of each dataset (``surplus`` 0: the blend's own share)."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


# ---------------------------------------------------------------------------------------------
# The three index arrays of one dataset split.
# ---------------------------------------------------------------------------------------------

def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int, extra_token: bool = True) -> int:
    """The fewest epochs (at least one) whose tokens cover ``num_samples`` samples."""
    if num_samples is None:
        return 1
    need = int(num_samples) * int(seq_length) + int(extra_token)
    return max(1, -(-need // int(tokens_per_epoch)))


def final_epoch_plan(epochs: int, tokens_per_epoch: int, num_samples: Optional[int], seq_length: int,
                     extra_token: bool = True) -> tuple[bool, int]:
    """(whether the final epoch is shuffled separately, the samples of the epochs before it)."""
    if epochs == 1 or num_samples is None:
        return False, 0
    x = int(extra_token)
    before = ((epochs - 1) * tokens_per_epoch - x) // seq_length
    from_final = int(num_samples) - before
    per_epoch = (tokens_per_epoch - x) // seq_length
    if not 0 <= from_final <= per_epoch + 1:
        raise DataError(f"internal error: {from_final} samples from the final epoch of {per_epoch}")
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """The documents once per epoch, shuffled (int32); the final epoch apart when ``separate_final_epoch``."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents).astype(np.int32, copy=False), epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def sample_index_dtype(document_index_length: int, max_sequence_length: int) -> np.dtype:
    return np.dtype(np.int32 if max(document_index_length, max_sequence_length) <= _INT32_MAX else np.int64)


def num_index_samples(epochs: int, tokens_per_epoch: int, seq_length: int, drop_last: bool = True,
                      extra_token: bool = True) -> int:
    """Samples of the sample index (its rows less one)."""
    total = epochs * tokens_per_epoch - int(extra_token)
    if drop_last:
        return total // seq_length
    return int(math.ceil(float(np.float32(total) / np.float32(seq_length))))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, epochs: int,
                       tokens_per_epoch: int, drop_last: bool = True, extra_token: bool = True) -> np.ndarray:
    """Rows ``(document-index position, offset)`` where samples ``0 .. n`` start (vectorised).

    Sample ``i`` starts at token ``p = i * seq_length`` of the documents concatenated in ``document_index``
    order. Its row names the first position whose document ends at least ``extra_token`` tokens after ``p``
    (with the extra token, the document holding token ``p``; without it, a boundary may sit at a document's
    end), and the offset of ``p`` in that document. Row 0 is ``(0, 0)``. A last partial sample (``drop_last``
    False) ends at the last document's last token.
    """
    x = int(extra_token)
    n = num_index_samples(epochs, tokens_per_epoch, seq_length, drop_last, extra_token)
    dtype = sample_index_dtype(len(document_index), int(sizes.max()) if len(sizes) else 0)
    ends = np.empty(len(document_index), dtype=np.int64)  # ends[k]: tokens up to the end of position k
    np.cumsum(np.asarray(sizes)[document_index], dtype=np.int64, out=ends)
    out = np.empty((n + 1, 2), dtype=dtype)
    for lo in range(0, n + 1, _BLOCK):
        pos = np.arange(lo, min(lo + _BLOCK, n + 1), dtype=np.int64) * seq_length
        k = np.searchsorted(ends, pos + x, side="left")
        past = k >= len(ends)  # only a last partial sample can reach past the documents
        k_in = np.minimum(k, len(ends) - 1)
        starts = ends[k_in] - np.asarray(sizes)[document_index[k_in]]
        offset = pos - starts
        if past.any():
            last = len(document_index) - 1
            k_in = np.where(past, last, k_in)
            offset = np.where(past, int(sizes[document_index[last]]) - x, offset)
        out[lo:lo + pos.size, 0] = k_in
        out[lo:lo + pos.size, 1] = offset
    out[0] = (0, 0)
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < _UINT32_MAX - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int,
                      seed: int, drop_last: bool = True,
                      extra_token: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle index of a split holding ``documents`` of a dataset of sequence ``sizes``."""
    tokens = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    if tokens < 1:
        raise DataError("the split holds no tokens")
    epochs = num_epochs(tokens, num_samples, seq_length, extra_token)
    separate, before = final_epoch_plan(epochs, tokens, num_samples, seq_length, extra_token)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs, tokens, drop_last, extra_token)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


# ---------------------------------------------------------------------------------------------
# Blending.
# ---------------------------------------------------------------------------------------------

def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index int16, dataset-sample index int64) of a blend of ``size`` samples.

    Position ``s`` goes to the dataset ``d`` with the largest ``weights[d] * max(s, 1) - taken[d]`` (the
    first such on ties), ``taken[d]`` counting its positions before ``s``, computed in float64 as
    Megatron-Core computes it. Each choice depends on all earlier ones, so this is one loop over the
    positions (about 2 million per second with a few datasets on one CPU core; the arrays are written in
    blocks, so memory stays that of the two results).
    """
    w = [float(x) for x in weights]
    K = len(w)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if K == 1:
        dataset_sample_index[:] = np.arange(size, dtype=np.int64)
        return dataset_index, dataset_sample_index
    taken = [0] * K
    others = range(1, K)
    block = 1 << 20
    for lo in range(0, size, block):
        hi = min(size, lo + block)
        chosen = [0] * (hi - lo)
        counts = [0] * (hi - lo)
        if K <= 32:
            for j, s in enumerate(range(lo, hi)):
                x = float(s) if s > 1 else 1.0
                best, best_error = 0, w[0] * x - taken[0]
                for d in others:
                    error = w[d] * x - taken[d]
                    if error > best_error:
                        best, best_error = d, error
                chosen[j] = best
                counts[j] = taken[best]
                taken[best] += 1
        else:  # many datasets: one vectorised argmax per position
            wv = np.asarray(w, dtype=np.float64)
            tv = np.asarray(taken, dtype=np.int64)
            for j, s in enumerate(range(lo, hi)):
                best = int(np.argmax(wv * max(float(s), 1.0) - tv.astype(np.float64)))
                chosen[j] = best
                counts[j] = int(tv[best])
                tv[best] += 1
            taken = tv.tolist()
        dataset_index[lo:hi] = chosen
        dataset_sample_index[lo:hi] = counts
    return dataset_index, dataset_sample_index


# ---------------------------------------------------------------------------------------------
# Datasets: what the loader reads.
# ---------------------------------------------------------------------------------------------

class MegatronGPTDataset(GPTDataset):
    """Samples of one split in Megatron-Core's ``GPTDataset`` order (cached like meshtron's own arrays).

    ``num_samples`` None builds one epoch (Megatron's unweighted blends do); the dataset then holds every sample
    the built epochs yield (``len``), at least ``num_samples``.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: Optional[int],
                 seq_length: int, seed: int, split: str = "train", cache_dir: Optional[Path] = None,
                 request: Optional[str] = None) -> None:
        self.indexed = indexed
        self.begin, self.end = int(document_range[0]), int(document_range[1])
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split = split
        self.built_indices = False
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.end <= self.begin:
            raise DataError(f"dataset {indexed.prefix}: the {split} split has no documents "
                            "(adjust --split or give a larger dataset)")
        lengths = indexed.sequence_lengths[self.begin:self.end]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        if self.tokens_per_epoch < 2:
            raise DataError(f"dataset {indexed.prefix}: the {split} split (sequences [{self.begin}, {self.end})) "
                            "holds fewer than 2 tokens")
        self.requested = None if num_samples is None else int(num_samples)
        self.epochs = num_epochs(self.tokens_per_epoch, self.requested, self.seq_length)
        self.num_samples = num_index_samples(self.epochs, self.tokens_per_epoch, self.seq_length)
        self._max_length = int(indexed.sequence_lengths.max()) if len(indexed.sequence_lengths) else 0
        self.key = {"class": "MegatronGPTDataset", "version": 1, "lengths_sha256": _digest(lengths),
                    "documents": [self.begin, self.end], "num_samples": self.requested, "seq_length": self.seq_length,
                    "seed": self.seed, "split": split, "max_length_int32": self._max_length <= _INT32_MAX}
        self._cache_paths = self._paths() if self.cache_dir is not None else None
        self._load_or_build(request, indexed)

    def _layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        positions = self.epochs * (self.end - self.begin)
        n = self.num_samples
        return {
            "document_index": ((positions,), np.dtype(np.int32)),
            "sample_index": ((n + 1, 2), sample_index_dtype(positions, self._max_length)),
            "shuffle_index": ((n,), np.dtype(np.uint32 if n < _UINT32_MAX - 1 else np.int64)),
        }

    def _paths(self) -> dict[str, Path]:
        paths = super()._paths()
        return {name: p.with_name(p.name.replace(f"-{self.split}-", f"-{self.split}-megatron-", 1))
                for name, p in paths.items()}

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        documents = np.arange(self.begin, self.end, dtype=np.int32)
        return build_gpt_indices(self.indexed.sequence_lengths, documents, self.requested, self.seq_length,
                                 self.seed)


class MegatronBlendedDataset:
    """Several datasets served by Megatron-Core's blending indices."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, split: str = "train") -> None:
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        used, counts = np.unique(self.dataset_index, return_counts=True)
        for d, count in zip(used, counts):
            if len(self.datasets[d]) < count:
                raise DataError(f"the {split} blend needs {int(count)} samples of "
                                f"{getattr(self.datasets[d].indexed, 'prefix', d)}, which yields "
                                f"{len(self.datasets[d])}")

    def __len__(self) -> int:
        return self.size

    def samples(self, start: int, count: int) -> np.ndarray:
        if start < 0 or start + count > self.size:
            raise IndexError(f"samples [{start}, {start + count}) out of range: the blend has {self.size}")
        ds = self.dataset_index[start:start + count]
        ks = self.dataset_sample_index[start:start + count]
        out = None
        for d in np.unique(ds):
            rows = np.flatnonzero(ds == d)
            first = int(ks[rows[0]])  # a dataset's samples are consecutive within any window
            part = self.datasets[int(d)].samples(first, rows.size)
            if out is None:
                out = np.empty((count, part.shape[1]), dtype=part.dtype)
            out[rows] = part
        return out
