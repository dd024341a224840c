"""`meshtron plot`: figures drawn from real metrics files, checked by size and content."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from meshtron.cli import main  # noqa: E402
from meshtron.plot import read_run, smooth, straggler_matrix  # noqa: E402

TINY = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--vocab-size", "128",
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1"]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Metrics files of two real tiny trainings that differ only in the learning rate."""
    root = tmp_path_factory.mktemp("runs")
    files = []
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        path = root / f"{name}.jsonl"
        assert main(["train", *TINY, "--train-iters", "8", "--lr", lr, "--metrics-file", str(path)]) == 0
        files.append(path)
    return files[0], files[1]


def test_plot_writes_every_figure_of_a_training_run(two_runs, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", str(two_runs[0]), "--out", str(out), "--dpi", "50"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"loss.png", "lr.png", "grad_norm.png", "throughput.png"} <= names
    assert "moe_load.png" not in names and "stragglers.png" not in names  # no such data in a dense run
    width, height = png_size(out / "loss.png")
    # loss against iterations and against tokens: two panels, 1.5x the base width of 8 in at 50 dpi
    assert (width, height) == (600, 225)
    assert png_size(out / "lr.png") == (400, 225)
    printed = capsys.readouterr().out.split()
    assert str(out / "loss.png") in printed


def test_figures_differ_when_the_data_differ(two_runs, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["plot", str(two_runs[0]), "--out", str(a), "--label", "run"]) == 0
    assert main(["plot", str(two_runs[1]), "--out", str(b), "--label", "run"]) == 0
    again = tmp_path / "again"
    assert main(["plot", str(two_runs[0]), "--out", str(again), "--label", "run"]) == 0
    assert (a / "lr.png").read_bytes() != (b / "lr.png").read_bytes()
    assert (a / "lr.png").read_bytes() == (again / "lr.png").read_bytes()  # deterministic drawing


def test_several_runs_in_one_figure_and_svg(two_runs, tmp_path):
    out = tmp_path / "both"
    assert main(["plot", str(two_runs[0]), str(two_runs[1]), "--label", "lr 1e-3", "--label", "lr 3e-3",
                 "--out", str(out), "--format", "png,svg", "--smooth", "3", "--log-loss"]) == 0
    svg = (out / "loss.svg").read_text()
    assert "lr 1e-3 train" in svg and "lr 3e-3 validation" in svg  # both runs in the legend
    single = tmp_path / "single"
    assert main(["plot", str(two_runs[0]), "--label", "lr 1e-3", "--out", str(single)]) == 0
    assert (out / "loss.png").read_bytes() != (single / "loss.png").read_bytes()


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_straggler_heat_map_events_and_moe(tmp_path):
    records = []
    for it in range(1, 7):
        records.append({"type": "train", "iteration": it, "consumed_samples": 4 * it, "loss": 5.0 - 0.1 * it,
                        "lr": 1e-3, "grad_norm": 1.0, "expert_load_max": 1.5, "expert_load_min": 0.5})
        records.append({"type": "straggler", "iteration": it, "ranks": [0, 1, 2],
                        "sections": ["forward", "optimizer"],
                        "relative": [[1.0, 1.0], [1.0 + it, 1.1], [0.9, 1.0]]})
    records.append({"type": "rerun", "iteration": 3, "rank": 1, "result": "transient"})
    records.append({"type": "train", "iteration": 4, "loss": None, "nonfinite": True})  # a repeated iteration
    path = _write(tmp_path / "m.jsonl", records)
    run = read_run(path)
    iterations, ranks, scores = straggler_matrix(run)
    assert iterations == [1, 2, 3, 4, 5, 6] and ranks == [0, 1, 2]
    assert scores[1] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # the largest section of rank 1
    assert run.nonfinite_iterations() == [4]  # the last record of an iteration counts
    out = tmp_path / "figs"
    assert main(["plot", str(path), "--out", str(out)]) == 0
    assert {"stragglers.png", "moe_load.png", "loss.png"} <= {p.name for p in out.iterdir()}
    calm = _write(tmp_path / "calm.jsonl", [r if r.get("type") != "straggler" else
                                            {**r, "relative": [[1.0, 1.0]] * 3} for r in records])
    out2 = tmp_path / "calm"
    assert main(["plot", str(calm), "--out", str(out2)]) == 0
    assert (out / "stragglers.png").read_bytes() != (out2 / "stragglers.png").read_bytes()


def test_bench_rows_as_bar_charts(tmp_path):
    rows = [{"model": "llama3-1b", "layout": "TP=1", "micro_batch": 8, "precision": "bf16",
             "tokens_per_sec_per_gpu": 64000.0, "peak_mem_gib": 67.6},
            {"model": "llama3-1b", "layout": "TP=1", "micro_batch": 8, "precision": "fp8-e4m3",
             "tokens_per_sec_per_gpu": 75000.0, "peak_mem_gib": 60.0}]
    path = tmp_path / "bench.jsonl"
    path.write_text("a log line\n" + "".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "bench"
    assert main(["plot", "--bench", str(path), "--out", str(out)]) == 0
    assert png_size(out / "bench.png")[0] > 0


@pytest.mark.parametrize("argv, words", [
    (["missing.jsonl"], "does not exist"),
    ([], "metrics files"),
    (["--format", "gif", "x.jsonl"], "--format"),
    (["--smooth", "0", "x.jsonl"], "--smooth"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, words):
    assert main(["plot", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def _train_lines(iterations: range) -> str:
    return "".join(json.dumps({"type": "train", "iteration": i, "loss": 5.0 - 0.1 * i}) + "\n" for i in iterations)


def test_cut_off_last_line_of_a_killed_run_is_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(_train_lines(range(1, 6)) + '{"type": "train", "iteration": 6, "lo')  # killed mid-write
    out = tmp_path / "o"
    assert main(["plot", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip()
    assert err == (f"meshtron plot: note: metrics file {path}: skipped 1 line: the last line (6), cut off "
                   "(a run stopped while writing it)"), err
    assert png_size(out / "loss.png")[0] > 0
    assert [r["iteration"] for r in read_run(path).train] == [1, 2, 3, 4, 5]


def test_damaged_middle_line_is_skipped_with_a_warning_naming_it(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(_train_lines(range(1, 3)) + "{not json\n" + "[1, 2]\n" + _train_lines(range(3, 5)))
    assert main(["plot", str(path), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtron plot: warning: ") and len(err.splitlines()) == 1, err
    assert "skipped 2 lines: line(s) 3, 4 (not JSON objects" in err and "cut off" not in err, err
    assert [r["iteration"] for r in read_run(path).train] == [1, 2, 3, 4]


def test_a_file_with_nothing_whole_is_still_refused(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"type": "tra')
    assert main(["plot", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "nothing to plot" in capsys.readouterr().err


def test_missing_matplotlib_is_named(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    path = _write(tmp_path / "m.jsonl", [{"type": "train", "iteration": 1, "loss": 2.0}])
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smooth([1.0, 5.0], 1) == [1.0, 5.0]
