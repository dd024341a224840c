"""Fixtures of the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from _data_helpers import stdlib_texts
from meshtron.data.tokenizer_train import train_bpe_from_texts
from meshtron.data.tokenizers import HuggingFaceTokenizer


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE (vocab 512) trained once per session; also in GPT-2 vocab/merges format."""
    out = tmp_path_factory.mktemp("bpe")
    train_bpe_from_texts(stdlib_texts(), 512, out)
    return out


@pytest.fixture(scope="session")
def bpe(bpe_dir) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(bpe_dir)


@pytest.fixture()
def cache_env(tmp_path, monkeypatch) -> Path:
    """Point meshtron's user cache at a fresh directory."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MESHTRON_CACHE", str(cache))
    return cache

