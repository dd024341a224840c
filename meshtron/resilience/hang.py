"""Hang detection with attribution (``--hang-timeout-seconds``).

The trainer marks its progress with plain attribute stores (:class:`Progress`: the
iteration and the phase, no synchronisation). A :class:`HangWatchdog` thread on every
rank checks that marker; when it has not moved for the timeout (a larger allowance
before the first iteration completes and while a checkpoint is read or written), the
rank declares a hang in the rendezvous store. Under torchrun that store is served by
the launcher's agent, so it answers while a rank is stopped or dead, and the stuck
communicators are never used. Every rank still alive then posts what it knows:

- how many operations it has issued on each of its process groups: torch counts every
  collective (gloo: and every point-to-point transfer) per group as it is issued
  (``ProcessGroup._get_sequence_number_for_group``), compiled code included, so a rank
  that never reached a collective has a lower count than its peers in that group;
- its iteration and phase, and its main thread's Python stack, whose innermost
  ``torch.distributed`` frame is the collective it waits in;
- its pipeline's point-to-point operations per peer, counted by meshtron itself
  (:mod:`meshtron.resilience.p2p_ledger`), because NCCL's counts leave them out: a pair whose counts
  disagree names the rank waiting, its peer, the stage and the micro-batch of the message.

The rank that declared the hang combines the posts into one report: the ranks behind,
the group and collective they never reached (from the stacks of the ranks ahead), the
iteration and phase, every stack, and the ranks that did not report at all (stopped or
dead). It prints it, appends a ``{"type":"hang",...}`` event to the metrics file and
writes ``hang_report_<time>.json`` and ``.txt`` (under ``--save``, else beside the
metrics file, else the working directory). Then every live rank exits with
:data:`HANG_EXIT_CODE`, so that the launcher (``--max-restarts``) can restart the job.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping, Optional, Sequence

import torch.distributed as dist

from meshtron.metrics_line import to_json_line
from meshtron.resilience.p2p_ledger import P2PLedger, describe, stuck_pairs

#: Exit code of every live rank after a hang was reported: a failure while running.
HANG_EXIT_CODE = 1
#: Phases whose allowance is the startup one: they legitimately run long without an iteration.
LONG_PHASES = frozenset({"startup", "checkpoint"})
#: ParallelContext attributes holding process groups, and the names reports use for them.
CONTEXT_GROUPS: tuple[tuple[str, str], ...] = (
    ("tp_group", "tp"), ("cp_group", "cp"), ("dp_group", "dp"), ("pp_group", "pp"),
    ("dp_cp_group", "dp_cp"), ("tp_cp_group", "tp_cp"), ("ep_group", "ep"),
    ("expert_dp_group", "expert_dp"), ("dp_cp_shard_group", "dp_cp_shard"),
    ("dp_cp_replica_group", "dp_cp_replica"), ("embedding_group", "embedding"),
    ("model_parallel_group", "model_parallel"),
)
_STORE_PREFIX = "meshtron/hang"
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_TORCH = os.sep + "torch" + os.sep


class Progress:
    """Where this rank is: the trainer stores ``iteration`` and ``phase`` (plain attributes, no sync)."""

    __slots__ = ("iteration", "phase", "beats", "first_iteration_done", "p2p")

    def __init__(self) -> None:
        self.iteration = 0
        self.phase = "startup"
        self.beats = 0  # bumped by long loops (evaluation batches) so that they count as progress
        self.first_iteration_done = False
        self.p2p = P2PLedger()  # the pipeline's sends and receives (PipelineP2P counts into it)

    def snapshot(self) -> tuple:
        posted = self.p2p.posted
        return (self.iteration, self.phase, self.beats, sum(posted["send"].values()) + sum(posted["recv"].values()))


# ---------------------------------------------------------------------------------------------
# What one rank knows: its groups' operation counts and its main thread's stack.
# ---------------------------------------------------------------------------------------------

def named_groups(ctx: Any) -> list[tuple[str, dist.ProcessGroup]]:
    """This rank's process groups with their report names: ``world``, the context's groups
    (tp, cp, dp, pp, dp_cp, tp_cp, ep, expert_dp, embedding, model_parallel), the checkpoint
    group and the TP sub-groups (``tp_sub<size>``), read at the time of the call."""
    out: list[tuple[str, dist.ProcessGroup]] = []
    if dist.is_initialized():
        out.append(("world", dist.group.WORLD))
    attributes = vars(ctx) if ctx is not None else {}
    for attribute, name in CONTEXT_GROUPS:
        group = attributes.get(attribute)
        if group is not None:
            out.append((name, group))
    later = attributes.get("later_groups")  # made on first use (meshtron.parallel.context.LaterGroups)
    if later is not None and later.checkpoint is not None:
        out.append(("checkpoint", later.checkpoint))
    for size, group in sorted((later.tp if later is not None else {}).items()):
        if group is not None:
            out.append((f"tp_sub{size}", group))
    return out


def operation_counts(groups: Sequence[tuple[str, dist.ProcessGroup]]) -> dict[str, dict]:
    """``{name: {"ranks": [global ranks], "count": operations issued}}`` for each group.

    The count is torch's per-group sequence number, raised when an operation is issued
    (collectives and, on gloo, point-to-point transfers; NCCL counts collectives only).
    """
    out: dict[str, dict] = {}
    for name, group in groups:
        try:
            count = int(group._get_sequence_number_for_group())
            ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        except Exception:  # a group destroyed meanwhile, or a backend without counts
            continue
        out[name] = {"ranks": ranks, "count": count}
    return out


def total_operations(groups: Sequence[tuple[str, dist.ProcessGroup]]) -> int:
    """The operations issued on all ``groups`` (a rank that issues collectives is not stuck)."""
    total = 0
    for _, group in groups:
        try:
            total += int(group._get_sequence_number_for_group())
        except Exception:
            continue
    return total


def _frame_location(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def main_thread_state() -> tuple[list[str], Optional[dict]]:
    """The main thread's stack (formatted lines) and the communication it waits in, or None:
    ``{"collective": name, "caller": "file:line in function"}``, where name is the innermost
    ``torch.distributed`` function (``all_reduce``, ``recv``, ...) or ``wait`` when the thread waits
    on the handle of an asynchronous operation (``work.wait()``, a C++ call without a Python frame)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return [], None
    stack = traceback.format_stack(frame)
    f = frame
    while f is not None:  # innermost first
        if _TORCH_DISTRIBUTED in f.f_code.co_filename:
            caller = f.f_back
            while caller is not None and _TORCH in caller.f_code.co_filename:
                caller = caller.f_back
            return stack, {"collective": f.f_code.co_name,
                           "caller": _frame_location(caller) if caller is not None else None}
        f = f.f_back
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    if ".wait(" in line:
        return stack, {"collective": "wait", "caller": _frame_location(frame)}
    return stack, None


