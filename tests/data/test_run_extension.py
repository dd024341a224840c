"""Extending a run keeps its data order: `meshtron train` planned for 6 iterations, saved, then resumed
to 12, prints the losses of a run planned for 12 from the start (through the real command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from _data_helpers import write_jsonl
from meshtron.data.preprocess import TokenizerArgs, preprocess

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--lr-decay-iters", "12", "--tokenizer-type", "NullTokenizer", "--vocab-size", "51", "--device", "cpu",
        "--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0", "--seed", "7"]


def _train(tmp_path: Path, data: str, metrics: Path, *flags: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", MESHTRON_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "meshtron", "train", *TINY, "--data-path", data,
                             "--data-cache-path", str(tmp_path / "indices"), "--metrics-file", str(metrics), *flags],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r.get("type") == "train"}


def test_resuming_with_more_train_iters_gives_the_losses_of_the_longer_plan(tmp_path):
    rng = np.random.default_rng(0)
    docs = [" ".join(str(x) for x in rng.integers(0, 50, rng.integers(3, 40))) for _ in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess([str(src)], str(tmp_path / "d"), TokenizerArgs("NullTokenizer", vocab_size=51), append_eod=True,
               progress=False)
    data = str(tmp_path / "d_text_document")  # about 28 samples per epoch: 12 iterations of 4 take two epochs

    extended, planned = tmp_path / "extended.jsonl", tmp_path / "planned.jsonl"
    ckpt = str(tmp_path / "ck")
    _train(tmp_path, data, extended, "--train-iters", "6", "--save", ckpt, "--save-interval", "6")
    _train(tmp_path, data, extended, "--train-iters", "12", "--load", ckpt)
    _train(tmp_path, data, planned, "--train-iters", "12")
    ours, reference = _losses(extended), _losses(planned)
    assert sorted(reference) == list(range(1, 13))
    assert ours == reference  # bit for bit: same samples, same order, same schedule
