"""The built-in corpus: the Python standard library's own source files, on this machine.

With neither ``--data-path`` nor ``--mock-data``, meshtron trains on this corpus, so that a fresh
install can pre-train a model without any download. The build, about a second or two:

1. take the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (without test suites and
   installed packages), in a fixed pseudo-random order (by a hash of their relative paths, so the
   train/validation split mixes all parts of the library), up to about 4 MB;
2. train a byte-level BPE tokenizer of 4096 tokens on them with the ``tokenizers`` library;
3. tokenize each file as one document ending with the end-of-document token, into a standard
   ``.bin/.idx`` indexed dataset, which then goes through the ordinary GPT dataset and ``--split``.

Everything is cached under ``<cache>/default_corpus/<key>/`` (see :func:`meshtron.data.cache.user_cache_dir`),
where the key hashes the file list, the file sizes and the build settings: a machine with another
Python rebuilds. The build writes into a temporary directory renamed into place when complete, and
under torch.distributed only global rank 0 builds while the other ranks wait.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from meshtron.data.cache import build_once, stable_hash, staging_dir, user_cache_dir
from meshtron.data.errors import DataError
from meshtron.data.indexed_dataset import IndexedDatasetWriter, dataset_exists, token_dtype_for_vocab
from meshtron.data.tokenizer_train import train_bpe_from_texts
from meshtron.data.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

CORPUS_VERSION = 1
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_MAX_BYTES = 4_000_000
MAX_FILE_BYTES = 200_000  # skips a few huge generated tables, which teach little
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DATASET_NAME = "stdlib_text_document"


@dataclass(frozen=True)
class DefaultCorpus:
    """A built default corpus: an indexed-dataset prefix and the tokenizer it was made with."""

    directory: Path
    built_here: bool = field(default=False, compare=False)  # whether this process built it

    @property
    def prefix(self) -> str:
        return str(self.directory / DATASET_NAME)

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / "tokenizer"

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_dir)

    def manifest(self) -> dict:
        return json.loads((self.directory / "manifest.json").read_text(encoding="utf-8"))


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def select_sources(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, int]]:
    """(relative path, size) of the chosen source files, in corpus order."""
    candidates = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        size = path.stat().st_size
        if 0 < size <= MAX_FILE_BYTES:
            candidates.append((rel.as_posix(), size))
    # A fixed pseudo-random order that does not depend on directory listing order or Python's RNG.
    candidates.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
    chosen, total = [], 0
    for rel, size in candidates:
        if total + size > max_bytes:
            continue
        chosen.append((rel, size))
        total += size
    return chosen


def corpus_key(sources: list[tuple[str, int]], vocab_size: int, max_bytes: int) -> str:
    """Cache key: changes when the files, their sizes or the build settings change."""
    return stable_hash({"version": CORPUS_VERSION, "files": sources, "vocab_size": vocab_size, "max_bytes": max_bytes})


def _read_sources(root: Path, sources: list[tuple[str, int]]) -> list[str]:
    texts = []
    for rel, _ in sources:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8: left out (deterministically, on a given machine)
    return texts


def _build(root: Path, sources: list[tuple[str, int]], vocab_size: int, target: Path) -> None:
    start = time.perf_counter()
    texts = _read_sources(root, sources)
    if not texts:
        raise DataError(f"the default corpus found no readable .py files under {root}; "
                        "give --data-path (or --mock-data --vocab-size N)")
    with staging_dir(target) as tmp:
        tok = train_bpe_from_texts(texts, vocab_size, tmp / "tokenizer")
        ids = tok.encode_batch(texts)
        lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
        flat = np.empty(int(lengths.sum()), dtype=np.int64)
        pos = 0
        for x in ids:
            flat[pos:pos + len(x)] = x
            flat[pos + len(x)] = tok.eod
            pos += len(x) + 1
        with IndexedDatasetWriter(tmp / DATASET_NAME, token_dtype_for_vocab(tok.vocab_size)) as writer:
            writer.add_documents(flat, lengths)
            writer.finalize()
        manifest = {
            "version": CORPUS_VERSION, "python": sys.version.split()[0], "stdlib": str(root),
            "files": len(texts), "bytes": sum(len(t.encode("utf-8")) for t in texts), "tokens": int(flat.size),
            "vocab_size": tok.vocab_size, "build_seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info("built the default corpus in %s: %d files, %d tokens", target, manifest["files"], manifest["tokens"])


def ensure_default_corpus(cache_root: Optional[Path] = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                          max_bytes: int = DEFAULT_MAX_BYTES, root: Optional[Path] = None) -> DefaultCorpus:
    """Build the default corpus if it is not cached yet, and return it.

    Every rank must call this under torch.distributed (rank 0 builds, the others wait).
    """
    root = root or stdlib_root()
    sources = select_sources(root, max_bytes)
    if not sources:
        raise DataError(f"the default corpus found no .py files under {root}; give --data-path "
                        "(or --mock-data --vocab-size N)")
    target = (cache_root or user_cache_dir()) / "default_corpus" / corpus_key(sources, vocab_size, max_bytes)

    def is_built() -> bool:
        return (target / "manifest.json").is_file() and dataset_exists(DefaultCorpus(target).prefix)

    try:
        built = build_once(is_built, lambda: _build(root, sources, vocab_size, target))
    except PermissionError as exc:
        raise DataError(f"cannot write the default corpus cache {target}: {exc.strerror}; set MESHTRON_CACHE to a "
                        "writable directory") from None
    return DefaultCorpus(target, built_here=built)
