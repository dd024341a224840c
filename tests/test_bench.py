"""`meshtron bench` runs a matrix of rows in one process and reports each."""

from __future__ import annotations

import json
import re

from meshtron.bench import bench_main, expand_rows, format_table


def test_comma_values_expand_into_rows():
    rows = expand_rows(["--model", "tiny", "--micro-batch-size", "2,4", "--seq-length", "16,32"])
    assert len(rows) == 4
    assert ["--model", "tiny", "--micro-batch-size", "4", "--seq-length", "16"] in rows


def test_bench_rows_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    matrix = tmp_path / "m.yaml"
    matrix.write_text("base: {model: tiny, vocab_size: 300, device: cpu, seq_length: 32}\n"
                      "rows:\n  - {micro_batch_size: 2, global_batch_size: 4}\n"
                      "  - {micro_batch_size: 4, global_batch_size: 4, recompute_granularity: selective}\n")
    assert bench_main(["--matrix", str(matrix), "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["micro_batch"] for r in rows] == [2, 4]
    assert rows[1]["recompute"] == "selective"
    for r in rows:
        assert r["tokens_per_sec_per_gpu"] > 0 and r["step_s"] > 0 and r["mfu"] is None  # no peak on CPU
        assert r["est_mem_gib"] > 0
        assert 0 < r["data_s"] < r["step_s"] and r["forward_s"] > 0  # the step split, data included
    table = format_table(rows)
    assert table.count("\n") == 3 and "tiny" in table
    assert "| tiny |" in capsys.readouterr().out


def test_comma_valued_flags_are_not_sweeps():
    rows = expand_rows(["--layer-pattern", "gdn+dense*3,gated_attn+dense", "--micro-batch-size", "1,2",
                        "--split", "98,2,0"])
    assert rows == [["--layer-pattern", "gdn+dense*3,gated_attn+dense", "--micro-batch-size", m, "--split", "98,2,0"]
                    for m in ("1", "2")]


def test_every_benchmark_matrix_in_the_repository_validates(monkeypatch):
    """The matrices that GPU runs use stay valid as flags change (world size from their launch command;
    validated as on a GPU machine)."""
    from meshtron import validation

    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    from pathlib import Path

    from meshtron.bench import yaml_rows
    from meshtron.cli import build_config
    from meshtron.validation import validate_config

    matrices = sorted(Path(__file__).resolve().parents[1].glob("benchmarks/*.yaml"))
    assert matrices
    for path in matrices:
        launch = re.search(r"nproc-per-node (\d+)", path.read_text())
        world = int(launch.group(1)) if launch else (2 if "two" in path.name else 1)
        base, rows = yaml_rows(str(path))
        for row in rows:
            for argv in expand_rows(base + row):
                validate_config(build_config(["--mock-data", "--device", "cuda"] + argv), world)


def test_no_split_skips_the_step_time_split(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert bench_main(["--model", "tiny", "--vocab-size", "300", "--device", "cpu", "--seq-length", "16",
                       "--micro-batch-size", "2", "--global-batch-size", "2", "--warmup", "1", "--steps", "1",
                       "--no-split", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["step_s"] > 0 and row["forward_s"] is None and row["exposed_comm_s"] is None and row["data_s"] is None
    assert "| - |" in format_table([row])


def test_bench_row_frees_its_model_for_the_next_row(monkeypatch):
    """A compiled row's parameters must not outlive it: the gradient hooks form a cycle that compiled
    graphs keep alive, which on a GPU carried one row's weights and buffers into the next row's peak."""
    import gc
    import weakref

    import torch

    from meshtron.bench import bench_row
    from meshtron.optim.grad_buffer import GradBuffer

    created = []
    original_init = GradBuffer.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    monkeypatch.setattr(GradBuffer, "__init__", recording_init)
    bench_row(["--model", "tiny", "--vocab-size", "300", "--device", "cpu", "--seq-length", "16",
               "--micro-batch-size", "2", "--global-batch-size", "2", "--compile"], 1, 1, split=False)
    torch._dynamo.reset()
    gc.collect()
    assert len(created) == 1 and created[0]() is None


def test_without_warmup_the_step_is_the_warm_passes_and_the_cold_one_is_reported(monkeypatch):
    """A run of no warm-up times its first step, which compiles and grows the allocator: the step is then the
    warm passes' sum with a separately timed optimizer step, and the cold step is kept as first_step_s."""
    import meshtron.bench as bench

    argv = ["--model", "tiny", "--vocab-size", "300", "--device", "cpu", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4"]
    calls = []
    original_measure = bench._measure

    def slow_first_step(trainer, *args, **kwargs):
        step = trainer.train_step

        def train_step(batches, it):
            calls.append(it)
            if len(calls) == 1:
                import time
                time.sleep(0.5)  # what a first step's compilation costs
            return step(batches, it)

        trainer.train_step = train_step
        return original_measure(trainer, *args, **kwargs)

    monkeypatch.setattr(bench, "_measure", slow_first_step)
    cold = bench.bench_row(argv, 0, 1)
    assert cold["first_step_s"] >= 0.5 > cold["step_s"]
    parts = cold["data_s"] + cold["forward_s"] + cold["backward_s"] + cold["exposed_comm_s"] + cold["optimizer_s"]
    assert abs(cold["step_s"] - parts) < 1e-9 and cold["optimizer_s"] > 0
    calls.clear()
    warm = bench.bench_row(argv, 1, 1)
    assert "first_step_s" not in warm and warm["step_s"] < 0.5