def rank_entry(rank: int, progress: Progress, groups: Sequence[tuple[str, dist.ProcessGroup]]) -> dict:
    """What this rank posts when a hang is declared."""
    stack, waiting = main_thread_state()
    return {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(), "iteration": progress.iteration,
            "phase": progress.phase, "counts": operation_counts(groups), "p2p": progress.p2p.snapshot(),
            "waiting_in": waiting, "stack": stack}


# ---------------------------------------------------------------------------------------------
# Attribution: from every rank's post to one report.
# ---------------------------------------------------------------------------------------------

def attribute_hang(entries: dict[int, dict], world_size: int, declared_by: int) -> dict:
    """The ``hang`` event from the posts of the ranks that answered (``{rank: entry}``).

    A group whose members issued different numbers of operations names the members with
    the lowest count as behind; what they never reached is the call the members ahead
    wait in. Ranks that did not post are ``not_reporting``.
    """
    not_reporting = [r for r in range(world_size) if r not in entries]
    groups: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    for rank, entry in entries.items():
        for name, info in entry.get("counts", {}).items():
            groups.setdefault((name, tuple(info["ranks"])), {})[rank] = info["count"]
    lagging = []
    for (name, ranks), counts in sorted(groups.items()):
        low, high = min(counts.values()), max(counts.values())
        if low == high:
            continue
        behind = sorted(r for r, c in counts.items() if c == low)
        ahead = sorted(r for r, c in counts.items() if c == high)
        calls = Counter((entries[r].get("waiting_in") or {}).get("collective") for r in ahead)
        callers = Counter((entries[r].get("waiting_in") or {}).get("caller") for r in ahead)
        lagging.append({"group": name, "group_ranks": list(ranks), "behind": behind, "ahead": ahead,
                        "operations_behind": high - low, "counts": {str(r): c for r, c in sorted(counts.items())},
                        "collective": calls.most_common(1)[0][0], "caller": callers.most_common(1)[0][0]})
    # The smallest group with a lag is the most precise statement (dp_cp rather than world).
    lagging.sort(key=lambda g: (len(g["group_ranks"]), g["group"]))
    # The pipeline's sends and receives, by meshtron's own counts (NCCL's leave them out): a stuck pair is the
    # most precise statement of all, so its peer leads the ranks behind.
    pairs = stuck_pairs({r: e["p2p"] for r, e in entries.items() if e.get("p2p")})
    if pairs:
        return _p2p_report(entries, world_size, declared_by, not_reporting, lagging, pairs)
    behind = sorted({r for g in lagging for r in g["behind"]})
    suspects = behind or not_reporting
    where = [entries[r] for r in behind] or list(entries.values())
    first = lagging[0] if lagging else None
    if first is None:  # no count differs: what the answering ranks wait in
        waits = Counter(((e.get("waiting_in") or {}).get("collective"), (e.get("waiting_in") or {}).get("caller"))
                        for e in entries.values())
        collective, caller = waits.most_common(1)[0][0] if waits else (None, None)
    else:
        collective, caller = first["collective"], first["caller"]
    iterations = sorted({e["iteration"] for e in where})
    phases = sorted({e["phase"] for e in where})
    return {
        "type": "hang", "time": time.time(), "declared_by": declared_by, "world_size": world_size,
        "ranks_behind": suspects, "collective": collective, "group": first["group"] if first else None,
        "group_ranks": first["group_ranks"] if first else None, "caller": caller,
        "iteration": iterations[0] if iterations else None, "phase": phases[0] if len(phases) == 1 else phases,
        "not_reporting": not_reporting, "lagging_groups": lagging,
        "ranks": {str(r): {k: v for k, v in e.items() if k != "stack"} for r, e in sorted(entries.items())},
        "stacks": {str(r): e.get("stack", []) for r, e in sorted(entries.items())},
    }


