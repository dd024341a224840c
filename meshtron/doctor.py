"""``meshtron doctor``: a pre-flight (or between-jobs) check of every device and link of a job.

Launched like ``meshtron train``: ``meshtron doctor --nproc-per-node N`` (through
torch.distributed.run), under ``torchrun -m meshtron doctor``, or in one plain process.
Each rank measures

* its device: the matmul rate (square bf16 matmuls on GPU, fp32 on CPU) and the memory
  bandwidth (a device-to-device copy; bytes read plus bytes written);
* its links: one send/recv ring step (rank r sends to r+1 and receives from r-1 at once),
  giving the bandwidth of every link r-1 -> r;
* its groups: all-reduce and all-to-all over the world, and with ``--group-size G`` over
  each block of G consecutive ranks (the TP- or DP-sized neighbour groups), as bus bandwidth
  (the nccl-tests convention: all-reduce 2(n-1)/n, all-to-all (n-1)/n of the message per time).

Every figure is the best of ``--trials`` timed loops, so a passing hiccup does not make a
device look slow. Rank 0 prints a table and names every device, link or group more than
``--threshold`` (10%) below the median of its kind; the exit code is 1 when any is named,
0 otherwise (2 for bad input). ``--json`` prints the same as one JSON object.

``--inject-fault slow:RANK:1:SECONDS`` (the fault-injection syntax of ``meshtron train``; the
doctor's measurements count as iteration 1) adds SECONDS to each of that rank's timed loops,
so a drill can show that an outlier is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from meshtron.config import ConfigError, LauncherConfig
from meshtron.launcher import LAUNCHER_FIELDS, launcher_option_strings

PROG = "meshtron doctor"
#: Set by the ``--nproc-per-node`` shortcut for its workers: rank 0 writes the exit code there and the
#: workers exit 0, so that torch.distributed.run does not report an expected outcome as a failed worker.
VERDICT_ENV = "MESHTRON_DOCTOR_VERDICT_FILE"
_HOST_BYTES = 64


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one device kind (small on CPU, so that the check takes seconds)."""

    matmul_n: int
    copy_bytes: int
    message_bytes: int
    iters: int


SIZES = {"cuda": Sizes(matmul_n=8192, copy_bytes=1 << 30, message_bytes=64 << 20, iters=20),
         "cpu": Sizes(matmul_n=256, copy_bytes=8 << 20, message_bytes=1 << 20, iters=5)}


@dataclass
class Finding:
    """One figure more than the threshold below the median of its kind."""

    kind: str        # "device", "link" or "group"
    name: str        # "rank 1", "link 0 -> 1", "group 0-3"
    metric: str
    value: float
    median: float

    @property
    def below(self) -> float:
        return 1.0 - self.value / self.median if self.median > 0 else 0.0


@dataclass
class Report:
    """Every rank's figures (rank 0's view after the gather)."""

    device_type: str
    backend: str
    ranks: list[dict] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    threshold: float = 0.1

    def to_json(self) -> dict:
        return {"device_type": self.device_type, "backend": self.backend, "threshold": self.threshold,
                "ranks": self.ranks, "links": self.links, "groups": self.groups,
                "outliers": [{**dataclasses.asdict(f), "below": round(f.below, 4)} for f in self.findings]}


# ---------------------------------------------------------------------------------------------
# Arguments and launching.
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message.replace("argument ", "", 1))


