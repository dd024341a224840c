"""Through the trainer: two pipeline stages (1F1B and interleaved) log the same training and
evaluation losses as one process, on every rank, and in the metrics file."""

from __future__ import annotations

import json
import os

import pytest

from meshtron.config import MeshtronConfig
from tests.distributed.launch import run_distributed


def _config(pp: int = 1, vpp=None, metrics_file=None) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 4, 32, 4, 64, 8
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    p = cfg.parallel
    p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size = pp, vpp
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 4, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 2, 2, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    log = cfg.log
    log.log_interval, log.quiet, log.progress_bar, log.metrics_file = 1, True, False, metrics_file
    return cfg


def _train(rank: int, world: int, runs: list[tuple[int, object, str]]) -> list[tuple[dict, dict]]:
    from meshtron.training.trainer import run_training

    out = []
    for pp, vpp, metrics in runs:
        result = run_training(_config(pp, vpp, metrics))
        out.append((result.train_losses, result.eval_losses))
    return out


def _read_metrics(path: str) -> tuple[dict, dict]:
    train, evals = {}, {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["type"] == "train":
                train[rec["iteration"]] = rec["loss"]
            elif rec["type"] == "eval":
                evals[rec["iteration"]] = rec["loss"]
    return train, evals


def test_trainer_pipeline_logs_the_single_process_losses(tmp_path):
    pytest.importorskip("meshtron.data.mock")
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref = run_training(_config(1, None, str(tmp_path / "ref.jsonl")))
    assert len(ref.train_losses) == 4 and len(ref.eval_losses) == 3  # iteration 0 and every interval
    runs = [(2, None, str(tmp_path / "pp2.jsonl")), (2, 2, str(tmp_path / "pp2v2.jsonl"))]
    results = run_distributed(_train, 2, runs, timeout=240)
    for (pp, vpp, metrics), i in zip(runs, range(len(runs))):
        for rank, per_run in enumerate(results):
            train, evals = per_run[i]
            for got, want in ((train, ref.train_losses), (evals, ref.eval_losses)):
                assert got.keys() == want.keys()
                for it in want:
                    assert got[it] == pytest.approx(want[it], rel=1e-5), f"pp={pp} v={vpp} rank {rank} iteration {it}"
        train, evals = _read_metrics(metrics)
        assert train == pytest.approx(ref.train_losses, rel=1e-5) and evals == pytest.approx(ref.eval_losses, rel=1e-5)