def _p2p_report(entries: dict[int, dict], world_size: int, declared_by: int, not_reporting: list,
                lagging: list, pairs: list) -> dict:
    """The ``hang`` event when pipeline ranks disagree on their sends and receives: the peers that never
    posted the message their partner waits for are behind."""
    behind = sorted({p["peer"] for p in pairs} - {p["waiting"] for p in pairs}) or sorted({p["peer"] for p in pairs})
    first = pairs[0]
    where = [entries[r] for r in behind if r in entries] or list(entries.values())
    iterations = sorted({e["iteration"] for e in where})
    phases = sorted({e["phase"] for e in where})
    return {
        "type": "hang", "time": time.time(), "declared_by": declared_by, "world_size": world_size,
        "ranks_behind": behind, "collective": first["op"], "group": "pp",
        "group_ranks": sorted({first["waiting"], first["peer"]}), "caller": None,
        "iteration": iterations[0] if iterations else None, "phase": phases[0] if len(phases) == 1 else phases,
        "not_reporting": not_reporting, "lagging_groups": lagging,
        "stuck_pairs": [dict(p, text=describe(p)) for p in pairs],
        "ranks": {str(r): {k: v for k, v in e.items() if k != "stack"} for r, e in sorted(entries.items())},
        "stacks": {str(r): e.get("stack", []) for r, e in sorted(entries.items())},
    }


