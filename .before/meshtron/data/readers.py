"""Reading raw documents: JSON lines (plain, .gz, .zst), Parquet and plain text.

The main process reads files into :class:`RawChunk` objects (raw lines or texts, about a megabyte
each); :func:`chunk_documents` turns a chunk into per-key document texts, counting the lines it
has to skip and why. The split keeps parsing in the worker processes, where it runs in parallel.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, Sequence

from meshtron.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
COMPRESSION_SUFFIXES = (".gz", ".zst")
TXT_UNITS = ("file", "line", "paragraph")
MAX_SKIP_EXAMPLES = 5


def _split_suffix(path: Path) -> tuple[str, Optional[str]]:
    """(format suffix, compression suffix or None) of a file name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes[-1] if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES else None
    if compression:
        base = suffixes[-2] if len(suffixes) >= 2 else ""
    else:
        base = suffixes[-1] if suffixes else ""
    return base, compression


def file_format(path: Path) -> Optional[str]:
    """'jsonl', 'parquet' or 'text' for a supported input file, else None."""
    base, compression = _split_suffix(path)
    if base in JSONL_SUFFIXES:
        return "jsonl"
    if base == ".parquet" and compression is None:
        return "parquet"
    if base in TEXT_SUFFIXES:
        return "text"
    return None


def expand_inputs(patterns: Sequence[str], flag: str = "--input") -> list[Path]:
    """Files named by paths, glob patterns or directories (searched recursively), sorted, without repeats."""
    found: list[Path] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            matches = sorted(q for q in p.rglob("*") if q.is_file() and file_format(q) is not None)
            if not matches:
                raise DataError(f"{flag} {pattern}: the directory holds no .jsonl/.json(.gz/.zst), .parquet or .txt files")
        elif p.is_file():
            matches = [p]
        else:
            hits = glob.glob(os.path.expanduser(pattern), recursive=True)
            matches = sorted(Path(m) for m in hits if Path(m).is_file())
            if not matches:
                raise DataError(f"{flag} {pattern}: no such file")
        for m in matches:
            if file_format(m) is None:
                raise DataError(f"{flag} {m}: unsupported file type; valid: .jsonl/.json/.ndjson (optionally .gz or "
                                ".zst), .parquet, .txt/.text/.md (optionally .gz or .zst)")
        found.extend(matches)
    unique = list(dict.fromkeys(found))
    if not unique:
        raise DataError(f"{flag}: no input files")
    return unique


