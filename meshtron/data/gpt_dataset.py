"""GPT samples: fixed windows of ``seq_length + 1`` tokens cut from a shuffled stream of documents.

For one split of an indexed dataset (a contiguous range of its sequences, one per document) the
order of everything is a function of the seed and the epoch number only:

* document stream: epoch ``e`` contributes a permutation of the split's documents drawn from
  its own seed ``(seed, split, range, e)``; the stream is epoch 0's permutation, then epoch 1's,
  and so on without end;
* raw sample ``r`` is tokens ``[r * seq_length, (r + 1) * seq_length]`` of that stream (one token
  more than the sequence, for the shifted labels); it belongs to the epoch in which it starts, so
  epoch ``e`` owns raw samples ``[B(e), B(e + 1))`` with ``B(e) = ceil(e * tokens_per_epoch / seq_length)``;
* serving order: positions ``B(e) .. B(e + 1) - 1`` serve epoch ``e``'s raw samples in a
  permutation drawn from another seed of that epoch.

Nothing depends on the number of samples requested, so a longer run (more ``--train-iters``)
serves exactly the samples of a shorter one first: every prefix of the order is stable. Only whole
epochs are built: three index arrays (document index, sample index, shuffle index) made with
vectorised numpy and cached as ``.npy`` files under a key that hashes the split's sequence
lengths (the only part of the data they depend on), the seed, the split and the number of epochs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import zlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from meshtron.data.cache import dist_state, is_writable_dir, save_npy_atomic, stable_hash, user_cache_dir, \
    write_text_atomic
from meshtron.data.errors import DataError
from meshtron.data.indexed_dataset import IndexedDataset
from meshtron.errors import ConfigError
from meshtron.validation import parse_split as validate_split

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT_VERSION = 2
SAMPLE_BLOCK = 1 << 24  # samples per block when building the sample index
ARRAY_NAMES = ("document_index", "sample_index", "shuffle_index")
GIB = float(1 << 30)


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, or fewer numbers) -> three fractions that sum to 1. The syntax and its
    errors are the configuration check's (:func:`meshtron.validation.parse_split`)."""
    try:
        weights = validate_split(str(split))
    except ConfigError as err:  # as every data-path problem: a DataError (itself a ConfigError)
        raise DataError(str(err)) from None
    total = sum(weights)
    return [w / total for w in weights]  # normalised as Megatron-Core normalises


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ranges ``[begin, end)`` for train/valid/test, rounded as Megatron-Core rounds.

    The boundaries are the cumulative shares, each rounded on its own:
    ``begin = round(share_before * n)``, ``end = round((share_before + share) * n)``. (Megatron-LM's
    older ``get_train_valid_test_split_`` rounded each share and moved every boundary by the total
    rounding error; that gave, for 10 documents and ``1,1,1``, [0, 4) instead of [0, 3).)
    """
    bounds = [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + float(f))
    n = float(num_documents)
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        begin = min(int(round(lo * n)), num_documents)
        end = min(int(round(hi * n)), num_documents)
        ranges.append((begin, max(begin, end)))
    return ranges


def default_cache_dir(prefix: str) -> Path:
    """Beside the data (``DIR/cache/GPTDataset_indices``), or under the user's cache when that is read-only."""
    beside = Path(prefix).resolve().parent / "cache" / "GPTDataset_indices"
    if is_writable_dir(beside):
        return beside
    return user_cache_dir() / "GPTDataset_indices"


