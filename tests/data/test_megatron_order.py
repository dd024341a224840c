"""--data-order megatron: Megatron-Core's GPTDataset/BlendedDataset order, batch for batch.

The fixtures (tests/fixtures/megatron/data_order.json, written by make_fixtures.py there with megatron-core
0.19.2) hold megatron-core's own arrays and samples; the oracle tests compare with megatron-core directly
where it is installed (the ``megatron-oracle`` extra).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_cases  # noqa: E402
from megatron_oracle import dataset_modules  # noqa: E402

from meshtron.data import megatron_order as mo  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "data_order.json"


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURES.read_text())


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> dict:
    return megatron_cases.write_datasets(tmp_path_factory.mktemp("megatron_data"))


def test_index_arrays_equal_megatron_core_fixture(fixture):
    for case in fixture["indices"]:
        sizes = np.asarray(case["sizes"], dtype=np.int32)
        docs = np.arange(*case["documents"], dtype=np.int32)
        arrays = mo.build_gpt_indices(sizes, docs, case["num_samples"], case["seq_length"], case["seed"],
                                      extra_token=case["extra_token"])
        for name, arr, dtype in zip(("document_index", "sample_index", "shuffle_index"), arrays, case["dtypes"]):
            assert str(arr.dtype) == dtype, (name, case["seed"])
            assert arr.tolist() == case[name], (name, case["seed"])


@pytest.mark.parametrize("name", sorted(megatron_cases.DATA_CASES))
def test_splits_equal_megatron_core_fixture(name, fixture, prefixes, tmp_path):
    """Split, sample counts, blends and every sample's tokens, through build_data as a run builds them."""
    got = megatron_cases.meshtron_splits(megatron_cases.DATA_CASES[name], prefixes, tmp_path / "cache")
    assert got == fixture["cases"][name]


def test_blending_indices_equal_megatron_core():
    _, _, helpers = dataset_modules()
    rng = np.random.default_rng(0)
    for _ in range(30):
        k = int(rng.integers(1, 9))
        w = mo.normalize(rng.random(k) + 0.01)
        size = int(rng.integers(1, 4000))
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(di, dsi, np.asarray(w), k, size, False)
        a, b = mo.build_blending_indices(w, size)
        assert np.array_equal(a, di) and np.array_equal(b, dsi), (w, size)


def test_index_arrays_equal_megatron_core():
    gpt, _, helpers = dataset_modules()
    rng = np.random.default_rng(1)
    checked = 0
    for trial in range(200):
        n = int(rng.integers(1, 40))
        sizes = rng.integers(0, 60, size=n + 5).astype(np.int32)
        docs = np.arange(2, 2 + n, dtype=np.int32)
        if int(sizes[docs].sum()) < 2:
            continue
        seq, num, seed = int(rng.integers(2, 50)), int(rng.integers(0, 300)), int(rng.integers(0, 10**6))
        extra = bool(trial % 3)
        try:
            ref = megatron_cases.megatron_indices(gpt, helpers, sizes, docs, num, seq, seed, extra)
        except AssertionError:
            continue
        got = mo.build_gpt_indices(sizes, docs, num, seq, seed, extra_token=extra)
        for r, g in zip(ref, got):
            assert g.dtype == r.dtype and np.array_equal(g, r), (trial, seq, num)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("name", ["single", "weighted"])
def test_splits_equal_megatron_core(name, prefixes, tmp_path):
    case = megatron_cases.DATA_CASES[name]
    want = megatron_cases.megatron_splits(case, prefixes, tmp_path / "megatron_cache")
    assert megatron_cases.meshtron_splits(case, prefixes, tmp_path / "cache") == want


def test_split_ranges_and_counts():
    assert mo.split_document_ranges(2000, "969,30,1") == [(0, 1938), (1938, 1998), (1998, 2000)]
    assert mo.split_document_ranges(10, "98,2,0")[2] is None
    # Megatron-LM: validation holds one block of --eval-iters batches per evaluation, the last one included.
    assert mo.split_sample_counts(100, 8, 5, 30, None) == (800, (100 // 30 + 1) * 5 * 8, 40)
    assert mo.split_sample_counts(100, 8, 5, 30, 801) == (801, 160, 40)


def test_sample_index_speed():
    """Millions of samples: the sample index is vectorised, the blend a tight loop."""
    sizes = np.random.default_rng(0).integers(1, 2000, 200_000).astype(np.int32)
    docs = np.arange(sizes.size, dtype=np.int32)
    t = time.perf_counter()
    _, s, sh = mo.build_gpt_indices(sizes, docs, 2_000_000, 1024, 1)
    built = time.perf_counter() - t
    assert sh.size >= 2_000_000 and s.shape[0] == sh.size + 1
    t = time.perf_counter()
    mo.build_blending_indices([0.5, 0.3, 0.2], 1_000_000)
    blended = time.perf_counter() - t
    assert built < 10 and blended < 10, (built, blended)


def test_megatron_order_refuses_mock_data():
    from meshtron.config import ConfigError
    from meshtron.validation import check, resolve

    cfg = megatron_cases.meshtron_config(megatron_cases.DATA_CASES["single"], {}, Path("."))
    cfg.data.data_path = []
    cfg.data.mock_data = True
    resolve(cfg, 1)
    with pytest.raises(ConfigError, match="--data-order megatron"):
        check(cfg, 1)