def doctor_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Measure every device's matmul rate and memory bandwidth and every link's and "
                                 "group's bandwidth; name what is more than --threshold below the median "
                                 "(exit 1), else exit 0.")
    defaults = LauncherConfig()
    for name in LAUNCHER_FIELDS:
        kind = int if name in ("nproc_per_node", "node_rank", "master_port") else str
        parser.add_argument(*launcher_option_strings(name), dest=name, type=kind, default=getattr(defaults, name),
                            help="Launcher flag, as for meshtron train.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="Default: cuda when available.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    parser.add_argument("--threshold", type=float, default=0.1,
                        help="Name figures more than this fraction below the median of their kind (default 0.1).")
    parser.add_argument("--trials", type=int, default=3, help="Timed loops per figure; the best counts (default 3).")
    parser.add_argument("--group-size", type=int, default=None,
                        help="Also measure all-reduce and all-to-all in each block of this many consecutive ranks "
                             "(e.g. the tensor-parallel size).")
    parser.add_argument("--inject-fault", action="append", default=[], metavar="slow:RANK:1:SECONDS",
                        help="Drill: add SECONDS to each timed loop of RANK (only the slow kind).")
    return parser


def _slow_seconds(texts: Sequence[str], rank: int, world: int) -> float:
    """The delay ``--inject-fault slow:RANK:1:SECONDS`` adds to this rank's timed loops."""
    from meshtron.resilience.faults import check_faults

    delay = 0.0
    for spec in check_faults(texts, world):
        if spec.kind != "slow":
            raise ConfigError(f"--inject-fault {spec}: {PROG} injects only slow:RANK:1:SECONDS")
        if spec.iteration <= 1 and spec.rank == rank:
            delay += float(spec.arg or 0.0)
    return delay


def _check(opts: argparse.Namespace, world: int) -> None:
    if not 0 < opts.threshold < 1:
        raise ConfigError(f"--threshold must be between 0 and 1, got {opts.threshold:g}")
    if opts.trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {opts.trials}")
    if opts.group_size is not None and (opts.group_size < 1 or world % opts.group_size):
        raise ConfigError(f"--group-size {opts.group_size} must divide the world size {world}")
    _slow_seconds(opts.inject_fault, 0, world)


def doctor_main(argv: Sequence[str]) -> int:
    """Entry point of ``meshtron doctor``; returns the exit code."""
    from meshtron import launcher

    opts = doctor_parser().parse_args(list(argv))
    if opts.nproc_per_node is not None and not launcher.running_under_torchrun():
        # The launcher flags first, as for meshtron train: torch.distributed.run would assert on --nproc-per-node 0.
        launcher.check_launcher(LauncherConfig(**{name: getattr(opts, name) for name in LAUNCHER_FIELDS}))
        _check(opts, opts.nproc_per_node * launcher.parse_nnodes(opts.nnodes)[0])
        return _launch(opts, argv)
    world = launcher.env_world_size()
    _check(opts, world)
    code = run_checks(opts)
    path = os.environ.get(VERDICT_ENV)
    if path:
        if int(os.environ.get("RANK", "0")) == 0:
            with open(path, "w", encoding="utf-8") as f:
                f.write(str(code))
        return 0
    return code


def _launch(opts: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start the workers through torch.distributed.run; the exit code is the one rank 0 wrote."""
    from meshtron import launcher

    p = LauncherConfig(**{name: getattr(opts, name) for name in LAUNCHER_FIELDS})
    with tempfile.TemporaryDirectory(prefix="meshtron-doctor-") as tmp:
        path = os.path.join(tmp, "verdict")
        os.environ[VERDICT_ENV] = path
        try:
            code = launcher.run_torchrun(launcher.torchrun_args(
                p, ["-m", "meshtron", "doctor", *launcher.strip_launcher_flags(argv)]))
        finally:
            os.environ.pop(VERDICT_ENV, None)
        if code != 0 or not os.path.exists(path):
            return code or 1
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip() or 1)


# ---------------------------------------------------------------------------------------------
# Measurements.
# ---------------------------------------------------------------------------------------------

def _best_seconds(run: Callable[[], None], trials: int, delay: float, sync: Callable[[], None],
                  barrier: Optional[Callable[[], None]] = None) -> float:
    """The shortest of ``trials`` timed calls of ``run`` (each plus the injected ``delay``)."""
    best = float("inf")
    for _ in range(trials):
        if barrier is not None:
            barrier()
        sync()
        start = time.perf_counter()
        run()
        if delay:
            time.sleep(delay)
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_device(torch, device, sizes: Sizes, trials: int, delay: float, sync) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) of this rank's device."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = sizes.matmul_n
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def matmuls() -> None:
        for _ in range(sizes.iters):
            torch.mm(a, b, out=out)

    matmuls()  # warm-up (kernel selection, page faults)
    flops = 2.0 * n ** 3 * sizes.iters / _best_seconds(matmuls, trials, delay, sync)
    src = torch.empty(sizes.copy_bytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)

    def copies() -> None:
        for _ in range(sizes.iters):
            dst.copy_(src)

    copies()
    bandwidth = 2.0 * sizes.copy_bytes * sizes.iters / _best_seconds(copies, trials, delay, sync)
    return flops, bandwidth


def _measure_comm(torch, dist, device, sizes: Sizes, trials: int, delay: float, sync,
                  groups: list[tuple[list[int], Any]]) -> list[float]:
    """[seconds of the ring send/recv step received from rank r-1, then per group (all-reduce, all-to-all)
    seconds] of this rank (NaN for groups it is not in)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    count = sizes.message_bytes // 4
    send = torch.ones(count, device=device)
    recv = torch.empty_like(send)
    barrier = dist.barrier

    def ring() -> None:
        for _ in range(sizes.iters):
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    ring()
    out = [_best_seconds(ring, trials, delay, sync, barrier) / sizes.iters]
    for members, group in groups:
        if rank not in members:
            out += [float("nan"), float("nan")]
            continue
        size = len(members)
        buf = torch.ones(count - count % size, device=device)
        res = torch.empty_like(buf)

        def all_reduce() -> None:
            for _ in range(sizes.iters):
                dist.all_reduce(buf, group=group)

        def all_to_all() -> None:
            for _ in range(sizes.iters):
                dist.all_to_all_single(res, buf, group=group)

        all_reduce()
        all_to_all()
        out.append(_best_seconds(all_reduce, trials, delay, sync, barrier) / sizes.iters)
        out.append(_best_seconds(all_to_all, trials, delay, sync, barrier) / sizes.iters)
    return out


def _groups(dist, world: int, group_size: Optional[int]) -> list[tuple[list[int], Any]]:
    """The world, plus each block of ``group_size`` consecutive ranks (every rank creates every group)."""
    out: list[tuple[list[int], Any]] = [(list(range(world)), None)]
    if group_size and 1 < group_size < world:
        for start in range(0, world, group_size):
            members = list(range(start, start + group_size))
            out.append((members, dist.new_group(members)))
    return out


def run_checks(opts: argparse.Namespace) -> int:
    """Measure on this rank, gather on rank 0, print there; returns 1 when something is named, else 0."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device_type = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
        # Processes of one host share its cores: one share each, so that they do not slow each other down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    backend = "nccl" if device_type == "cuda" else "gloo"
    sizes = SIZES[device_type]
    delay = _slow_seconds(opts.inject_fault, rank, world)
    distributed = world > 1
    if distributed:
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend, **kwargs)
    try:
        flops, bandwidth = _measure_device(torch, device, sizes, opts.trials, delay, sync)
        groups = _groups(dist, world, opts.group_size) if distributed else []
        comm = _measure_comm(torch, dist, device, sizes, opts.trials, delay, sync, groups) if distributed else []
        host = socket.gethostname().encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
        name = (torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu").encode()
        local = torch.tensor([flops, bandwidth, *comm, *host, *name[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")],
                             dtype=torch.float64, device=device)
        if distributed:
            rows = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(rows, local)
            table = torch.stack(rows).tolist()
            dist.barrier()
        else:
            table = [local.tolist()]
    finally:
        if distributed:
            dist.destroy_process_group()
    report = build_report(table, [m for m, _ in groups], sizes, device_type, backend, opts.threshold)
    if rank == 0:
        print(json.dumps(report.to_json(), indent=2) if opts.json else format_report(report))
        sys.stdout.flush()
    return 1 if report.findings else 0


# ---------------------------------------------------------------------------------------------
# The verdict.
# ---------------------------------------------------------------------------------------------

def _text(values: Sequence[float]) -> str:
    return bytes(int(v) for v in values).rstrip(b"\0").decode(errors="replace")


def _outliers(kind: str, items: list[tuple[str, float]], metric: str, threshold: float) -> list[Finding]:
    """Items more than ``threshold`` below the median of ``items`` (nothing to compare with one item)."""
    if len(items) < 2:
        return []
    median = statistics.median(v for _, v in items)
    return [Finding(kind, name, metric, value, median) for name, value in items if value < (1 - threshold) * median]


def build_report(table: list[list[float]], groups: list[list[int]], sizes: Sizes, device_type: str,
                 backend: str, threshold: float) -> Report:
    """Figures and findings from every rank's row of measurements."""
    world = len(table)
    ncomm = 1 + 2 * len(groups) if groups else 0
    report = Report(device_type, backend, threshold=threshold)
    for r, row in enumerate(table):
        hosts = row[2 + ncomm:]
        report.ranks.append({"rank": r, "host": _text(hosts[:_HOST_BYTES]), "device": _text(hosts[_HOST_BYTES:]),
                             "matmul_tflops": row[0] / 1e12, "memory_gbps": row[1] / 1e9})
    if groups:
        for r, row in enumerate(table):
            report.links.append({"src": (r - 1) % world, "dst": r, "gbps": sizes.message_bytes / row[2] / 1e9})
        for g, members in enumerate(groups):
            n = len(members)
            reduce_s = max(table[r][3 + 2 * g] for r in members)
            a2a_s = max(table[r][4 + 2 * g] for r in members)
            size = sizes.message_bytes - sizes.message_bytes % (4 * n)
            report.groups.append({"ranks": members, "name": "world" if g == 0 else f"group {members[0]}-{members[-1]}",
                                  "all_reduce_busbw_gbps": size / reduce_s * 2 * (n - 1) / n / 1e9,
                                  "all_to_all_busbw_gbps": size / a2a_s * (n - 1) / n / 1e9})
    f = report.findings
    f += _outliers("device", [(f"rank {d['rank']}", d["matmul_tflops"]) for d in report.ranks], "matmul_tflops",
                   threshold)
    f += _outliers("device", [(f"rank {d['rank']}", d["memory_gbps"]) for d in report.ranks], "memory_gbps",
                   threshold)
    f += _outliers("link", [(f"link {d['src']} -> {d['dst']}", d["gbps"]) for d in report.links], "gbps", threshold)
    blocks = report.groups[1:]  # the neighbour groups compare with each other; the world has no peer
    for metric in ("all_reduce_busbw_gbps", "all_to_all_busbw_gbps"):
        f += _outliers("group", [(d["name"], d[metric]) for d in blocks], metric, threshold)
    return report


def format_report(report: Report) -> str:
    """The human-readable tables and the verdict."""
    cpu = report.device_type == "cpu"
    rate, scale = ("GFLOP/s", 1e3) if cpu else ("TFLOP/s", 1.0)
    slow = {(f.name, f.metric) for f in report.findings}
    mark = lambda name, metric: "  SLOW" if (name, metric) in slow else ""  # noqa: E731
    lines = [f"{PROG}: {len(report.ranks)} rank(s) on {report.device_type} ({report.backend})", "",
             f"{'rank':>4}  {'host':<20} {'device':<24} {'matmul ' + rate:>16}  {'memory GB/s':>12}"]
    for d in report.ranks:
        name = f"rank {d['rank']}"
        lines.append(f"{d['rank']:>4}  {d['host'][:20]:<20} {d['device'][:24]:<24} "
                     f"{d['matmul_tflops'] * scale:>16.3g}{mark(name, 'matmul_tflops'):6}"
                     f"{d['memory_gbps']:>12.3g}{mark(name, 'memory_gbps')}")
    if report.links:
        lines += ["", f"{'link':<14} {'send/recv GB/s':>14}"]
        for d in report.links:
            name = f"link {d['src']} -> {d['dst']}"
            lines.append(f"{d['src']:>4} -> {d['dst']:<6} {d['gbps']:>14.3g}{mark(name, 'gbps')}")
    if report.groups:
        lines += ["", f"{'group':<16} {'all-reduce busbw GB/s':>22} {'all-to-all busbw GB/s':>22}"]
        for d in report.groups:
            lines.append(f"{d['name']:<16} {d['all_reduce_busbw_gbps']:>22.3g}"
                         f"{mark(d['name'], 'all_reduce_busbw_gbps'):6}{d['all_to_all_busbw_gbps']:>16.3g}"
                         f"{mark(d['name'], 'all_to_all_busbw_gbps')}")
    lines.append("")
    if not report.findings:
        lines.append(f"ok: nothing more than {report.threshold:.0%} below the median")
    for f in report.findings:
        lines.append(f"SLOW: {f.name} {f.metric} {f.value * (scale if f.metric == 'matmul_tflops' else 1):.3g} "
                     f"is {f.below:.0%} below the median "
                     f"{f.median * (scale if f.metric == 'matmul_tflops' else 1):.3g}")
    return "\n".join(lines)
