"""`meshtron train --data-order megatron` end to end: two data-parallel processes train on the global batches of one
process (Megatron's order and per-rank assignment), with validation continuing across evaluations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_cases  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--device", "cpu", "--log-interval", "1",
        "--seed", "7", "--data-order", "megatron", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--split", "98,2,0"]


def _train(tmp_path: Path, prefixes: dict, metrics: Path, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", MESHTRON_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "meshtron", "train", *TINY, "--data-path", "0.3", prefixes["A"],
                             "0.7", prefixes["B"], "--data-cache-path", str(tmp_path / "indices"), "--metrics-file",
                             str(metrics), *flags], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_two_data_parallel_processes_train_on_the_one_process_batches(tmp_path):
    prefixes = megatron_cases.write_datasets(tmp_path)
    one = _train(tmp_path, prefixes, tmp_path / "one.jsonl")
    two = _train(tmp_path, prefixes, tmp_path / "two.jsonl", "--nproc-per-node", "2")
    for kind in ("train", "eval"):
        a = {r["iteration"]: r["loss"] for r in one if r["type"] == kind}
        b = {r["iteration"]: r["loss"] for r in two if r["type"] == kind}
        assert sorted(a) == sorted(b) and a
        for it in a:
            assert b[it] == pytest.approx(a[it], rel=1e-5), (kind, it)
    lrs = [r["lr"] for r in one if r["type"] == "train"]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)  # Megatron's warm-up: iteration 1 at 0, 3 at --lr


def test_data_parallel_ranks_take_megatron_micro_batches(tmp_path):
    """Rank r's micro-batch m holds samples (m*dp + r)*mbs .. of the global batch, as Megatron-LM's sampler."""
    from meshtron.data.build import build_data

    prefixes = megatron_cases.write_datasets(tmp_path)
    cfg = megatron_cases.meshtron_config(megatron_cases.DATA_CASES["weighted"], prefixes, tmp_path / "c")
    cfg.train.micro_batch_size = 2
    single = build_data(cfg, 0, 1)
    ranks = [build_data(cfg, r, 2) for r in range(2)]
    for i, batches in enumerate(zip(*[b.train_batches(0) for b in ranks])):
        if i == 3:
            break
        want = single.train.samples(i * 8, 8)[:, :-1]
        for r, micro in enumerate(batches):
            for m, mb in enumerate(micro):
                first = (m * 2 + r) * 2
                assert np.array_equal(mb["tokens"].numpy(), want[first:first + 2])


def test_validation_continues_across_evaluations(tmp_path):
    """Evaluation k (after iteration i: k = (i - 1) // --eval-interval) reads the k-th block of --eval-iters batches."""
    from meshtron.data.build import build_data

    prefixes = megatron_cases.write_datasets(tmp_path)
    case = megatron_cases.DATA_CASES["weighted"]  # eval every 20 iterations, 3 batches each
    bundle = build_data(megatron_cases.meshtron_config(case, prefixes, tmp_path / "c"), 0, 1)
    for iteration, block in ((20, 0), (40, 1), (60, 2)):
        got = [mb["tokens"].numpy() for it in bundle.valid_batches(iteration) for mb in it]
        want = bundle.valid.samples(block * 3 * 8, 3 * 8)[:, :-1]
        assert np.array_equal(np.concatenate(got), want), iteration