def summary_line(report: dict) -> str:
    """The report in one sentence (the log line and the head of the .txt file)."""
    who = ", ".join(map(str, report["ranks_behind"])) or "none identified"
    parts = [f"hang detected: rank(s) {who} behind"]
    if report.get("stuck_pairs"):
        parts.append(report["stuck_pairs"][0]["text"])
    elif report["group"] is not None:
        parts.append(f"never reached {report['collective']} on group {report['group']} "
                     f"(ranks {report['group_ranks']}), where the others wait"
                     + (f" (called from {report['caller']})" if report.get("caller") else ""))
    elif report["collective"]:
        parts.append(f"the others wait in {report['collective']}"
                     + (f" (called from {report['caller']})" if report.get("caller") else ""))
    parts.append(f"at iteration {report['iteration']}, phase {report['phase']}")
    if report["not_reporting"]:
        parts.append(f"rank(s) {', '.join(map(str, report['not_reporting']))} did not report (stopped or dead)")
    return "; ".join(parts)


def format_report(report: dict) -> str:
    """The human-readable report: the summary, the lagging groups, then every rank's stack."""
    lines = [summary_line(report), ""]
    for g in report["lagging_groups"]:
        lines.append(f"group {g['group']} ranks {g['group_ranks']}: operations issued {g['counts']}; "
                     f"behind {g['behind']} by {g['operations_behind']}; ahead {g['ahead']} wait in "
                     f"{g['collective']} ({g['caller']})")
    for rank, info in report["ranks"].items():
        lines.append(f"rank {rank} ({info.get('host')}, pid {info.get('pid')}): iteration {info['iteration']}, "
                     f"phase {info['phase']}, waiting in {info.get('waiting_in')}")
    for rank, stack in report["stacks"].items():
        lines += ["", f"--- rank {rank} main thread ---", "".join(stack).rstrip()]
    for rank in report["not_reporting"]:
        lines += ["", f"--- rank {rank}: no report (stopped or dead) ---"]
    return "\n".join(lines) + "\n"


def write_report(report: dict, directory: str) -> str:
    """Write ``hang_report_<time>.json`` and ``.txt`` into ``directory``; returns the path stem."""
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, time.strftime("hang_report_%Y%m%d-%H%M%S", time.localtime(report["time"])))
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".txt", "w", encoding="utf-8") as f:
        f.write(format_report(report))
    return stem


def metrics_event(report: dict) -> dict:
    """The ``hang`` line of the metrics file: the report without the stacks."""
    return {k: v for k, v in report.items() if k != "stacks"}


def report_directory(save: Optional[str], metrics_file: Optional[str]) -> str:
    """Where reports go: ``--save``, else the metrics file's folder, else the working directory."""
    if save:
        return save
    if metrics_file:
        return os.path.dirname(os.path.abspath(metrics_file))
    return os.getcwd()


# ---------------------------------------------------------------------------------------------
# GPU: torch's own NCCL flight recorder.
# ---------------------------------------------------------------------------------------------

def enable_nccl_flight_recorder(directory: str, environ: Optional[MutableMapping[str, str]] = None,
                                buffer_size: int = 2000) -> None:
    """Ask ProcessGroupNCCL to record its last operations and dump them when a collective times out.

    Sets ``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and the dump path
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (``<directory>/nccl_trace_rank_<rank>``) unless the user
    set them (or their ``TORCH_FR_*`` names). Must run before the process group is created.
    """
    env = os.environ if environ is None else environ
    if "TORCH_FR_BUFFER_SIZE" not in env:
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(buffer_size))
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_FR_DUMP_TEMP_FILE" not in env:
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(directory, "nccl_trace_rank_"))


# ---------------------------------------------------------------------------------------------
# The watchdog thread.
# ---------------------------------------------------------------------------------------------

@dataclass
class HangSettings:
    """The watchdog's timing (seconds)."""

    timeout: float
    startup_timeout: float

    @property
    def poll_interval(self) -> float:
        """How often the marker and the store are checked: often enough to join a report in time,
        rarely enough that thousands of ranks do not load the store."""
        return min(10.0, max(0.2, self.timeout / 6))

    @property
    def gather_window(self) -> float:
        """How long the declaring rank waits for the others' posts."""
        return 2 * self.poll_interval + 2.0


