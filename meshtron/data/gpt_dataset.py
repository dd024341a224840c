"""GPT samples: fixed windows of ``seq_length + 1`` tokens cut from a shuffled stream of documents.

For one split of an indexed dataset (a contiguous range of its documents) three index arrays are
built once, with vectorised numpy, and cached as ``.npy`` files:

* document index: the split's documents in a seeded random order, one permutation per epoch,
  as many epochs as the requested number of samples needs;
* sample index: for sample ``i`` (which starts at token ``i * seq_length`` of the stream of
  documents in document-index order) the position in the document index and the offset inside
  that document where it starts;
* shuffle index: the order in which samples are served: a seeded permutation of the samples that
  start in each epoch, epoch after epoch, so that no document repeats before every document of
  the split has been seen once.

Sample ``i`` is therefore fully determined by the seed, the data, the split and the sequence
length; each epoch's permutation is drawn from its own seed, so asking for more samples later
leaves the order of the earlier complete epochs unchanged.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from meshtron.data.cache import is_writable_dir, save_npy_atomic, stable_hash, user_cache_dir, write_text_atomic
from meshtron.data.errors import DataError
from meshtron.data.indexed_dataset import IndexedDataset, data_path, index_path

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT_VERSION = 1
SAMPLE_BLOCK = 1 << 24  # samples per block when building the sample index


def parse_split(split: str, flag: str = "--split") -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, or fewer numbers) -> three fractions that sum to 1."""
    text = str(split).replace("/", ",")
    try:
        parts = [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise DataError(f"{flag} {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"{flag} {split!r}: expected up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges ``[begin, end)`` for train/valid/test (Megatron's rounding)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_documents)))
    # Rounding may over- or undershoot by a document: the last range absorbs the difference.
    diff = bounds[-1] - num_documents
    bounds = [b - diff if i > 0 else b for i, b in enumerate(bounds)]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def default_cache_dir(prefix: str) -> Path:
    """Beside the data (``DIR/cache/GPTDataset_indices``), or under the user's cache when that is read-only."""
    beside = Path(prefix).resolve().parent / "cache" / "GPTDataset_indices"
    if is_writable_dir(beside):
        return beside
    return user_cache_dir() / "GPTDataset_indices"


class GPTDataset:
    """Samples of ``seq_length + 1`` token ids from documents ``[begin, end)`` of an indexed dataset.

    Args:
        indexed: the indexed dataset.
        document_range: ``(begin, end)`` sequence ids of this split.
        num_samples: samples wanted (epochs are added as needed); None means one epoch.
        seq_length: tokens per training sequence (each sample has one more, for the shifted labels).
        seed: shuffling seed.
        split: "train", "valid" or "test" (part of the seeds and of the cache names).
        cache_dir: where the index arrays are cached; None keeps them in memory only.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: Optional[int],
                 seq_length: int, seed: int, split: str = "train", cache_dir: Optional[Path] = None) -> None:
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}")
        self.indexed = indexed
        self.begin, self.end = int(document_range[0]), int(document_range[1])
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split = split
        self.requested = num_samples
        self.built_indices = False  # whether this process built (rather than loaded) the index arrays
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.end <= self.begin:
            raise DataError(f"dataset {indexed.prefix}: the {split} split has no documents "
                            f"(adjust --split or give a larger dataset)")
        self.description = self._describe()
        self._cache_paths = self._paths() if self.cache_dir is not None else None
        arrays = self._load_cached()
        if arrays is None:
            arrays = self._build()
            self.built_indices = True
            if self._cache_paths is not None:
                self._save(arrays)
        self.document_index, self.sample_index, self.shuffle_index = arrays
        self._lengths = indexed.sequence_lengths

    # -- identity and cache -------------------------------------------------------------------
    def _describe(self) -> dict:
        idx, binp = index_path(self.indexed.prefix), data_path(self.indexed.prefix)
        return {
            "class": "GPTDataset", "version": INDEX_FORMAT_VERSION,
            "prefix": str(Path(self.indexed.prefix).resolve()),
            "idx_bytes": idx.stat().st_size, "bin_bytes": binp.stat().st_size,
            "num_sequences": len(self.indexed), "documents": [self.begin, self.end],
            "num_samples": self.requested, "seq_length": self.seq_length, "seed": self.seed, "split": self.split,
        }

    def _paths(self) -> dict[str, Path]:
        base = f"{stable_hash(self.description)}-{self.split}"
        names = ("document_index", "sample_index", "shuffle_index")
        paths = {n: self.cache_dir / f"{base}-{n}.npy" for n in names}
        paths["description"] = self.cache_dir / f"{base}-description.json"
        return paths

    def is_cached(self) -> bool:
        """Whether the index arrays are on disk (the description file is written last)."""
        return self._cache_paths is not None and all(p.is_file() for p in self._cache_paths.values())

    def _load_cached(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if not self.is_cached():
            return None
        p = self._cache_paths
        try:
            return tuple(np.load(p[n], mmap_mode="r", allow_pickle=False)
                         for n in ("document_index", "sample_index", "shuffle_index"))  # type: ignore[return-value]
        except (OSError, ValueError):
            logger.warning("ignoring an unreadable index cache in %s; rebuilding", self.cache_dir)
            return None

    def _save(self, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        p = self._cache_paths
        try:
            for name, arr in zip(("document_index", "sample_index", "shuffle_index"), arrays):
                save_npy_atomic(p[name], arr)
            write_text_atomic(p["description"], json.dumps(self.description, indent=2) + "\n")
        except OSError as exc:  # a read-only cache only costs a rebuild next time
            logger.warning("could not cache dataset indices in %s: %s", self.cache_dir, exc)

    # -- building -----------------------------------------------------------------------------
    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        split_code = zlib.crc32(self.split.encode())
        return np.random.default_rng([self.seed, split_code, self.begin, self.end, epoch, stream])

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lengths = self.indexed.sequence_lengths
        docs = np.arange(self.begin, self.end, dtype=np.int64)
        tokens_per_epoch = int(lengths[self.begin:self.end].sum(dtype=np.int64))
        S = self.seq_length
        if tokens_per_epoch < 1:
            raise DataError(f"dataset {self.indexed.prefix}: the {self.split} split holds no tokens")
        if self.requested is None:
            num_samples = (tokens_per_epoch - 1) // S
            if num_samples < 1:
                raise DataError(f"dataset {self.indexed.prefix}: the {self.split} split has {tokens_per_epoch} tokens, "
                                f"fewer than one sample of --seq-length {S} + 1")
        else:
            num_samples = int(self.requested)
        # Epochs needed so that the last sample's seq_length + 1 tokens exist.
        epochs = max(1, -(-(num_samples * S + 1) // tokens_per_epoch))
        doc_dtype = np.int32 if self.end < 2**31 else np.int64
        document_index = np.concatenate([self._rng(e, 0).permutation(docs).astype(doc_dtype) for e in range(epochs)])
        doc_lengths = lengths[document_index].astype(np.int64)
        stream_offsets = np.zeros(doc_lengths.size + 1, dtype=np.int64)
        np.cumsum(doc_lengths, out=stream_offsets[1:])
        # Offsets inside a document fit in int32 (lengths are int32); positions do below 2**31 documents.
        sample_dtype = np.int32 if document_index.size < 2**31 else np.int64
        sample_index = np.empty((num_samples, 2), dtype=sample_dtype)
        for lo in range(0, num_samples, SAMPLE_BLOCK):  # in blocks, to bound temporary memory
            starts = np.arange(lo, min(lo + SAMPLE_BLOCK, num_samples), dtype=np.int64) * S
            # searchsorted 'right' skips empty documents: a sample starts inside a non-empty one.
            doc_pos = np.searchsorted(stream_offsets, starts, side="right") - 1
            sample_index[lo:lo + starts.size, 0] = doc_pos
            sample_index[lo:lo + starts.size, 1] = starts - stream_offsets[doc_pos]
        # Shuffle the samples that start in each epoch among themselves, epoch after epoch:
        # the first sample starting at or after token e * tokens_per_epoch opens epoch e.
        epoch_bounds = np.minimum(-(-(np.arange(epochs + 1, dtype=np.int64) * tokens_per_epoch) // S), num_samples)
        epoch_bounds[-1] = num_samples
        order_dtype = np.int32 if num_samples < 2**31 else np.int64
        shuffle_index = np.concatenate([
            (lo + self._rng(e, 1).permutation(hi - lo)).astype(order_dtype)
            for e, (lo, hi) in enumerate(zip(epoch_bounds[:-1], epoch_bounds[1:]))])
        return document_index, sample_index, shuffle_index

    def __getstate__(self) -> dict:
        # Memory-mapped cached arrays are reopened by path rather than copied into the pickle.
        state = self.__dict__.copy()
        state["_lengths"] = None  # a view into the indexed dataset, which reopens its own files
        if self.is_cached():
            for name in ("document_index", "sample_index", "shuffle_index"):
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.document_index is None:
            self.document_index, self.sample_index, self.shuffle_index = self._load_cached()
        self._lengths = self.indexed.sequence_lengths

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def _fill(self, out: np.ndarray, raw_index: int) -> None:
        """Write the tokens of unshuffled sample ``raw_index`` into ``out`` (length seq_length + 1)."""
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
