"""``meshtron train --reset-attention-mask --reset-position-ids --eod-mask-loss`` on an indexed dataset
of short documents: the block-mask path (flex attention's on CUDA; the block table's on the CPU) logs the
losses of the dense-mask reference, in one process and with CP=2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.layers.documents import PATH_ENV
from tests.short_documents import write_short_documents

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_short_documents(tmp_path_factory.mktemp("docs"))


def _train(tmp: Path, data: str, path: str, nproc: int, extra: list[str]) -> list[float]:
    metrics = tmp / f"{path}-{nproc}.jsonl"
    argv = [sys.executable, "-m", "meshtron", "train", "--device", "cpu", "--data-path", data,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "51", "--split", "98,2,0",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--train-iters", "3", "--log-interval", "1", "--eval-interval", "0",
            "--num-workers", "0", "--data-cache-path", str(tmp / f"cache-{path}-{nproc}"), "--metrics-file",
            str(metrics), *extra]
    if nproc > 1:
        argv += ["--nproc-per-node", str(nproc)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({PATH_ENV: path, "OMP_NUM_THREADS": "1"})
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["loss"] for r in records if r["type"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,extra", [(1, []), (2, ["--context-parallel-size", "2"])], ids=["one-process", "cp2"])
def test_block_mask_path_logs_the_dense_losses(tmp_path, dataset, nproc, extra):
    dense = _train(tmp_path, dataset, "dense", nproc, extra)
    blocks = _train(tmp_path, dataset, "blocks", nproc, extra)
    assert len(dense) == 3
    assert blocks == pytest.approx(dense, rel=1e-5, abs=1e-5)
