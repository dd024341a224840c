"""``meshtron train --cp-comm-type a2a`` (and ``a2a+p2p``) through the command line on CPU processes logs
the losses and gradient norms of one process: GQA (8 heads, 2 key/value heads: repeated under CP=4 and
TP=2 x CP=2), packed documents (``--reset-attention-mask --reset-position-ids --eod-mask-loss``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.resilience.cli_runs import free_port
from tests.short_documents import write_short_documents

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--train-iters", "3", "--log-interval", "1", "--eval-interval", "0"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_short_documents(tmp_path_factory.mktemp("docs"))


def train(tmp: Path, data: str, name: str, nproc: int, *flags: str) -> list[tuple[float, float]]:
    """(loss, grad norm) of every iteration of one ``meshtron train`` run on ``nproc`` CPU processes."""
    metrics = tmp / f"{name}.jsonl"
    argv = [sys.executable, "-m", "meshtron", "train", "--device", "cpu", "--data-path", data,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "51", "--split", "98,2,0", "--num-workers", "0",
            "--data-cache-path", str(tmp / f"cache-{name}"), "--metrics-file", str(metrics), *MODEL, *flags]
    if nproc > 1:
        argv += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(r["loss"], r["grad_norm"]) for r in records if r["type"] == "train"]


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> dict:
    """One process, with and without documents (made on first use)."""
    tmp, runs = tmp_path_factory.mktemp("ref"), {}

    def get(documents: bool):
        if documents not in runs:
            runs[documents] = train(tmp, dataset, f"one-{documents}", 1, *(DOCUMENTS if documents else []))
        return runs[documents]
    return get


def _assert_same(got, want):
    assert len(got) == len(want) == 3
    for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), f"iteration {it + 1} loss"
        assert norm == pytest.approx(ref_norm, rel=1e-5, abs=1e-5), f"iteration {it + 1} grad norm"


CASES = [  # (id, processes, flags, documents, slow)
    ("cp2-a2a-documents", 2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], True, False),
    ("cp4-a2a", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a"], False, True),
    ("cp4-a2a-documents", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "a2a"], True, True),
    ("cp4-a2a+p2p-2x2-documents", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                      "--hierarchical-context-parallel-sizes", "2", "2"], True, True),
    ("tp2-cp2-a2a-documents", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--context-parallel-size", "2", "--cp-comm-type", "a2a"], True, True),
]


@pytest.mark.parametrize("nproc,flags,documents", [
    pytest.param(n, f, d, id=i, marks=[pytest.mark.slow] if slow else []) for i, n, f, d, slow in CASES])
def test_a2a_logs_the_single_process_losses(tmp_path, dataset, reference, nproc, flags, documents):
    got = train(tmp_path, dataset, "cp", nproc, *flags, *(DOCUMENTS if documents else []))
    _assert_same(got, reference(documents))
