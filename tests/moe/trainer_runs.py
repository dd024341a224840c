"""Shared by the MoE trainer tests: the metrics file's train records, and a check that every layout's run
logs the one-process run's values, iteration by iteration."""

from __future__ import annotations

import json
from typing import Callable, Sequence

import pytest

from tests.distributed.launch import run_distributed


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
