"""Shared by the MoE trainer tests: the tiny runs' settings, the metrics file's train records, and a check that
every layout's run logs the one-process run's values, iteration by iteration."""

from __future__ import annotations

import json
from typing import Callable, Sequence

import pytest

from tests.distributed.launch import run_distributed


def set_tiny_run(cfg, metrics_file: str, tp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                 dist_opt: bool = False) -> None:
    """The layout, and the settings of a three-iteration CPU run on mock data logging every iteration to
    ``metrics_file``, shared by the model tests' tiny configurations (their model fields are their own)."""
    p = cfg.parallel
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.pipeline_model_parallel_size = tp, ep, pp
    p.sequence_parallel, p.use_distributed_optimizer = sp, dist_opt
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 3, 5, "cpu"
    t.eval_interval, t.compile, t.generate_sample = 0, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    cfg.optim.clip_grad, cfg.optim.weight_decay = 1.0, 0.1
    log = cfg.log
    log.log_interval, log.quiet, log.progress_bar, log.metrics_file = 1, True, False, metrics_file


def train_records(path: str) -> dict[int, dict]:
    """The ``train`` records of a metrics file, by iteration."""
    with open(path) as f:
        return {r["iteration"]: r for r in map(json.loads, f) if r["type"] == "train"}


def assert_layouts_log_the_reference(worker: Callable, layouts: dict, tmp_path, ref_losses: dict,
                                     ref_records: dict[int, dict], keys: Sequence[str], world: int = 4) -> None:
    """Run ``worker(rank, world, runs)`` (one trainer run per layout, each writing its metrics file) on
    ``world`` processes and compare each layout's losses on every rank and its logged ``keys`` with the
    reference, to 1e-5."""
    runs = [(str(tmp_path / f"{name}.jsonl"), layout) for name, layout in layouts.items()]
    results = run_distributed(worker, world, runs, timeout=300)
    for i, name in enumerate(layouts):
        for rank, per_run in enumerate(results):
            assert per_run[i] == pytest.approx(ref_losses, rel=1e-5), f"{name} rank {rank}"
        records = train_records(runs[i][0])
        for it, want in ref_records.items():
            for key in keys:
                assert records[it][key] == pytest.approx(want[key], rel=1e-5), f"{name} iteration {it} {key}"