def open_binary(path: Path) -> IO[bytes]:
    """A binary stream of the uncompressed contents of ``path``."""
    _, compression = _split_suffix(path)
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs `pip install zstandard` (or meshtron[zstd])") from None
        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), buffer_size=1 << 20)
    return open(path, "rb")


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a (possibly compressed) input file raises when the file is damaged or unreadable."""
    errors: list[type[BaseException]] = [OSError, EOFError]  # gzip.BadGzipFile is an OSError
    try:
        import zstandard
    except ImportError:
        pass
    else:
        errors.append(zstandard.ZstdError)
    return tuple(errors)


@dataclass
class RawChunk:
    """A slice of one input file: raw JSON lines, ready texts (text/Parquet) or per-key columns."""

    file: str
    first_line: int  # 1-based line (or row) number of the first item, for messages
    kind: str  # "jsonl" | "texts" | "columns"
    lines: list = field(default_factory=list)  # jsonl: bytes lines; texts: str documents
    columns: dict = field(default_factory=dict)  # columns: key -> list of values
    num_bytes: int = 0


@dataclass
class SkipCounts:
    """Why input was skipped, with the first few places it happened."""

    not_json: int = 0
    missing_key: int = 0
    not_text: int = 0
    empty: int = 0
    examples: list = field(default_factory=list)

    def note(self, reason: str, where: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        if len(self.examples) < MAX_SKIP_EXAMPLES:
            self.examples.append(f"{where}: {reason.replace('_', ' ')}")

    def add(self, other: "SkipCounts") -> None:
        for name in ("not_json", "missing_key", "not_text", "empty"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        room = MAX_SKIP_EXAMPLES - len(self.examples)
        if room > 0:
            self.examples.extend(other.examples[:room])

    @property
    def total(self) -> int:
        return self.not_json + self.missing_key + self.not_text + self.empty

    def describe(self, keys: Sequence[str]) -> str:
        """A one-line human summary, e.g. '3 lines not JSON, 2 without key text, 1 empty document'."""
        parts = []
        if self.not_json:
            parts.append(f"{self.not_json} lines not JSON")
        if self.missing_key:
            parts.append(f"{self.missing_key} without key {'/'.join(keys)}")
        if self.not_text:
            parts.append(f"{self.not_text} with a non-string value")
        if self.empty:
            parts.append(f"{self.empty} empty text units")
        return ", ".join(parts) if parts else "nothing"


def iter_chunks(path: Path, json_keys: Sequence[str], txt_unit: str = "file",
                chunk_bytes: int = 1 << 20) -> Iterator[RawChunk]:
    """Read ``path`` into chunks of about ``chunk_bytes`` uncompressed bytes."""
    fmt = file_format(path)
    if fmt == "jsonl":
        yield from _jsonl_chunks(path, chunk_bytes)
    elif fmt == "parquet":
        yield from _parquet_chunks(path, json_keys, chunk_bytes)
    elif fmt == "text":
        yield from _text_chunks(path, txt_unit, chunk_bytes)
    else:  # expand_inputs rejects these first
        raise DataError(f"{path}: unsupported file type")


def _jsonl_chunks(path: Path, chunk_bytes: int) -> Iterator[RawChunk]:
    try:
        with open_binary(path) as f:
            chunk = RawChunk(str(path), 1, "jsonl")
            lineno = 0
            for line in f:
                lineno += 1
                chunk.lines.append(line)
                chunk.num_bytes += len(line)
                if chunk.num_bytes >= chunk_bytes:
                    yield chunk
                    chunk = RawChunk(str(path), lineno + 1, "jsonl")
            if chunk.lines:
                yield chunk
    except _read_errors() as exc:
        raise DataError(f"cannot read {path}: {exc}") from None


def _text_chunks(path: Path, txt_unit: str, chunk_bytes: int) -> Iterator[RawChunk]:
    try:
        with open_binary(path) as f:
            data = f.read()
    except _read_errors() as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    text = data.decode("utf-8", errors="replace")
    if txt_unit == "file":
        yield RawChunk(str(path), 1, "texts", lines=[text], num_bytes=len(data))
        return
    docs = text.splitlines() if txt_unit == "line" else text.replace("\r\n", "\n").split("\n\n")
    chunk = RawChunk(str(path), 1, "texts")
    for i, doc in enumerate(docs):
        chunk.lines.append(doc)
        chunk.num_bytes += len(doc.encode("utf-8")) + 1
        if chunk.num_bytes >= chunk_bytes:
            yield chunk
            chunk = RawChunk(str(path), i + 2, "texts")
    if chunk.lines:
        yield chunk


def _parquet_chunks(path: Path, json_keys: Sequence[str], chunk_bytes: int) -> Iterator[RawChunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet files needs `pip install pyarrow` (or meshtron[parquet])") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"cannot read Parquet file {path}: {exc}") from None
    present = [k for k in json_keys if k in pf.schema_arrow.names]
    if not present:
        raise DataError(f"{path} has none of the columns {list(json_keys)} (--json-keys); it has: "
                        + ", ".join(pf.schema_arrow.names))
    row = 1
    batches = pf.iter_batches(batch_size=1024, columns=present)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # pyarrow raises ArrowInvalid, ArrowIOError, OSError on damaged pages
            raise DataError(f"cannot read Parquet file {path} near row {row}: {exc}") from None
        if batch is None:
            return
        cols = {k: batch.column(k).to_pylist() for k in present}
        n = batch.num_rows
        for k in json_keys:  # a missing column counts as a missing key on every row
            cols.setdefault(k, [_MISSING] * n)
        size = sum(len(v.encode("utf-8")) for v in cols[present[0]] if isinstance(v, str))
        yield RawChunk(str(path), row, "columns", columns=cols, num_bytes=size)
        row += n


class _Missing:
    """Marks a value that the record does not have (distinct from JSON null)."""

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


def chunk_documents(chunk: RawChunk, json_keys: Sequence[str], skips: SkipCounts) -> dict[str, list[str]]:
    """The texts of a chunk for each key; every skipped line is counted in ``skips``.

    An empty JSON/Parquet text is kept (it becomes a document without tokens, as Megatron's
    ``preprocess_data.py`` writes it); an empty plain-text unit (a blank line or paragraph) is skipped.
    """
    out: dict[str, list[str]] = {k: [] for k in json_keys}
    if chunk.kind == "texts":
        for i, text in enumerate(chunk.lines):
            if text:
                out[json_keys[0]].append(text)
            else:
                skips.note("empty", f"{chunk.file}:{chunk.first_line + i}")
        return out
    if chunk.kind == "columns":
        n = len(next(iter(chunk.columns.values())))
        records = ((f"{chunk.file}:{chunk.first_line + i}", {k: chunk.columns[k][i] for k in json_keys})
                   for i in range(n))
    else:
        records = _parse_lines(chunk, skips)
    for where, record in records:
        for k in json_keys:
            value = record.get(k, _MISSING)
            if value is _MISSING:
                skips.note("missing_key", where)
            elif not isinstance(value, str):
                skips.note("not_text", where)
            else:  # an empty text stays a document (without tokens), as in Megatron's preprocessing
                out[k].append(value)
    return out


def _parse_lines(chunk: RawChunk, skips: SkipCounts) -> Iterator[tuple[str, dict]]:
    """(place, parsed JSON object) of a chunk's lines; blank lines are ignored, bad ones counted."""
    for i, line in enumerate(chunk.lines):
        if not line.strip():
            continue
        where = f"{chunk.file}:{chunk.first_line + i}"
        try:
            record = json.loads(line)
        except ValueError:
            skips.note("not_json", where)
            continue
        if not isinstance(record, dict):
            skips.note("not_json", where)
            continue
        yield where, record


def iter_texts(paths: Sequence[Path], json_keys: Sequence[str] = ("text",), txt_unit: str = "file",
               skips: Optional[SkipCounts] = None) -> Iterator[str]:
    """Every document text of the given files, in order (single process)."""
    skips = skips if skips is not None else SkipCounts()
    for path in paths:
        for chunk in iter_chunks(path, json_keys, txt_unit):
            for texts in chunk_documents(chunk, json_keys, skips).values():
                yield from texts
