"""meshtron.data: tokenizers, preprocessing, Megatron-format indexed datasets, GPT samples, blending, loading.

The training loop calls :func:`build_data`, which returns a :class:`DataBundle`. The command line
dispatches ``meshtron preprocess`` to :func:`preprocess_main` and ``meshtron tokenizer train`` to
:func:`tokenizer_main`. Names are imported on first use, so that the preprocessing and tokenizer
commands start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "build_data": "meshtron.data.build",
    "DataBundle": "meshtron.data.build",
    "DataError": "meshtron.data.errors",
    "Tokenizer": "meshtron.data.tokenizers",
    "build_tokenizer": "meshtron.data.tokenizers",
    "load_tokenizer": "meshtron.data.tokenizers",
    "tokenizer_from_config": "meshtron.data.tokenizers",
    "train_tokenizer": "meshtron.data.tokenizer_train",
    "tokenizer_main": "meshtron.data.tokenizer_train",
    "preprocess_main": "meshtron.data.preprocess",
    "IndexedDataset": "meshtron.data.indexed_dataset",
    "IndexedDatasetWriter": "meshtron.data.indexed_dataset",
    "merge_datasets": "meshtron.data.indexed_dataset",
    "ensure_default_corpus": "meshtron.data.default_corpus",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from meshtron.data.build import DataBundle, build_data
    from meshtron.data.default_corpus import ensure_default_corpus
    from meshtron.data.errors import DataError
    from meshtron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, merge_datasets
    from meshtron.data.preprocess import preprocess_main
    from meshtron.data.tokenizer_train import tokenizer_main, train_tokenizer
    from meshtron.data.tokenizers import Tokenizer, build_tokenizer, load_tokenizer, tokenizer_from_config


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtron.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
