"""`meshtron plot`: figures from metrics files (``--metrics-file``) and from ``meshtron bench --json`` rows.

One or more metrics files become one set of figures, one line per run with a legend (a run is labelled by
``--label`` or by its file name):

- ``loss``: training and validation loss against iterations, and against tokens when the records carry
  ``consumed_tokens``; hang, re-run and weight-hash events and non-finite iterations are marked on it;
- ``lr``, ``grad_norm``, ``throughput`` (tokens/s/GPU and MFU), ``memory`` (peak GiB);
- ``moe_load`` (the busiest and idlest expert's share of tokens against the mean) when the run is a MoE;
- ``stragglers``: a rank-by-iteration heat map of the straggler scores, one per run that has them.

A figure whose data no run has is not written. ``--bench FILE`` draws bar charts (tokens/s/GPU and peak memory
per row) from ``meshtron bench --json`` output instead.

matplotlib is an optional dependency (``pip install -e '.[plot]'``). Figures are drawn on
``matplotlib.figure.Figure`` objects with the Agg canvas, never through pyplot, so plotting changes no
process-wide state.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from meshtron.config import ConfigError

#: Formats `--format` accepts.
FORMATS = ("png", "svg")
#: Events drawn as vertical marks on the loss curve: type -> (colour, label).
EVENT_MARKS = {"hang": ("tab:red", "hang"), "rerun": ("tab:orange", "re-run"),
               "weight_hash": ("tab:purple", "weight hash mismatch"), "restart": ("tab:gray", "restart")}


@dataclass
class Run:
    """The records of one metrics file, split by type."""

    label: str
    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # every record that is neither train nor eval
    skipped: list[int] = field(default_factory=list)  # numbers of the lines that are not whole JSON objects
    last_line: int = 0  # number of the file's last non-empty line

    @property
    def damaged(self) -> bool:
        """Whether a line other than the last was skipped (a cut-off last line is the normal end of a killed run)."""
        return any(n != self.last_line for n in self.skipped)

    def skipped_note(self, path: Path) -> Optional[str]:
        """One line saying which lines were left out, or None when every line was read."""
        if not self.skipped:
            return None
        middle = [n for n in self.skipped if n != self.last_line]
        parts = []
        if middle:
            shown = ", ".join(map(str, middle[:5])) + (f" and {len(middle) - 5} more" if len(middle) > 5 else "")
            parts.append(f"line(s) {shown} (not JSON objects: damaged?)")
        if self.last_line in self.skipped:
            parts.append(f"the last line ({self.last_line}), cut off (a run stopped while writing it)")
        count = len(self.skipped)
        return f"metrics file {path}: skipped {count} line{'s' if count > 1 else ''}: {'; '.join(parts)}"

    def series(self, key: str, records: Optional[list[dict]] = None, x: str = "iteration") -> tuple[list, list]:
        """(x, y) of the records that have a number for ``key`` and ``x``."""
        xs, ys = [], []
        for r in self.train if records is None else records:
            value, position = r.get(key), r.get(x)
            if _is_number(value) and _is_number(position):
                xs.append(position)
                ys.append(value)
        return xs, ys

    def nonfinite_iterations(self) -> list[int]:
        return [r["iteration"] for r in self.train if r.get("nonfinite") and _is_number(r.get("iteration"))]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_run(path: Path, label: Optional[str] = None) -> Run:
    """Parse a metrics file. A line that is not a JSON object is skipped and counted in ``Run.skipped``:
    a killed run leaves its last line cut off, and the lines before it are still worth drawing."""
    if not path.is_file():
        raise ConfigError(f"metrics file {path} does not exist")
    run = Run(label or path.stem)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"metrics file {path} cannot be read: {err}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        run.last_line = number
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            run.skipped.append(number)
            continue
        kind = record.get("type")
        (run.train if kind == "train" else run.eval if kind == "eval" else run.events).append(record)
    # A restarted job appends the iterations it repeats: the last record of an iteration is the one that counts.
    run.train = _last_per_iteration(run.train)
    run.eval = _last_per_iteration(run.eval)
    return run


def _last_per_iteration(records: list[dict]) -> list[dict]:
    by_iteration: dict[Any, dict] = {}
    for r in records:
        by_iteration[r.get("iteration")] = r
    return sorted(by_iteration.values(), key=lambda r: r.get("iteration") if _is_number(r.get("iteration")) else -1)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average what exists)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# ---------------------------------------------------------------------------------------------- figures
def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("meshtron plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") \
            from None
    return Figure, FigureCanvasAgg


@dataclass
class PlotOptions:
    """How figures are drawn and written."""

    out_dir: Path
    formats: tuple[str, ...] = ("png",)
    smooth: int = 1
    log_loss: bool = False
    width: float = 8.0   # inches
    height: float = 4.5
    dpi: int = 100


def _new_figure(opts: PlotOptions, columns: int = 1):
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(opts.width * (1 if columns == 1 else 1.5), opts.height), dpi=opts.dpi)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, columns, i + 1) for i in range(columns)]
    return fig, axes


def _save(fig, name: str, opts: PlotOptions) -> list[Path]:
    fig.tight_layout()
    paths = []
    for fmt in opts.formats:
        path = opts.out_dir / f"{name}.{fmt}"
        fig.savefig(path, format=fmt)
        paths.append(path)
    return paths


def _loss_figure(runs: list[Run], opts: PlotOptions) -> Optional[list[Path]]:
    if not any(run.series("loss")[0] for run in runs):
        return None
    by_tokens = any(run.series("loss", x="consumed_tokens")[0] for run in runs)
    fig, axes = _new_figure(opts, 2 if by_tokens else 1)
    for ax, x in zip(axes, ("iteration", "consumed_tokens")):
        for i, run in enumerate(runs):
            colour = f"C{i % 10}"
            xs, ys = run.series("loss", x=x)
            ax.plot(xs, smooth(ys, opts.smooth), color=colour, label=f"{run.label} train")
            ex, ey = run.series("loss", run.eval, x=x) if x == "iteration" else _eval_by_tokens(run)
            if ex:
                ax.plot(ex, ey, color=colour, linestyle="--", marker="o", markersize=3, label=f"{run.label} validation")
            if x == "iteration":
                _mark_events(ax, run)
        ax.set_xlabel("iteration" if x == "iteration" else "tokens")
        ax.set_ylabel("loss")
        if opts.log_loss:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, "loss", opts)


def _eval_by_tokens(run: Run) -> tuple[list, list]:
    """Validation losses placed at the token count of the training record of the same iteration."""
    tokens = {r["iteration"]: r["consumed_tokens"] for r in run.train
              if _is_number(r.get("consumed_tokens")) and _is_number(r.get("iteration"))}
    xs, ys = [], []
    for r in run.eval:
        if r.get("iteration") in tokens and _is_number(r.get("loss")):
            xs.append(tokens[r["iteration"]])
            ys.append(r["loss"])
    return xs, ys


def _mark_events(ax, run: Run) -> None:
    seen = set()
    for event in run.events:
        mark = EVENT_MARKS.get(event.get("type"))
        if mark is None or not _is_number(event.get("iteration")):
            continue
        colour, text = mark
        ax.axvline(event["iteration"], color=colour, linestyle=":", alpha=0.8,
                   label=None if text in seen else f"{run.label}: {text}")
        seen.add(text)
    for iteration in run.nonfinite_iterations():
        ax.axvline(iteration, color="black", linestyle=":", alpha=0.6,
                   label=None if "nonfinite" in seen else f"{run.label}: non-finite")
        seen.add("nonfinite")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _line_figure(runs: list[Run], opts: PlotOptions, name: str, panels: Sequence[tuple[str, str, bool]]
                 ) -> Optional[list[Path]]:
    """One panel per (key, y label, log scale); None when no run has any of the keys."""
    present = [p for p in panels if any(run.series(p[0])[0] for run in runs)]
    if not present:
        return None
    fig, axes = _new_figure(opts, len(present))
    for ax, (key, ylabel, log) in zip(axes, present):
        for i, run in enumerate(runs):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, smooth(ys, opts.smooth), color=f"C{i % 10}", label=run.label)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        if log and all(y > 0 for run in runs for y in run.series(key)[1]):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, name, opts)


def _moe_figure(runs: list[Run], opts: PlotOptions) -> Optional[list[Path]]:
    if not any(run.series("expert_load_max")[0] for run in runs):
        return None
    fig, (ax,) = _new_figure(opts)
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        for key, style, text in (("expert_load_max", "-", "busiest"), ("expert_load_min", "--", "idlest")):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=colour, linestyle=style, label=f"{run.label} {text} expert")
    ax.axhline(1.0, color="black", linewidth=0.8, alpha=0.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("expert tokens / mean")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, "moe_load", opts)


def straggler_matrix(run: Run) -> Optional[tuple[list[int], list[int], list[list[float]]]]:
    """(iterations, ranks, scores[rank][iteration]) from a run's straggler events: the largest relative score
    over the sections of each rank; None without straggler events."""
    events = [e for e in run.events if e.get("type") == "straggler" and _is_number(e.get("iteration"))
              and isinstance(e.get("relative"), list)]
    if not events:
        return None
    ranks = sorted({r for e in events for r in (e.get("ranks") or range(len(e["relative"])))})
    iterations = [e["iteration"] for e in events]
    scores = [[math.nan] * len(events) for _ in ranks]
    for column, e in enumerate(events):
        for rank, row in zip(e.get("ranks") or range(len(e["relative"])), e["relative"]):
            values = [v for v in (row if isinstance(row, list) else [row]) if _is_number(v)]
            if values:
                scores[ranks.index(rank)][column] = max(values)
    return iterations, ranks, scores


def _straggler_figures(runs: list[Run], opts: PlotOptions) -> list[Path]:
    paths = []
    for index, run in enumerate(runs):
        matrix = straggler_matrix(run)
        if matrix is None:
            continue
        iterations, ranks, scores = matrix
        fig, (ax,) = _new_figure(opts)
        image = ax.imshow(scores, aspect="auto", cmap="magma_r", interpolation="nearest", vmin=1.0,
                          extent=(-0.5, len(iterations) - 0.5, len(ranks) - 0.5, -0.5))
        fig.colorbar(image, ax=ax, label="section time / median over ranks (largest section)")
        step = max(1, len(iterations) // 12)
        ax.set_xticks(range(0, len(iterations), step), [str(i) for i in iterations[::step]])
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_xlabel("iteration")
        ax.set_ylabel("rank")
        ax.set_title(f"stragglers: {run.label}")
        suffix = "" if len(runs) == 1 else f"_{index}"
        paths += _save(fig, f"stragglers{suffix}", opts)
    return paths


def plot_runs(runs: list[Run], opts: PlotOptions) -> list[Path]:
    """Write every figure the runs have data for; returns the files written."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures: list[Callable[[], Optional[list[Path]]]] = [
        lambda: _loss_figure(runs, opts),
        lambda: _line_figure(runs, opts, "lr", [("lr", "learning rate", False)]),
        lambda: _line_figure(runs, opts, "grad_norm", [("grad_norm", "gradient norm", True)]),
        lambda: _line_figure(runs, opts, "throughput", [("tokens_per_sec_per_gpu", "tokens/s/GPU", False),
                                                        ("mfu", "MFU", False)]),
        lambda: _line_figure(runs, opts, "memory", [("peak_mem_gib", "peak memory (GiB)", False)]),
        lambda: _moe_figure(runs, opts),
    ]
    for draw in figures:
        written += draw() or []
    return written + _straggler_figures(runs, opts)


