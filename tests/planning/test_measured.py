"""benchmarks/measured.jsonl: every record well formed, and the memory model against every trusted peak."""

from __future__ import annotations

import os

import pytest

from meshtron.planning.measured import load_records, memory_errors, schema_errors, worst

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "measured.jsonl")
# Honest target: every trusted peak within 5%. Not met yet. The worst rows: d14 (llama3-1b FP8, +13.0%) and d20
# (llama3-8b FP8 TP=2, -12.9%), FP8 rows of d73183e/8f93816, before the transposed FP8 copies were saved for the
# backward (28107df; the same flags later peak 8-14% higher: e6, e4); MLA + MoE rows (h8, h10, -12%: MLA's
# activations are counted as standard attention's); h14 (selective + offloading, +10.8%: the modelled copy
# backlog); bf16 rows without recomputation are under-estimated by 4-9% (docs/planning.md).
# The bound is the worst error rounded up, so that the test fails when the model drifts further.
TOLERANCE = 0.14


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_records(PATH)


def test_every_record_is_well_formed(records):
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "record ids must be unique"
    problems = {r["id"]: e for r in records if (e := schema_errors(r, ids))}
    assert not problems, problems


def test_record_flags_describe_the_recorded_configuration(records):
    from meshtron.planning.measured import record_config

    for r in records:
        cfg = record_config(r)
        t, p = cfg.train, cfg.parallel
        assert (t.micro_batch_size, cfg.model.seq_length) == (r["micro_batch"], r["seq"]), r["id"]
        if r["global_batch"] is not None:
            assert t.global_batch_size == r["global_batch"], r["id"]
        assert (t.recompute_granularity or "none") == r["recompute"], r["id"]
        assert (f"fp8-{t.fp8_format}" if t.fp8_format else "bf16") == r["precision"], r["id"]
        dp = r["gpu_count"] // (p.tensor_model_parallel_size * p.context_parallel_size
                                * p.pipeline_model_parallel_size)
        assert r["layout"] == (f"TP={p.tensor_model_parallel_size} CP={p.context_parallel_size} DP={dp} "
                               f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size}"), r["id"]


def test_schema_check_catches_a_bad_record(records):
    bad = dict(records[0], layout="TP=2 CP=1 DP=1 PP=1 EP=1", mfu="high", replaces="nope")
    del bad["date"]
    errors = " | ".join(schema_errors(bad, [r["id"] for r in records]))
    assert "missing date" in errors and "gpu_count" in errors and "mfu" in errors and "replaces" in errors


def test_memory_model_against_every_trusted_peak(records):
    errors = memory_errors(records)
    assert len(errors) >= 40  # the trusted rows of docs/benchmarks.md
    bad = worst(errors)
    print(f"worst row: {bad.id}: measured {bad.measured_gib:.1f} GiB, estimated {bad.estimated_gib:.1f} GiB "
          f"({bad.relative:+.1%})")
    assert abs(bad.relative) <= TOLERANCE, bad


def test_bench_record_appends_a_well_formed_record(tmp_path, records):
    from meshtron.bench import _append_record

    row = {k: records[0][k] for k in ("model", "layout", "micro_batch", "global_batch", "seq", "recompute",
                                      "precision", "compile", "step_s", "tokens_per_sec_per_gpu", "tflops_per_gpu",
                                      "mfu", "peak_mem_gib", "est_mem_gib")}
    row.update(argv="--model llama3-1b", leftover_mem_gib=0.5, forward_s=0.2)
    path = str(tmp_path / "measured.jsonl")
    _append_record(path, row, records[0]["flags"])
    _append_record(path, dict(row, leftover_mem_gib=0.0), records[0]["flags"])
    first, second = load_records(path)
    assert (first["id"], second["id"]) == ("r1", "r2")
    assert not schema_errors(first) and not schema_errors(second)
    assert first["forward_s"] == 0.2 and first["gpu_count"] == 1 and first["torch"]
    assert not first["peak_mem_trusted"] and second["peak_mem_trusted"]  # the first carried 0.5 GiB of a row before