def epoch_starts(epochs: int, tokens_per_epoch: int, seq_length: int) -> np.ndarray:
    """``B(0) .. B(epochs)``: the first raw sample of each epoch, ``ceil(e * tokens_per_epoch / seq_length)``."""
    e = np.arange(epochs + 1, dtype=np.int64)
    return -(-(e * tokens_per_epoch) // seq_length)


def epochs_for(num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """The fewest whole epochs whose samples number at least ``num_samples``: ``B(E) >= num_samples``."""
    if num_samples <= 0:
        return 0
    return (num_samples - 1) * seq_length // tokens_per_epoch + 1


def available_memory() -> Optional[int]:
    """Bytes of memory available to this process (Linux ``MemAvailable``), else physical memory, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _digest(array: np.ndarray) -> str:
    """SHA-256 of an array's bytes (C order)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


def _warn_on_rank_zero(message: str, *args: object) -> None:
    if dist_state()[1] == 0:
        logger.warning(message, *args)


class GPTDataset:
    """Samples of ``seq_length + 1`` token ids from documents ``[begin, end)`` of an indexed dataset.

    Args:
        indexed: the indexed dataset.
        document_range: ``(begin, end)`` sequence ids of this split.
        num_samples: samples wanted (whole epochs are built as needed); None means one epoch.
        seq_length: tokens per training sequence (each sample has one more, for the shifted labels).
        seed: shuffling seed.
        split: "train", "valid" or "test" (part of the seeds and of the cache names).
        cache_dir: where the index arrays are cached; None keeps them in memory only.
        request: how the user asked for ``num_samples`` (e.g. "--train-iters 10 x --global-batch-size 8"),
            for the message that refuses a request too large to build.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: Optional[int],
                 seq_length: int, seed: int, split: str = "train", cache_dir: Optional[Path] = None,
                 request: Optional[str] = None) -> None:
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}")
        self.indexed = indexed
        self.begin, self.end = int(document_range[0]), int(document_range[1])
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split = split
        self.built_indices = False  # whether this process built (rather than loaded) the index arrays
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.end <= self.begin:
            raise DataError(f"dataset {indexed.prefix}: the {split} split has no documents "
                            f"(adjust --split or give a larger dataset)")
        lengths = indexed.sequence_lengths[self.begin:self.end]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        T, S = self.tokens_per_epoch, self.seq_length
        if T < 1:
            raise DataError(f"dataset {indexed.prefix}: the {split} split (sequences [{self.begin}, {self.end})) "
                            "holds no tokens")
        self.num_samples = -(-T // S) if num_samples is None else int(num_samples)
        self.epochs = epochs_for(self.num_samples, T, S)
        if T < S + 1:
            _warn_on_rank_zero("dataset %s: the %s split holds %d tokens, fewer than one sample of --seq-length %d "
                               "+ 1: every sample repeats its %d document(s) about %.0f times (give more data or a "
                               "smaller --seq-length)", indexed.prefix, split, T, S, self.end - self.begin,
                               (S + 1) / T)
        self.key = {"class": "GPTDataset", "version": INDEX_FORMAT_VERSION, "lengths_sha256": _digest(lengths),
                    "documents": [self.begin, self.end], "epochs": self.epochs, "seq_length": S, "seed": self.seed,
                    "split": split}
        self._cache_paths = self._paths() if self.cache_dir is not None else None
        self._load_or_build(request, indexed)

    def _load_or_build(self, request: Optional[str], indexed) -> None:
        """The index arrays from the cache when it holds exactly these, else built (and cached)."""
        arrays = self._load_cached(verify=True)
        self._on_disk = arrays is not None  # whether the cache files hold exactly these arrays
        if arrays is None:
            self._check_size(request)
            arrays = self._build()
            self.built_indices = True
            if self._cache_paths is not None:
                self._on_disk = self._save(arrays)
        self.document_index, self.sample_index, self.shuffle_index = arrays
        self._lengths = indexed.sequence_lengths

    # -- sizes ----------------------------------------------------------------------------------
    def _layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each index array for this many epochs."""
        T, S, m = self.tokens_per_epoch, self.seq_length, self.end - self.begin
        raw = -(-(self.epochs * T) // S)  # B(epochs): raw samples owned by the epochs built (Python ints: no overflow)
        doc_epochs = -(-(raw * S + 1) // T)  # documents whose tokens those samples need
        positions = doc_epochs * m
        return {
            "document_index": ((positions,), np.dtype(np.int32 if self.end < 2**31 else np.int64)),
            "sample_index": ((raw, 2), np.dtype(np.int32 if positions < 2**31 else np.int64)),
            "shuffle_index": ((raw,), np.dtype(np.int32 if raw < 2**31 else np.int64)),
        }

    def _check_size(self, request: Optional[str]) -> None:
        """Refuse, before allocating, a request whose index arrays cannot fit in memory."""
        layout = self._layout()
        positions = layout["document_index"][0][0]
        need = sum(math.prod(shape) * dt.itemsize for shape, dt in layout.values())
        need += positions * 12  # the temporary lengths and stream offsets of the build
        have = available_memory()
        if have is None or need <= have:
            return
        asked = f"{request} = " if request else ""
        per_epoch = -(-self.tokens_per_epoch // self.seq_length)
        raise DataError(f"{asked}{self.num_samples:,} {self.split} samples of --seq-length {self.seq_length} from "
                        f"{self.indexed.prefix} ({self.end - self.begin:,} documents, {self.tokens_per_epoch:,} tokens, "
                        f"{per_epoch:,} samples per epoch) would take {self.epochs:,} epochs and {need / GIB:,.1f} GiB "
                        f"of index arrays, more than the {have / GIB:,.1f} GiB of memory available: ask for fewer "
                        "samples or give more data")

    # -- identity and cache -------------------------------------------------------------------
    def _paths(self) -> dict[str, Path]:
        base = f"{stable_hash(self.key)}-{self.split}"
        paths = {n: self.cache_dir / f"{base}-{n}.npy" for n in ARRAY_NAMES}
        paths["description"] = self.cache_dir / f"{base}-description.json"
        return paths

    def is_cached(self) -> bool:
        """Whether the index arrays are on disk (the description file is written last)."""
        return self._cache_paths is not None and all(p.is_file() for p in self._cache_paths.values())

    def _load_cached(self, verify: bool) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The cached arrays, or None (with a warning when a cache file is unreadable or does not match).

        With ``verify``, the description must carry this dataset's key, and every array its recorded
        shape, dtype and SHA-256: a cache file that was truncated, corrupted or edited is rebuilt.
        """
        if not self.is_cached():
            return None
        p = self._cache_paths
        try:
            description = json.loads(p["description"].read_text(encoding="utf-8"))
            if verify and (not isinstance(description, dict) or description.get("key") != self.key):
                raise ValueError("its description does not match this dataset")
            layout = self._layout()
            arrays = []
            for name in ARRAY_NAMES:
                arr = np.load(p[name], mmap_mode="r", allow_pickle=False)
                shape, dtype = layout[name]
                if arr.shape != shape or arr.dtype != dtype:
                    raise ValueError(f"{p[name].name} has shape {arr.shape} and dtype {arr.dtype}, "
                                     f"expected {shape} and {dtype}")
                if verify and _digest(arr) != description["arrays"][name]["sha256"]:
                    raise ValueError(f"{p[name].name} does not match its recorded checksum")
                arrays.append(arr)
            return tuple(arrays)  # type: ignore[return-value]
        except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
            _warn_on_rank_zero("ignoring the dataset index cache %s-*: %s; rebuilding it",
                               p["description"].with_name(p["description"].name[:-len("-description.json")]), exc)
            return None

    def _save(self, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> bool:
        """Write the arrays and their description; False (with a warning) when the cache is not writable."""
        p = self._cache_paths
        description = {
            "key": self.key,
            "prefix": str(Path(self.indexed.prefix).resolve()),
            "arrays": {name: {"shape": list(arr.shape), "dtype": str(arr.dtype), "sha256": _digest(arr)}
                       for name, arr in zip(ARRAY_NAMES, arrays)},
        }
        try:
            for name, arr in zip(ARRAY_NAMES, arrays):
                save_npy_atomic(p[name], arr)
            write_text_atomic(p["description"], json.dumps(description, indent=2) + "\n")
        except OSError as exc:  # a read-only cache only costs a rebuild next time
            logger.warning("could not cache dataset indices in %s: %s", self.cache_dir, exc)
            return False
        return True

    # -- building -----------------------------------------------------------------------------
    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        split_code = zlib.crc32(self.split.encode())
        return np.random.default_rng([self.seed, split_code, self.begin, self.end, epoch, stream])

    def _permutation(self, epoch: int, stream: int, n: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of ``range(n)`` for ``stream`` (0 documents, 1 samples)."""
        if n <= 1:  # nothing to shuffle: skip the generator (tiny splits have many such epochs)
            return np.arange(n, dtype=np.int64)
        return self._rng(epoch, stream).permutation(n)

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        layout = self._layout()
        T, S, m = self.tokens_per_epoch, self.seq_length, self.end - self.begin
        (positions,), doc_dtype = layout["document_index"]
        (raw, _), sample_dtype = layout["sample_index"]
        order_dtype = layout["shuffle_index"][1]
        docs = np.arange(self.begin, self.end, dtype=np.int64)
        document_index = np.empty(positions, dtype=doc_dtype)
        for e in range(positions // m):
            document_index[e * m:(e + 1) * m] = docs[self._permutation(e, 0, m)]
        stream_offsets = np.zeros(positions + 1, dtype=np.int64)
        np.cumsum(self.indexed.sequence_lengths[document_index], dtype=np.int64, out=stream_offsets[1:])
        sample_index = np.empty((raw, 2), dtype=sample_dtype)
        for lo in range(0, raw, SAMPLE_BLOCK):  # in blocks, to bound temporary memory
            starts = np.arange(lo, min(lo + SAMPLE_BLOCK, raw), dtype=np.int64) * S
            # searchsorted 'right' skips empty documents: a sample starts inside a non-empty one.
            doc_pos = np.searchsorted(stream_offsets, starts, side="right") - 1
            sample_index[lo:lo + starts.size, 0] = doc_pos
            sample_index[lo:lo + starts.size, 1] = starts - stream_offsets[doc_pos]
        del stream_offsets
        bounds = epoch_starts(self.epochs, T, S)
        shuffle_index = np.empty(raw, dtype=order_dtype)
        for e in range(self.epochs):
            lo, hi = int(bounds[e]), int(bounds[e + 1])
            shuffle_index[lo:hi] = lo + self._permutation(e, 1, hi - lo)
        return document_index, sample_index, shuffle_index

    def __getstate__(self) -> dict:
        # Memory-mapped cached arrays are reopened by path rather than copied into the pickle.
        state = self.__dict__.copy()
        state["_lengths"] = None  # a view into the indexed dataset, which reopens its own files
        if self._on_disk:
            for name in ARRAY_NAMES:
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.document_index is None:
            # The pickling process verified the cache; a worker reopens it without hashing it again.
            arrays = self._load_cached(verify=False)
            if arrays is None:
                raise DataError(f"the dataset index cache in {self.cache_dir} disappeared or changed while in use")
            self.document_index, self.sample_index, self.shuffle_index = arrays
        self._lengths = self.indexed.sequence_lengths

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def _fill(self, out: np.ndarray, raw_index: int) -> None:
        """Write the tokens of raw sample ``raw_index`` into ``out`` (length seq_length + 1)."""
        pos, offset = (int(x) for x in self.sample_index[raw_index])
        need, filled = out.shape[0], 0
        while filled < need:
            seq = int(self.document_index[pos])
            take = min(int(self._lengths[seq]) - offset, need - filled)
            if take > 0:
                out[filled:filled + take] = self.indexed.get(seq, offset, take)
                filled += take
            pos += 1
            offset = 0

    def sample(self, i: int) -> np.ndarray:
        """Token ids of sample ``i`` (int64, length seq_length + 1)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range: the {self.split} dataset has {self.num_samples}")
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        self._fill(out, int(self.shuffle_index[i]))
        return out

    def samples(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start + count - 1`` as an int64 array of shape (count, seq_length + 1)."""
        if start < 0 or start + count > len(self):
            raise IndexError(f"samples [{start}, {start + count}) out of range: the {self.split} dataset has {len(self)}")
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for j, raw in enumerate(self.shuffle_index[start:start + count]):
            self._fill(out[j], int(raw))
        return out
