"""Four gloo ranks: index arrays and the default corpus are built once (rank 0), every rank reads the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from _data_dist import run_gloo
from _data_helpers import small_config, write_jsonl
from meshtron.data.preprocess import TokenizerArgs, preprocess


def _ranks_build_data(rank: int, world: int, prefixes: list, cache: str, corpus_root: str) -> dict:
    from meshtron.data import build_data
    from meshtron.data.default_corpus import ensure_default_corpus

    corpus = ensure_default_corpus(cache_root=Path(cache) / "corpus", vocab_size=300, root=Path(corpus_root))
    cfg = small_config(data_path=["0.6", prefixes[0], "0.4", prefixes[1]], tokenizer_type="NullTokenizer",
                       vocab_size=51, data_cache_path=str(Path(cache) / "indices"))
    # Data-parallel over all 4 ranks: each takes a quarter of every global batch.
    bundle = build_data(cfg, rank, world)
    batches = [torch.cat([mb["tokens"] for mb in it]).numpy() for it in bundle.train_batches(0)]
    return {
        "corpus_built": corpus.built_here,
        "indices_built": [ds.built_indices for ds in bundle.train.datasets + bundle.valid.datasets],
        "batches": batches,
    }


def _dataset(tmp_path: Path, name: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    docs = [" ".join(str(x) for x in rng.integers(0, 50, rng.integers(3, 30))) for _ in range(n)]
    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
    preprocess([str(src)], str(tmp_path / name), TokenizerArgs("NullTokenizer", vocab_size=51), append_eod=True,
               progress=False)
    return str(tmp_path / f"{name}_text_document")


def test_four_ranks_build_indices_once_and_split_each_global_batch(tmp_path):
    prefixes = [_dataset(tmp_path, "a", 80, 1), _dataset(tmp_path, "b", 40, 2)]
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(6):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 5)
    cache = tmp_path / "cache"
    results = run_gloo(_ranks_build_data, 4, prefixes, str(cache), str(root))
    assert [r["corpus_built"] for r in results] == [True, False, False, False]
    assert all(results[0]["indices_built"]) and not any(b for r in results[1:] for b in r["indices_built"])
    # The four ranks' quarters, put together, are the global batches a single process sees.
    from meshtron.data import build_data

    cfg = small_config(data_path=["0.6", prefixes[0], "0.4", prefixes[1]], tokenizer_type="NullTokenizer",
                       vocab_size=51, data_cache_path=str(cache / "indices"))
    single = [torch.cat([mb["tokens"] for mb in it]).numpy() for it in build_data(cfg, 0, 1).train_batches(0)]
    assert len(single) == 20
    for i in range(20):
        assert np.array_equal(np.concatenate([r["batches"][i] for r in results]), single[i])
