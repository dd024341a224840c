"""benchmarks/measured.jsonl: every record well formed, and the memory model against every trusted peak."""

from __future__ import annotations

import os

import pytest

from meshtron.planning.measured import load_records, memory_errors, schema_errors, worst

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "measured.jsonl")
# Target: every trusted peak within 5%. Met by all but one row (median 0.3%); the bounds are the worst row and
# the median rounded up, so that the test fails when the model drifts (docs/planning.md, error per feature).
# Above 5%: g6 (llama3-8b TP=2 + SP, selective, two GPUs, -5.5%: about one full-sequence [s, b, h] tensor per
# layer more than modelled, which tensor not established). h32 (eager ZeRO-3) is -4.5% since the model counts
# ZeRO-3's whole-unit gradient sums (h63, its flags at today's layer code: -0.6%); h14 (+5.3%: the copies'
# backlog, which max_memory_allocated does not count) is left out since the offloading moves the attention
# output too (h67: -0.4%).
TOLERANCE = 0.06
OFFLOAD_TOLERANCE = 0.02
MEDIAN_TOLERANCE = 0.02


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
    import statistics

    from meshtron.planning.measured import left_out

    gone = left_out(records)
    print("left out:", "; ".join(f"{i} ({why})" for i, why in sorted(gone.items())))
    errors = memory_errors(records)
    assert len(errors) >= 70  # the trusted rows of today's code
    assert not {e.id for e in errors} & set(gone)
    offload = {r["id"] for r in records if "--offload-activations" in r["flags"]}
    for label, rows, bound in (("without offloading", [e for e in errors if e.id not in offload], TOLERANCE),
                               ("with offloading", [e for e in errors if e.id in offload], OFFLOAD_TOLERANCE)):
        bad = worst(rows)
        print(f"worst row {label}: {bad.id}: measured {bad.measured_gib:.1f} GiB, estimated "
              f"{bad.estimated_gib:.1f} GiB ({bad.relative:+.1%}); bound {bound:.0%}")
        assert abs(bad.relative) <= bound, bad
    median = statistics.median(abs(e.relative) for e in errors)
    print(f"median |error| {median:.1%} over {len(errors)} rows")
    assert median <= MEDIAN_TOLERANCE


def test_rows_of_changed_code_are_left_out_with_a_reason(records):
    from meshtron.planning.measured import left_out, timed_records, trusted_peaks

    gone = left_out(records)
    # FP8 rows from before b3ecf7b (the same flags peak 8-11% higher since: e4 and e6), rows from before
    # the fused loss's compiled passes (0902068), MoE rows from before 0d04f82 (h18 among them) and the
    # direct grouped-GEMM path of 2aa326e (h19-h23, measured again as h24-h29); c2 is also replaced by d12.
    assert {"d12", "d14", "d20", "a6", "h11", "h18"} <= set(gone) and gone["d12"].startswith("code changed since: b3ecf7b")
    assert gone["h19"].startswith("code changed since: 2aa326e")
    assert "c2" in gone and "e4" not in gone and "h24" not in gone  # h24 measured h19's flags again
    kept = {r["id"] for r in trusted_peaks(records)} | {r["id"] for r in timed_records(records)}
    assert not kept & set(gone) and {"e4", "e6", "h24", "h28"} <= kept
    bad = dict(records[0], code_changed="soon")
    assert any("code_changed" in e for e in schema_errors(bad, [r["id"] for r in records]))


def test_bench_record_appends_a_well_formed_record(tmp_path, records):
    from meshtron.bench import append_record

    row = {k: records[0][k] for k in ("model", "layout", "micro_batch", "global_batch", "seq", "recompute",
                                      "precision", "compile", "step_s", "tokens_per_sec_per_gpu", "tflops_per_gpu",
                                      "mfu", "peak_mem_gib", "est_mem_gib")}
    row.update(argv="--model llama3-1b", leftover_mem_gib=0.5, forward_s=0.2)
    path = str(tmp_path / "measured.jsonl")
    append_record(path, row, records[0]["flags"])
    append_record(path, dict(row, leftover_mem_gib=0.0), records[0]["flags"])
    first, second = load_records(path)
    assert (first["id"], second["id"]) == ("r1", "r2")
    assert not schema_errors(first) and not schema_errors(second)
    assert first["forward_s"] == 0.2 and first["gpu_count"] == 1 and first["torch"]
    assert not first["peak_mem_trusted"] and second["peak_mem_trusted"]  # the first carried 0.5 GiB of a row before


def test_errors_by_feature_count_each_row_under_its_features(records):
    from meshtron.planning.measured import errors_by_feature, record_features

    by_id = {r["id"]: r for r in records}
    assert record_features(by_id["g6"]) == {"TP > 1 (+SP)", "recomputation"}
    assert record_features(by_id["a1"]) == {"one GPU, dense, bf16, no recomputation"}
    assert record_features(by_id["h63"]) == {"sharding strategies", "no torch.compile"}
    errors = memory_errors(records)
    table = {name: (n, bad) for name, n, _, bad in errors_by_feature(errors, records)}
    assert sum(1 for e in errors if "TP > 1 (+SP)" in record_features(by_id[e.id])) == table["TP > 1 (+SP)"][0]
    assert worst(errors) in {bad for _, bad in table.values()}  # the worst row is the worst of its features


def test_long_sequences_with_full_recomputation_are_within_one_percent(records):
    """llama3-1b at 64K, 96K and 128K tokens and llama3-3b at 64K with full recomputation (one H100, h152-h155):
    where the recomputed layer's backward, not the loss, holds the peak (96K and up), the model once missed its
    working set (-8.8% and -12.0%)."""
    by_id = {e.id: e for e in memory_errors(records)}
    long_rows = [r["id"] for r in records if r["recompute"] == "full" and r["seq"] * r["micro_batch"] >= 65536]
    assert {"h152", "h153", "h154", "h155"} <= set(long_rows) <= set(by_id)
    for row in long_rows:
        assert abs(by_id[row].relative) <= 0.01, by_id[row]
