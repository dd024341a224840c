"""Megatron-Core's indexed dataset: token sequences in ``PREFIX.bin``, their index in ``PREFIX.idx``.

The on-disk format is Megatron-Core's, byte for byte, so datasets written by either tool load
in the other. All integers are little-endian.

``PREFIX.idx``::

    offset  size     field
    0       9        magic  b"MMIDIDX\\x00\\x00"
    9       8        version, u64, always 1
    17      1        token dtype code, u8 (see DTYPE_CODES)
    18      8        sequence count N, u64
    26      8        document-index count D, u64 (number of documents + 1)
    34      4*N      sequence lengths in tokens, int32
    34+4N   8*N      sequence byte offsets into PREFIX.bin, int64
    34+12N  8*D      document index, int64: 0, then after each document the number of
                     sequences so far (document k is sequences [doc[k], doc[k+1]))
    (34+12N+8D  N    optional per-sequence mode, int8: multimodal datasets only)

``PREFIX.bin`` is the sequences' tokens back to back in the index's dtype, nothing else.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from meshtron.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

# Megatron-Core's numeric dtype codes.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


def dtype_code(dtype: np.dtype) -> int:
    """Megatron's numeric code of a token dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        raise ValueError(f"token dtype {dt} has no indexed-dataset code; valid: "
                         + ", ".join(str(d) for d in _CODE_OF_DTYPE))
    return _CODE_OF_DTYPE[dt]