# ---------------------------------------------------------------------------------------------- bench rows
def read_bench_rows(path: Path) -> list[dict]:
    """The JSON objects of a ``meshtron bench --json`` output (other lines, e.g. logs, are skipped)."""
    if not path.is_file():
        raise ConfigError(f"--bench {path} does not exist")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "tokens_per_sec_per_gpu" in row:
                rows.append(row)
    if not rows:
        raise ConfigError(f"--bench {path}: no `meshtron bench --json` rows in it")
    return rows


def _bench_label(row: dict) -> str:
    return f"{row.get('model', '?')} {row.get('layout', '')} mb{row.get('micro_batch', '?')} {row.get('precision', '')}"


def plot_bench(rows: list[dict], opts: PlotOptions) -> list[Path]:
    """Bar charts of tokens/s/GPU and peak memory per bench row."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    labels = [_bench_label(r) for r in rows]
    fig, axes = _new_figure(opts, 2)
    for ax, key, ylabel in ((axes[0], "tokens_per_sec_per_gpu", "tokens/s/GPU"), (axes[1], "peak_mem_gib", "peak GiB")):
        values = [r.get(key) if _is_number(r.get(key)) else 0.0 for r in rows]
        ax.bar(range(len(rows)), values, color=[f"C{i % 10}" for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize="small")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, "bench", opts)


# ---------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtron plot", allow_abbrev=False,
        description="Draw figures from metrics files (--metrics-file of meshtron train) or bench rows.")
    parser.add_argument("metrics", nargs="*", help="metrics files (JSONL), one run each")
    parser.add_argument("--out", default="plots", help="directory for the figures (default: plots)")
    parser.add_argument("--label", action="append", default=[],
                        help="legend label of each metrics file, in order (default: the file name)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window over logged points (default 1)")
    parser.add_argument("--log-loss", action="store_true", help="logarithmic loss axis")
    parser.add_argument("--format", default="png", help="comma-separated formats: png, svg (default png)")
    parser.add_argument("--bench", help="a `meshtron bench --json` output to draw as bar charts")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of PNG figures (default 100)")
    return parser


def _options(args: argparse.Namespace) -> PlotOptions:
    formats = tuple(f.strip().lower() for f in args.format.split(",") if f.strip())
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ConfigError(f"--format {args.format}: choose from {', '.join(FORMATS)} (comma-separated)")
    if args.smooth < 1:
        raise ConfigError(f"--smooth {args.smooth}: must be a window of at least 1 point")
    if not 10 <= args.dpi <= 1000:
        raise ConfigError(f"--dpi {args.dpi}: must be between 10 and 1000")
    return PlotOptions(out_dir=Path(args.out), formats=formats, smooth=args.smooth, log_loss=args.log_loss,
                       dpi=args.dpi)


def plot_main(argv: Sequence[str]) -> int:
    """``meshtron plot METRICS.jsonl [...] [--out DIR]`` or ``meshtron plot --bench ROWS.jsonl``."""
    args = _parser().parse_args(list(argv))
    opts = _options(args)
    if not args.metrics and not args.bench:
        raise ConfigError("give one or more metrics files (meshtron train --metrics-file) or --bench FILE")
    if len(args.label) > len(args.metrics):
        raise ConfigError(f"{len(args.label)} --label values for {len(args.metrics)} metrics files")
    written: list[Path] = []
    if args.metrics:
        labels = args.label + [None] * (len(args.metrics) - len(args.label))
        runs = [read_run(Path(p), label) for p, label in zip(args.metrics, labels)]
        for path, run in zip(args.metrics, runs):
            note = run.skipped_note(Path(path))
            if note is not None:
                print(f"meshtron plot: {'warning' if run.damaged else 'note'}: {note}", file=sys.stderr)
        written += plot_runs(runs, opts)
    if args.bench:
        written += plot_bench(read_bench_rows(Path(args.bench)), opts)
    if not written:
        raise ConfigError("nothing to plot: the metrics files hold no train or eval records")
    for path in written:
        print(path)
    return 0
