"""``meshtron preprocess``: tokenize raw documents into Megatron-format ``.bin/.idx`` datasets.

The main process reads the input files in chunks of about a megabyte and writes the output;
``--workers`` processes parse and tokenize the chunks in parallel. Output keeps the input order,
so the same inputs always give the same dataset. One dataset is written per JSON key, named as
Megatron's tools name them: ``OUTPUT_PREFIX_{key}_document.bin/.idx``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import itertools
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from meshtron.data.errors import DataError
from meshtron.data.indexed_dataset import IndexedDatasetWriter, merge_datasets, token_dtype_for_vocab
from meshtron.data.readers import (TXT_UNITS, RawChunk, SkipCounts, chunk_documents, expand_inputs, file_format,
                                   iter_chunks)
from meshtron.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer


#: errno values of a file system that ran out of room or failed under the writer: a failure while running
#: (exit 1), also when the output file is being created; any other error creating it is a bad path (exit 2).
WRITE_FAILURE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


class OutputWriteError(Exception):
    """Writing the dataset failed while running (full disk, quota, I/O error): exit status 1, not bad input.
    The message names the file; the partial output is removed."""

    exit_code = 1


@contextlib.contextmanager
def _writing(path: str, disk_errors_only: bool = False) -> Iterator[None]:
    """Turn an OSError of writing ``path`` into :class:`OutputWriteError` naming it (a buffered write's
    error names no file). With ``disk_errors_only`` (creating the file, or a merge that also reads), only a
    full or failing file system is a write failure; other errors pass through as they are."""
    try:
        yield
    except OSError as err:
        if disk_errors_only and err.errno not in WRITE_FAILURE_ERRNOS:
            raise  # a path that cannot be created (permissions, a file in the way): bad input, exit 2
        where = err.filename or path
        raise OutputWriteError(f"writing {where} failed: {err.strerror or err}; the partial output was removed") \
            from None


def _abort_all(writers: Iterable[IndexedDatasetWriter]) -> None:
    """Remove every writer's partial files. On a full disk, closing a file may fail once more while flushing
    its buffer; the file is closed all the same, so a second attempt removes it."""
    for w in writers:
        try:
            w.abort()
        except OSError:
            w.abort()


@dataclass
class TokenizerArgs:
    """What a worker process needs to rebuild the tokenizer (tokenizer objects are not always picklable)."""

    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    null_eod_id: Optional[int] = None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file,
                               self.vocab_size, self.null_eod_id)


@dataclass
class ChunkResult:
    """Tokenized documents of one chunk, per key: concatenated tokens and per-document lengths."""

    tokens: dict
    lengths: dict
    skips: SkipCounts
    empty: dict  # key -> documents without tokens (kept, as Megatron keeps them)
    num_bytes: int
    cpu_seconds: float = 0.0  # the worker's CPU time on this chunk


@dataclass
class PreprocessSummary:
    """What a preprocessing run did."""

    files: int = 0
    documents: dict = field(default_factory=dict)  # key -> documents written
    empty_documents: dict = field(default_factory=dict)  # key -> documents written without tokens
    tokens: dict = field(default_factory=dict)  # key -> tokens written
    num_bytes: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # summed over workers: parsing and tokenizing only
    workers: int = 1
    skips: SkipCounts = field(default_factory=SkipCounts)
    outputs: list = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def mb_per_cpu_s(self) -> float:
        """Throughput of one worker that has a core to itself (unaffected by other load on the machine)."""
        return self.num_bytes / 1e6 / max(self.cpu_seconds, 1e-9)

    def report(self, keys: Sequence[str]) -> str:
        docs = sum(self.documents.values())
        toks = sum(self.tokens.values())
        lines = [f"preprocessed {self.files} file(s) in {self.seconds:.1f} s: {docs:,} documents, {toks:,} tokens, "
                 f"{self.num_bytes / 1e6:.1f} MB of text at {self.mb_per_s:.2f} MB/s "
                 f"({self.mb_per_s / self.workers:.2f} MB/s per worker, {self.workers} worker(s); "
                 f"{self.mb_per_cpu_s:.2f} MB per worker CPU-second)",
                 f"skipped: {self.skips.describe(keys)}"]
        empty = sum(self.empty_documents.values())
        if empty:
            lines.append(f"empty: {empty:,} documents have no tokens; they are kept as documents without sequences, "
                         "as Megatron's preprocessing writes them")
        lines += [f"  e.g. {e}" for e in self.skips.examples]
        lines += [f"wrote {p}.bin and {p}.idx" for p in self.outputs]
        return "\n".join(lines)


# Per-process state of a worker (set once by the pool initializer, never shared).
class _WorkerState:
    tokenizer: Optional[Tokenizer] = None
    json_keys: Sequence[str] = ("text",)
    append_eod: bool = False


def _init_worker(args: TokenizerArgs, json_keys: Sequence[str], append_eod: bool) -> None:
    # One thread per worker: parallelism comes from the worker processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WorkerState.tokenizer = args.build()
    _WorkerState.json_keys = tuple(json_keys)
    _WorkerState.append_eod = append_eod


def _tokenize_chunk(chunk: RawChunk) -> ChunkResult:
    """Parse and tokenize one chunk in a worker."""
    cpu_start = time.process_time()
    tok = _WorkerState.tokenizer
    skips = SkipCounts()
    texts = chunk_documents(chunk, _WorkerState.json_keys, skips)
    tokens, lengths, empty = {}, {}, {}
    eod = tok.eod
    for key, docs in texts.items():
        ids = tok.encode_batch(docs) if docs else []
        if _WorkerState.append_eod:
            for x in ids:
                if x:  # Megatron appends no end-of-document token to a document without tokens
                    x.append(eod)
        lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        empty[key] = int((lens == 0).sum())
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lens.sum()))
        tokens[key], lengths[key] = flat, lens
    return ChunkResult(tokens, lengths, skips, empty, chunk.num_bytes, time.process_time() - cpu_start)


class _Progress:
    """A tqdm bar (bytes, MB/s, documents/s) on a terminal; a plain line every ``interval`` s otherwise."""

    def __init__(self, total_bytes: Optional[int], enabled: bool, interval: float = 10.0,
                 log: Callable[[str], None] = print) -> None:
        self.start = time.perf_counter()
        self.docs = 0
        self.bytes = 0
        self.interval = interval
        self.log = log
        self.enabled = enabled
        self._last_log = self.start
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", dynamic_ncols=True)

    def update(self, num_bytes: int, docs: int) -> None:
        self.bytes += num_bytes
        self.docs += docs
        now = time.perf_counter()
        rate = self.docs / max(now - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(num_bytes)
            self._bar.set_postfix_str(f"{rate:,.0f} docs/s", refresh=False)
        elif self.enabled and now - self._last_log >= self.interval:
            self._last_log = now
            self.log(f"preprocess: {self.docs:,} documents, {self.bytes / 1e6:.1f} MB, {rate:,.0f} docs/s, "
                     f"{self.bytes / 1e6 / (now - self.start):.2f} MB/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _ordered_parallel(fn: Callable, items: Iterable, workers: int, initializer: Callable, initargs: tuple,
                      window: int) -> Iterator:
    """``map(fn, items)`` over a process pool, in order, with at most ``window`` items in flight."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= window:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_args: TokenizerArgs,
               json_keys: Sequence[str] = ("text",), workers: int = 1, append_eod: bool = False,
               txt_unit: str = "file", chunk_bytes: int = 1 << 20, progress: bool = True,
               log_interval: float = 10.0, log: Callable[[str], None] = print) -> PreprocessSummary:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` for each key."""
    paths = expand_inputs(inputs)
    json_keys = list(json_keys)
    if not json_keys:
        raise DataError("--json-keys needs at least one key")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if txt_unit not in TXT_UNITS:
        raise DataError(f"--txt-unit must be one of {', '.join(TXT_UNITS)}, got {txt_unit!r}")
    tokenizer = tokenizer_args.build()
    if append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: the tokenizer {tokenizer!r} defines no end-of-document token")
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    summary = PreprocessSummary(files=len(paths), workers=workers)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    writers: dict[str, IndexedDatasetWriter] = {}
    try:
        for k, p in prefixes.items():
            with _writing(p + ".bin", disk_errors_only=True):
                writers[k] = IndexedDatasetWriter(p, dtype)
    except BaseException:
        _abort_all(writers.values())
        raise
    chunks = itertools.chain.from_iterable(iter_chunks(p, json_keys, txt_unit, chunk_bytes) for p in paths)
    initargs = (tokenizer_args, json_keys, append_eod)
    if workers == 1:
        _init_worker(*initargs)
        results: Iterator[ChunkResult] = map(_tokenize_chunk, chunks)
    else:
        results = _ordered_parallel(_tokenize_chunk, chunks, workers, _init_worker, initargs, window=4 * workers)
    # A total for the bar only when file sizes are text sizes (no compression, no Parquet).
    plain = all(p.suffix not in (".gz", ".zst") and file_format(p) != "parquet" for p in paths)
    total = sum(p.stat().st_size for p in paths) if plain else None
    bar = _Progress(total, progress, log_interval, log)
    start = time.perf_counter()
    try:
        for res in results:
            ndocs = 0
            for k in json_keys:
                with _writing(prefixes[k] + ".bin"):
                    writers[k].add_documents(res.tokens[k], res.lengths[k])
                summary.documents[k] = summary.documents.get(k, 0) + len(res.lengths[k])
                summary.tokens[k] = summary.tokens.get(k, 0) + int(res.tokens[k].size)
                summary.empty_documents[k] = summary.empty_documents.get(k, 0) + res.empty[k]
                ndocs += len(res.lengths[k])
            summary.skips.add(res.skips)
            summary.num_bytes += res.num_bytes
            summary.cpu_seconds += res.cpu_seconds
            bar.update(res.num_bytes, ndocs)
        for k in json_keys:
            if not summary.tokens.get(k):
                raise DataError(_nothing_to_write(paths, k, summary))
        for k in json_keys:
            with _writing(prefixes[k] + ".idx"):
                summary.outputs.append(writers[k].finalize())
    except BaseException:
        _abort_all(writers.values())
        raise
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _nothing_to_write(paths: Sequence, key: str, summary: PreprocessSummary) -> str:
    """Why no dataset is written for ``key``: no input document had text under it."""
    shown = ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    found = [f"read {summary.num_bytes:,} bytes", f"skipped {summary.skips.describe([key])}"]
    if summary.empty_documents.get(key):
        found.append(f"{summary.empty_documents[key]:,} documents with no tokens")
    return (f"--input {shown}: no document has text under --json-keys {key} ({', '.join(found)}); "
            "nothing written: check --json-keys (or --txt-unit) against the input")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshtron preprocess",
        description="Tokenize JSON lines (.jsonl/.json, optionally .gz/.zst), Parquet or plain-text files into "
                    "Megatron-format indexed datasets OUTPUT_PREFIX_{key}_document.bin/.idx, or merge datasets "
                    "with --merge.")
    io_ = p.add_argument_group("input and output")
    io_.add_argument("--input", nargs="+", metavar="FILE", help="Input files, glob patterns or directories.")
    io_.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                     help="JSON keys (Parquet columns) to tokenize; one output dataset per key (default: text).")
    io_.add_argument("--output-prefix", required=True, help="Output path prefix.")
    io_.add_argument("--txt-unit", choices=TXT_UNITS, default="file",
                     help="What one document is in a plain-text file (default: the whole file).")
    io_.add_argument("--merge", nargs="+", metavar="PREFIX",
                     help="Instead of tokenizing, concatenate these datasets into OUTPUT_PREFIX.bin/.idx.")
    tk = p.add_argument_group("tokenizer")
    tk.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="Tokenizer kind (inferred from the files if omitted).")
    tk.add_argument("--tokenizer-model",
                    help="tokenizer.json / pretrained directory / SentencePiece .model / tiktoken file.")
    tk.add_argument("--vocab-file", help="GPT-2 BPE vocab.json.")
    tk.add_argument("--merge-file", help="GPT-2 BPE merges.txt.")
    tk.add_argument("--vocab-size", type=int, help="Vocabulary size for --tokenizer-type NullTokenizer.")
    tk.add_argument("--null-tokenizer-eod-id", type=int,
                    help="End-of-document id of NullTokenizer (default --vocab-size - 1, as Megatron-Core 0.18+).")
    tk.add_argument("--append-eod", action="store_true", help="Append the end-of-document token to every document.")
    run = p.add_argument_group("run")
    run.add_argument("--workers", type=int, default=1, help="Tokenizer processes (default 1).")
    run.add_argument("--chunk-mb", type=float, default=1.0, help="Megabytes of input per work item (default 1).")
    run.add_argument("--log-interval", type=float, default=10.0,
                     help="Seconds between progress lines when not on a terminal (default 10).")
    run.add_argument("--no-progress", action="store_true", help="No progress bar or progress lines.")
    # Accepted for Megatron compatibility: meshtron only writes the mmap format.
    run.add_argument("--dataset-impl", choices=("mmap",), default="mmap", help=argparse.SUPPRESS)
    return p


def _error(message: str, code: int = 2) -> int:
    print(f"meshtron preprocess: error: {message}", file=sys.stderr)
    return code


def preprocess_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``meshtron preprocess``; returns the exit code (2 for bad input, 1 when writing the
    output failed while running, e.g. on a full disk)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad flags and 0 on --help
        return int(exc.code or 0)
    try:
        if args.merge:
            if args.input:
                return _error("give either --input (tokenize) or --merge (concatenate datasets), not both")
            with _writing(args.output_prefix + ".bin", disk_errors_only=True):
                out = merge_datasets(args.merge, args.output_prefix)
            print(f"merged {len(args.merge)} dataset(s) into {out}.bin and {out}.idx")
            return 0
        if not args.input:
            return _error("--input is required (or --merge PREFIX ... to concatenate datasets)")
        targs = TokenizerArgs(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                              args.vocab_size, args.null_tokenizer_eod_id)
        summary = preprocess(args.input, args.output_prefix, targs, json_keys=args.json_keys, workers=args.workers,
                             append_eod=args.append_eod, txt_unit=args.txt_unit,
                             chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))), progress=not args.no_progress,
                             log_interval=args.log_interval)
    except DataError as exc:
        return _error(str(exc))
    except OutputWriteError as exc:  # a full disk while writing: a failure while running
        return _error(str(exc), exc.exit_code)
    except OSError as exc:  # unwritable output directory, unreadable input
        return _error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    print(summary.report(args.json_keys))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(preprocess_main())