class HangWatchdog:
    """A daemon thread per rank that detects a stalled :class:`Progress` and reports the hang.

    ``store`` is the rendezvous store (``dist.distributed_c10d._get_default_store()``);
    ``publish(report)`` runs on the declaring rank (writing files and the metrics event);
    ``exit`` ends the process (``os._exit``; replaceable in tests).
    """

    def __init__(self, progress: Progress, settings: HangSettings, rank: int, world_size: int, store: Any,
                 groups: Callable[[], Sequence[tuple[str, dist.ProcessGroup]]],
                 publish: Callable[[dict], None], attempt: int = 0,
                 exit: Callable[[int], None] = os._exit):
        self.progress, self.settings = progress, settings
        self.rank, self.world_size, self.store = rank, world_size, store
        self.groups, self.publish, self.exit = groups, publish, exit
        self._prefix = f"{_STORE_PREFIX}/attempt{attempt}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshtron-hang-watchdog", daemon=True)

    def start(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the run ended); returns at once if the thread is reporting a hang."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.settings.poll_interval + 1)

    def _allowance(self) -> float:
        p = self.progress
        if not p.first_iteration_done or p.phase in LONG_PHASES:
            return max(self.settings.timeout, self.settings.startup_timeout)
        return self.settings.timeout

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _declared(self) -> bool:
        return bool(self.store.check([self._key("declared")]))

    def _activity(self) -> tuple:
        return self.progress.snapshot(), total_operations(self.groups())

    def _run(self) -> None:
        last, changed_at = self._activity(), time.monotonic()
        while not self._stop.wait(self.settings.poll_interval):
            now, seen = time.monotonic(), self._activity()
            if seen != last:
                last, changed_at = seen, now
            try:
                stalled = now - changed_at > self._allowance()
                if stalled or self._declared():
                    self._report(declare=stalled)
                    return
            except Exception as err:  # the store is gone (the launcher is tearing down): nothing to report to
                print(f"meshtron: hang watchdog on rank {self.rank} stopped: {err}", file=sys.stderr, flush=True)
                return

    def _report(self, declare: bool) -> None:
        declarer = False
        if declare and int(self.store.add(self._key("declared"), 1)) == 1:
            declarer = True
        entry = rank_entry(self.rank, self.progress, self.groups())
        self.store.set(self._key(f"entry/{self.rank}"), json.dumps(entry))
        if declarer:
            self._gather_and_publish()
        else:
            self._wait_for(self._key("done"), self.settings.gather_window + 30.0)
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit(HANG_EXIT_CODE)

    def _wait_for(self, key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return True
            time.sleep(min(0.2, self.settings.poll_interval))
        return False

    def _gather_and_publish(self) -> None:
        keys = {r: self._key(f"entry/{r}") for r in range(self.world_size)}
        deadline = time.monotonic() + self.settings.gather_window
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(min(0.2, self.settings.poll_interval))
        entries = {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}
        report = attribute_hang(entries, self.world_size, declared_by=self.rank)
        try:
            self.publish(report)
        finally:
            self.store.set(self._key("done"), "1")


def hang_watchdog(cfg: Any, ctx: Any, progress: Progress, logger: Any = None) -> Optional[HangWatchdog]:
    """The watchdog a run's configuration asks for, not started; None with
    ``--hang-timeout-seconds 0`` or without torch.distributed (one process)."""
    t = cfg.train
    if not t.hang_timeout_seconds or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from meshtron.resilience.restart import restart_count

    directory = report_directory(cfg.checkpoint.save, cfg.log.metrics_file)
    metrics_file = cfg.log.metrics_file

    def publish(report: dict) -> None:
        stem = write_report(report, directory)
        print(f"meshtron: ERROR: {summary_line(report)}. Full report: {stem}.txt; exiting with code "
              f"{HANG_EXIT_CODE}", file=sys.stderr, flush=True)
        if metrics_file:
            try:
                with open(metrics_file, "a", encoding="utf-8") as f:
                    f.write(to_json_line(metrics_event(report)) + "\n")
            except OSError as err:  # a full disk must not hide the hang report already printed and written
                print(f"meshtron: warning: the hang event was not added to {metrics_file}: {err}", file=sys.stderr,
                      flush=True)

    settings = HangSettings(float(t.hang_timeout_seconds), float(t.hang_startup_timeout_seconds))
    return HangWatchdog(progress, settings, dist.get_rank(), dist.get_world_size(),
                        dist.distributed_c10d._get_default_store(), lambda: named_groups(ctx), publish,
                        attempt=restart_count())
