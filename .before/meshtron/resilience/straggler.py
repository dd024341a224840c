"""Straggler detection: per-rank section times of the training step, compared over ranks.

With ``--log-straggler-interval N`` every step is split into sections, timed on the
device's own clock (CUDA events recorded in the stream, no host synchronisation in the
step; wall time on CPU):

==================  ======================================================================
``data``            from the start of the iteration until its micro-batches are on the
                    device (loading, host-to-device copy, context-parallel split)
``forward_backward`` the pipeline schedule: every forward and backward pass (with TP, CP,
                    EP or PP this includes their collectives and point-to-point waits)
``communication``   exposed communication: the loss-token count all-reduce before the
                    schedule and the gradient reduction left after it. A rank that waits
                    for a slower one spends that time here
``optimizer``       gradient norm, clipping and the optimizer step
==================  ======================================================================

Every N iterations the median over the steps since the last report of each section's time
(the run's first step, which also pays for start-up, is left out; the median ignores a
one-off hiccup such as a descheduled process) is all-gathered over the world (one
all-gather of four numbers per rank) and scored:

* relative score = a rank's time / the lower median over ranks (with two ranks: the faster
  one), per section;
* individual score = a rank's time / its own best reported time, per section.

A rank is named a straggler when one of its own-work sections (data, forward_backward,
optimizer; not communication, whose time is the wait for others) has a relative score above
``--straggler-threshold`` and the excess over the median is at least
:data:`MIN_EXCESS_SHARE` of the median step time, so that a section that takes a
negligible share of the step cannot name a rank from timer jitter.

Off (interval 0) the trainer holds no detector and the step does no timing at all.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from meshtron.parallel.context import ParallelContext

SECTIONS: tuple[str, ...] = ("data", "forward_backward", "communication", "optimizer")
#: Sections whose time is the rank's own work (communication is the wait for the slowest peer).
OWN_WORK_SECTIONS: tuple[str, ...] = ("data", "forward_backward", "optimizer")
#: A section names a rank only if its excess over the median is at least this share of a step.
MIN_EXCESS_SHARE = 0.10


class SectionTimer:
    """Records the time of each :data:`SECTIONS` entry, step by step, until the next :meth:`read`.

    :meth:`start` opens a step; :meth:`lap` closes the running section under a name and opens
    the next. On CUDA each boundary records an event on the current stream (no synchronisation);
    :meth:`read` waits for the last event and resolves the elapsed times. On CPU it reads the wall clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._rows: list[list[float]] = []  # CPU: seconds per section, one row per step
        self._last_wall = 0.0
        self._last_event: Optional[torch.cuda.Event] = None
        self._pending: list[list[tuple[int, torch.cuda.Event, torch.cuda.Event]]] = []  # CUDA: per step
        self._pool: list[torch.cuda.Event] = []
        self._open = False

    def _event(self) -> torch.cuda.Event:
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def open(self) -> bool:
        """Whether a step is open (the trainer opens one itself when its caller did not)."""
        return self._open

    def start(self) -> None:
        """Open a step (its first section)."""
        self._open = True
        if self.cuda:
            self._pending.append([])
            self._last_event = self._event()
        else:
            self._rows.append([0.0] * len(SECTIONS))
            self._last_wall = time.perf_counter()

    def lap(self, section: str, last: bool = False) -> None:
        """Close the running section, adding its time to ``section`` of the current step (``last``: and the step)."""
        self._open = not last
        index = SECTIONS.index(section)
        if self.cuda:
            event = self._event()
            self._pending[-1].append((index, self._last_event, event))
            self._last_event = event
        else:
            now = time.perf_counter()
            self._rows[-1][index] += now - self._last_wall
            self._last_wall = now

    def read(self) -> list[list[float]]:
        """Seconds per section of every step since the last read (one row per step); resets."""
        if self.cuda and self._pending:
            last = next((laps[-1][2] for laps in reversed(self._pending) if laps), None)
            if last is not None:
                last.synchronize()
            events: dict[int, torch.cuda.Event] = {}
            for laps in self._pending:
                row = [0.0] * len(SECTIONS)
                for index, begin, end in laps:
                    row[index] += begin.elapsed_time(end) / 1000.0
                    events.update({id(begin): begin, id(end): end})
                self._rows.append(row)
            self._pool.extend(events.values())  # all read: free to record again
            self._pending.clear()
            self._last_event = None
        rows, self._rows = self._rows, []
        return rows


