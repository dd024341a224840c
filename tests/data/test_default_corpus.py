"""The built-in corpus from the standard library's sources: build, cache key, determinism, concurrency."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest

from _data_helpers import small_config
from meshtron.data import build_data
from meshtron.data.default_corpus import (DATASET_NAME, DEFAULT_VOCAB_SIZE, corpus_key, ensure_default_corpus,
                                         select_sources)
from meshtron.data.indexed_dataset import IndexedDataset


@pytest.fixture(scope="module")
def real_corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("corpus-cache")
    start = time.perf_counter()
    corpus = ensure_default_corpus(cache_root=cache)
    return corpus, time.perf_counter() - start, cache


def test_real_corpus_builds_fast_and_is_well_formed(real_corpus):
    corpus, seconds, _ = real_corpus
    assert seconds < 60  # well under a minute on 2 cores (about 2 s measured)
    info = corpus.manifest()
    assert 3.0e6 < info["bytes"] <= 4.0e6 and info["files"] > 100
    tok = corpus.tokenizer()
    assert tok.vocab_size == DEFAULT_VOCAB_SIZE
    ds = IndexedDataset(corpus.prefix)
    assert ds.dtype == np.uint16 and len(ds) == info["files"] and ds.num_tokens == info["tokens"]
    ends = ds.sequence_pointers // 2 + ds.sequence_lengths - 1
    tokens = np.frombuffer(Path(corpus.prefix + ".bin").read_bytes(), dtype=np.uint16)
    assert np.all(tokens[ends] == tok.eod)  # every document ends with end-of-document
    assert "def " in "".join(tok.decode(ds[i].tolist()) for i in range(5))


def test_second_call_uses_the_cache(real_corpus):
    corpus, _, cache = real_corpus
    before = (Path(corpus.prefix + ".bin").stat().st_mtime_ns, sorted(p.name for p in cache.rglob("*")))
    again = ensure_default_corpus(cache_root=cache)
    assert again == corpus
    assert (Path(corpus.prefix + ".bin").stat().st_mtime_ns, sorted(p.name for p in cache.rglob("*"))) == before


def _fake_stdlib(root: Path, extra: str = "") -> Path:
    (root / "pkg").mkdir(parents=True, exist_ok=True)
    (root / "test").mkdir(exist_ok=True)
    for i in range(12):
        (root / f"mod{i}.py").write_text(f"def function_{i}(x):\n    return x * {i} + 1  # é\n" * (i + 3) + extra)
    (root / "pkg" / "inner.py").write_text("class Inner:\n    pass\n" * 10)
    (root / "test" / "test_skipped.py").write_text("assert False\n")
    (root / "not_python.txt").write_text("ignored")
    return root


def test_selection_and_key(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    sources = select_sources(root)
    names = [n for n, _ in sources]
    assert "pkg/inner.py" in names and not any(n.startswith("test/") for n in names) and len(names) == 13
    assert sources == select_sources(root)  # fixed order
    key = corpus_key(sources, 300, 4_000_000)
    assert corpus_key(sources, 400, 4_000_000) != key
    (root / "mod3.py").write_text("changed = 1\n")
    assert corpus_key(select_sources(root), 300, 4_000_000) != key
    capped = select_sources(root, max_bytes=500)
    assert sum(size for _, size in capped) <= 500 and capped


def test_build_is_deterministic(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    a = ensure_default_corpus(cache_root=tmp_path / "a", vocab_size=300, root=root)
    b = ensure_default_corpus(cache_root=tmp_path / "b", vocab_size=300, root=root)
    for name in (DATASET_NAME + ".bin", DATASET_NAME + ".idx", "tokenizer/tokenizer.json"):
        assert (a.directory / name).read_bytes() == (b.directory / name).read_bytes()


def _build_in_process(cache: str, root: str) -> str:
    return str(ensure_default_corpus(cache_root=Path(cache), vocab_size=300, root=Path(root)).directory)


@pytest.mark.slow
def test_concurrent_builders_leave_one_complete_copy(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    cache = tmp_path / "shared-cache"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        dirs = pool.starmap(_build_in_process, [(str(cache), str(root))] * 3)
    assert len(set(dirs)) == 1
    entries = list((cache / "default_corpus").iterdir())
    assert [e.name for e in entries] == [Path(dirs[0]).name]  # no temporary directories left behind
    assert len(IndexedDataset(Path(dirs[0]) / DATASET_NAME)) == 13


def test_build_data_uses_the_default_corpus(real_corpus, monkeypatch):
    _, _, cache = real_corpus
    monkeypatch.setenv("MESHTRON_CACHE", str(cache))
    cfg = small_config()
    cfg.model.seq_length = 64
    bundle = build_data(cfg, 0, 1)
    assert bundle.vocab_size == DEFAULT_VOCAB_SIZE and bundle.eod is not None
    assert "default corpus" in bundle.description
    assert bundle.valid is not None
    text = bundle.tokenizer.decode(next(bundle.train_batches(0))[0]["tokens"][0].tolist())
    assert len(text) > 64