def token_dtype_for_vocab(vocab_size: Optional[int]) -> np.dtype:
    """uint16 when every token id fits (Megatron's threshold: vocabulary below 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def strip_prefix(prefix: PathLike) -> str:
    """Accept ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` and return ``PREFIX``."""
    text = os.fspath(prefix)
    for ext in (".bin", ".idx"):
        if text.endswith(ext):
            return text[: -len(ext)]
    return text


def index_path(prefix: PathLike) -> Path:
    """``PREFIX.idx``."""
    return Path(strip_prefix(prefix) + ".idx")


def data_path(prefix: PathLike) -> Path:
    """``PREFIX.bin``."""
    return Path(strip_prefix(prefix) + ".bin")


def dataset_exists(prefix: PathLike) -> bool:
    """Whether both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
    return index_path(prefix).is_file() and data_path(prefix).is_file()


def write_index(path: PathLike, dtype: np.dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray, sequence_modes: Optional[np.ndarray] = None) -> None:
    """Write an ``.idx`` file; sequence pointers are derived from the lengths (contiguous tokens)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must be in [0, 2**31)")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", docs.size))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())
        if sequence_modes is not None:
            f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes())


CHECK_BLOCK = 1 << 22  # entries per block when checking an index: bounds the temporary memory


def _first(mask: np.ndarray) -> Optional[int]:
    """Index of the first True of ``mask``, or None."""
    return int(np.argmax(mask)) if mask.any() else None


def check_document_index(documents: np.ndarray, num_sequences: int, idx: Path) -> None:
    """Raise :class:`DataError` unless ``documents`` runs from 0 to ``num_sequences`` without decreasing.

    Equal neighbours are valid: they are documents without sequences, which Megatron's
    preprocessing writes for an empty text.
    """
    d = documents.shape[0]
    if d < 1 or documents[0] != 0 or documents[-1] != num_sequences:
        first = int(documents[0]) if d else None
        last = int(documents[-1]) if d else None
        raise DataError(f"dataset index file {idx} is corrupt: its document index must start at 0 and end at the "
                        f"sequence count {num_sequences}, but it runs from {first} to {last}")
    for lo in range(0, d - 1, CHECK_BLOCK):
        block = documents[lo:min(lo + CHECK_BLOCK + 1, d)]
        bad = _first(block[1:] < block[:-1])
        if bad is not None:
            k = lo + bad + 1
            raise DataError(f"dataset index file {idx} is corrupt: document index entry {k} is {int(documents[k])}, "
                            f"below entry {k - 1} ({int(documents[k - 1])}); the entries must not decrease")


def check_sequences(lengths: np.ndarray, pointers: np.ndarray, dtype: np.dtype, bin_size: int, idx: Path,
                    binp: Path) -> None:
    """Raise :class:`DataError` naming the first bad entry unless the sequences tile ``PREFIX.bin`` exactly.

    Megatron writes every sequence right after the previous one, so sequence ``i`` must start at
    ``itemsize * (lengths[0] + ... + lengths[i-1])``, have a non-negative length, and the last one
    must end at the end of the ``.bin``. Checking that equality for every entry also rules out
    offsets that are negative, past the end or misaligned, and lengths that overrun the file.
    """
    n, itemsize = lengths.shape[0], np.dtype(dtype).itemsize
    start = 0  # where the next sequence must start, in bytes
    for lo in range(0, n, CHECK_BLOCK):
        hi = min(lo + CHECK_BLOCK, n)
        length = lengths[lo:hi].astype(np.int64)
        ends = np.cumsum(length, dtype=np.int64)
        ends *= itemsize
        ends += start
        expected = ends - length * itemsize
        pointer = pointers[lo:hi]
        negative, misplaced, overrun = _first(length < 0), _first(pointer != expected), _first(ends > bin_size)
        found = [i for i in (negative, misplaced, overrun) if i is not None]
        if found:
            j = min(found)
            i, p, size, exp = lo + j, int(pointer[j]), int(length[j]), int(expected[j])
            where = f"dataset index file {idx} is corrupt: sequence {i}"
            if j == negative:
                raise DataError(f"{where} has a negative length ({size} tokens)")
            if j == misplaced:
                if p < 0:
                    raise DataError(f"{where} has a negative byte offset ({p})")
                if p > bin_size or (p == bin_size and size > 0):
                    raise DataError(f"{where} starts at byte {p}, past the end of {binp} ({bin_size} bytes)")
                raise DataError(f"{where} starts at byte {p}, but the sequences before it end at byte {exp} "
                                "(each sequence must follow the previous one)")
            raise DataError(f"{where} ({size} tokens from byte {p}) ends at byte {int(ends[j])}, past the end of "
                            f"{binp} ({bin_size} bytes): the .bin is truncated, the index is corrupt, or the files do "
                            "not belong together")
        start = int(ends[-1])
    if start != bin_size:
        raise DataError(f"dataset data file {binp} has {bin_size} bytes but its index {idx} describes {start} bytes "
                        f"({n} sequences of {np.dtype(dtype)} tokens): the files "
                        "are truncated or do not belong together")


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    Every inconsistency between the two files raises :class:`DataError` naming the file (and the
    entry, for a bad entry): a wrong magic, version or dtype code, a size that does not match the
    header's counts, and any sequence whose length is negative or whose byte offset does not follow
    the sequences before it (which catches offsets that are negative or past the end of the
    ``.bin``), a document index that is not a non-decreasing run from 0 to the sequence count, and
    a ``.bin`` whose size is not the sum of the lengths. The check of every entry is vectorised
    and runs in blocks (see :func:`check_sequences`).
    Pickling reopens the files by path, so instances travel cheaply to loader worker processes.
    """

    def __init__(self, prefix: PathLike) -> None:
        self.prefix = strip_prefix(prefix)
        self._open(validate=True)

    # -- opening and validation -----------------------------------------------------------
    def _open(self, validate: bool) -> None:
        try:
            self._open_files(validate)
        except OSError as exc:  # permission denied, an I/O error, a directory where a file should be
            raise DataError(f"cannot read dataset {exc.filename or self.prefix}: {exc.strerror or exc}") from None

    def _open_files(self, validate: bool) -> None:
        idx, binp = index_path(self.prefix), data_path(self.prefix)
        if not idx.is_file():
            hint = "" if data_path(self.prefix).is_file() else (
                " (a data prefix names PREFIX.bin and PREFIX.idx without the extension; "
                "`meshtron preprocess` writes OUTPUT_PREFIX_text_document.*)")
            raise DataError(f"dataset index file {idx} not found{hint}")
        if not binp.is_file():
            raise DataError(f"dataset data file {binp} not found (it must sit beside {idx})")
        idx_size = idx.stat().st_size
        if idx_size < HEADER_SIZE:
            raise DataError(f"dataset index file {idx} is truncated: {idx_size} bytes, "
                            f"shorter than the {HEADER_SIZE}-byte header")
        with open(idx, "rb") as f:
            header = f.read(HEADER_SIZE)
        magic = header[:9]
        if magic != INDEX_MAGIC:
            raise DataError(f"{idx} is not a Megatron indexed-dataset index: magic {magic!r}, "
                            f"expected {INDEX_MAGIC!r}")
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != INDEX_VERSION:
            raise DataError(f"{idx} has index version {version}; only version {INDEX_VERSION} is supported")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise DataError(f"{idx} has unknown token dtype code {code}; valid codes: {sorted(DTYPE_CODES)}")
        self.dtype: np.dtype = DTYPE_CODES[code]
        n, d = struct.unpack_from("<QQ", header, 18)
        expected = HEADER_SIZE + 12 * n + 8 * d
        self.multimodal = idx_size == expected + n and n > 0
        if idx_size != expected and not self.multimodal:
            raise DataError(f"dataset index file {idx} is truncated or corrupt: its header counts {n} sequences "
                            f"and {d} document entries, which take {expected} bytes, but the file has {idx_size}")
        self._idx_map = np.memmap(idx, dtype=np.uint8, mode="r")
        buf = self._idx_map
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
        self.sequence_modes = (np.frombuffer(buf, dtype=np.int8, count=n, offset=HEADER_SIZE + 12 * n + 8 * d)
                               if self.multimodal else None)
        bin_size = binp.stat().st_size
        if validate:
            check_document_index(self.document_indices, n, idx)
            check_sequences(self.sequence_lengths, self.sequence_pointers, self.dtype, bin_size, idx, binp)
        elif n and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize != bin_size:
            raise DataError(f"dataset data file {binp} changed size since it was opened ({bin_size} bytes now)")
        self._bin_map = np.memmap(binp, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        # The process that pickled this instance checked every entry; a copy (in a loader worker)
        # checks the headers and sizes again but does not repeat the scan of every entry.
        self.prefix = state["prefix"]
        self._open(validate=False)

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of sequences (for GPT data, one sequence per document)."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (a read-only view, not a copy)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(int(idx))


class IndexedDatasetWriter:
    """Write ``PREFIX.bin`` / ``PREFIX.idx``; files appear under their final names only on :meth:`finalize`.

    Use as a context manager: leaving the block by an exception removes the partial files.
    """

    def __init__(self, prefix: PathLike, dtype: np.dtype) -> None:
        self.prefix = strip_prefix(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(self.prefix + ".bin.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_sequences = 0
        self._open_sequences = 0  # sequences added since the last document end
        self.num_tokens = 0

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _write_tokens(self, tokens: np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if self.dtype.kind in "iu" and arr.size and (arr.min() < np.iinfo(self.dtype).min
                                                          or arr.max() > np.iinfo(self.dtype).max):
                raise ValueError(f"token ids out of range for the dataset dtype {self.dtype}")
            arr = arr.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(arr).astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.num_tokens += int(arr.size)

    def add_sequence(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document (close it with :meth:`end_document`)."""
        arr = np.asarray(tokens)
        self._write_tokens(arr)
        self._lengths.append(np.array([arr.size], dtype=np.int64))
        self._num_sequences += 1
        self._open_sequences += 1

    def end_document(self) -> None:
        """Close the current document."""
        self._doc_ends.append(np.array([self._num_sequences], dtype=np.int64))
        self._open_sequences = 0

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document made of one sequence; empty ``tokens`` make a document without sequences,
        as Megatron's preprocessing writes an empty text."""
        if len(tokens):
            self.add_sequence(tokens)
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: ``tokens`` is their concatenation, ``lengths`` their sizes.

        A document of length 0 has no sequence (only its document-index entry), as with
        :meth:`add_document`.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != int(np.asarray(tokens).size):
            raise ValueError("the document lengths do not add up to the number of tokens")
        if self._open_sequences:
            raise RuntimeError("end_document() must close the current document before add_documents()")
        self._write_tokens(tokens)
        present = lengths > 0
        self._lengths.append(lengths[present])
        self._doc_ends.append(self._num_sequences + np.cumsum(present, dtype=np.int64))
        self._num_sequences += int(present.sum())

    def append_dataset(self, prefix: PathLike) -> None:
        """Append every sequence and document of an existing dataset (merging), copying its tokens."""
        src = IndexedDataset(prefix)
        if src.dtype != self.dtype:
            raise DataError(f"cannot merge {src.prefix} ({src.dtype} tokens) into a {self.dtype} dataset: "
                            "all merged datasets must share a token dtype")
        if self._open_sequences:
            raise RuntimeError("end_document() must close the current document before append_dataset()")
        with open(data_path(src.prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)
        self.num_tokens += src.num_tokens
        self._lengths.append(np.asarray(src.sequence_lengths, dtype=np.int64))
        self._doc_ends.append(np.asarray(src.document_indices[1:], dtype=np.int64) + self._num_sequences)
        self._num_sequences += len(src)

    def finalize(self) -> str:
        """Write the index and move both files into place. Returns the prefix."""
        if self._open_sequences:
            self.end_document()
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        docs = np.concatenate(self._doc_ends)
        idx_tmp = Path(self.prefix + ".idx.tmp")
        write_index(idx_tmp, self.dtype, lengths, docs)
        os.replace(self._bin_tmp, data_path(self.prefix))
        os.replace(idx_tmp, index_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        """Close and remove the partial output."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, Path(self.prefix + ".idx.tmp")):
            if p.exists():
                p.unlink()


def merge_datasets(prefixes: Iterable[PathLike], output_prefix: PathLike) -> str:
    """Concatenate several datasets (same token dtype) into one, documents in the given order."""
    prefixes = [strip_prefix(p) for p in prefixes]
    if not prefixes:
        raise DataError("nothing to merge: give at least one dataset prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for p in prefixes:
            writer.append_dataset(p)
        return writer.finalize()