@dataclass
class StragglerReport:
    """One interval's scores: ``relative[r][s]``, ``individual[r][s]`` and ``times_s[r][s]`` by rank r
    and section s (:data:`SECTIONS` order); ``ranks``: the stragglers named."""

    iteration: int
    ranks: list[int]
    relative: list[list[float]]
    individual: list[list[float]]
    times_s: list[list[float]]
    slow_sections: list[list[str]]  # for each named rank, the sections where it is beyond the threshold

    def event(self) -> dict:
        """The ``straggler`` metrics-file event (DESIGN section 6)."""
        return {"type": "straggler", "iteration": self.iteration, "ranks": self.ranks, "sections": list(SECTIONS),
                "relative": self.relative, "individual": self.individual, "times_s": self.times_s,
                "slow_sections": self.slow_sections}

    def message(self, threshold: float) -> str:
        """The log line naming the stragglers."""
        parts = []
        for rank, sections in zip(self.ranks, self.slow_sections):
            scores = ", ".join(f"{s} {self.relative[rank][SECTIONS.index(s)]:.2f}x" for s in sections)
            parts.append(f"rank {rank} ({scores})")
        return (f"iteration {self.iteration}: straggler(s): {'; '.join(parts)} of the median rank's time "
                f"(--straggler-threshold {threshold:g})")

    def minmax_line(self, count: int) -> str:
        """The ``count`` slowest and fastest ranks by own-work time per step (``--straggler-minmax-count``)."""
        own = [SECTIONS.index(s) for s in OWN_WORK_SECTIONS]
        work = sorted((sum(row[i] for i in own), r) for r, row in enumerate(self.times_s))
        fmt = lambda items: ", ".join(f"rank {r} {t * 1000:.1f} ms" for t, r in items)  # noqa: E731
        return (f"iteration {self.iteration}: own work per step: slowest {fmt(work[::-1][:count])}; "
                f"fastest {fmt(work[:count])}")


def score(times: Sequence[Sequence[float]], best: Sequence[Sequence[float]], iteration: int,
          threshold: float) -> StragglerReport:
    """Scores and stragglers from every rank's seconds per step ``times[r][s]`` and their best ``best[r][s]``."""
    world = len(times)
    columns = list(zip(*times))
    medians = [statistics.median_low(col) for col in columns]
    step_median = statistics.median_low([sum(row) for row in times])

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 1.0

    relative = [[ratio(times[r][s], medians[s]) for s in range(len(SECTIONS))] for r in range(world)]
    individual = [[ratio(times[r][s], best[r][s]) for s in range(len(SECTIONS))] for r in range(world)]
    ranks, slow = [], []
    for r in range(world):
        beyond = [SECTIONS[s] for s in (SECTIONS.index(n) for n in OWN_WORK_SECTIONS)
                  if relative[r][s] > threshold and times[r][s] - medians[s] >= MIN_EXCESS_SHARE * step_median]
        if beyond:
            ranks.append(r)
            slow.append(beyond)
    rounded = lambda m: [[round(v, 4) for v in row] for row in m]  # noqa: E731
    times_s = [[round(v, 6) for v in row] for row in times]
    return StragglerReport(iteration, ranks, rounded(relative), rounded(individual), times_s, slow)


class StragglerDetector:
    """Times this rank's step sections and, every ``interval`` iterations, scores every rank's."""

    def __init__(self, ctx: ParallelContext, interval: int, threshold: float):
        self.ctx = ctx
        self.interval = interval
        self.threshold = threshold
        self.timer = SectionTimer(ctx.device)
        self._best: Optional[list[list[float]]] = None
        self._warmed_up = False

    @classmethod
    def from_config(cls, cfg, ctx: ParallelContext) -> Optional["StragglerDetector"]:
        """The detector of ``cfg``'s straggler flags, or None when detection is off."""
        interval = straggler_interval(cfg.log)
        return cls(ctx, interval, cfg.log.straggler_threshold) if interval else None

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def report(self, iteration: int) -> Optional[StragglerReport]:
        """Gather every rank's median section times since the last report and score them (all ranks call it)."""
        rows = self.timer.read()
        if not self._warmed_up:  # the run's first step also pays for start-up (first batch, lazy set-up)
            rows, self._warmed_up = rows[1:], True
        if not rows:
            return None
        local = torch.tensor([statistics.median(col) for col in zip(*rows)], dtype=torch.float64,
                             device=self.ctx.device)
        if self.ctx.world_size > 1 and dist.is_initialized():
            rows = [torch.empty_like(local) for _ in range(self.ctx.world_size)]
            dist.all_gather(rows, local)
            times = torch.stack(rows).tolist()
        else:
            times = [local.tolist()]
        if self._best is None:
            self._best = [list(row) for row in times]
        else:
            self._best = [[min(b, t) for b, t in zip(brow, trow)] for brow, trow in zip(self._best, times)]
        return score(times, self._best, iteration, self.threshold)


def straggler_interval(log_cfg) -> int:
    """Iterations between straggler reports: ``--log-straggler-interval``, or ``--log-interval`` with
    Megatron's ``--log-straggler`` switch; 0 when off."""
    if log_cfg.log_straggler_interval:
        return log_cfg.log_straggler_interval
    return log_cfg.log_interval if log_cfg.log_straggler else 0

