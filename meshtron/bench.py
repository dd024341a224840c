"""`meshtron bench`: throughput, MFU and memory of a matrix of configurations in one process launch.

Every row is a set of `meshtron train` flags. Rows come from a YAML file
(``rows:`` a list of {flag: value} dicts, ``base:`` flags shared by all) and/or
from flags on the command line, where a comma-separated value expands into one
row per value (``--micro-batch-size 4,8``). All rows of one launch share its
world size (the parallel layout may differ as long as it fits the world).

Each row trains on random tokens (``--mock-data``) for ``--warmup`` + ``--steps``
iterations; warm-up iterations are excluded. The step-time split is measured
afterwards in separate, synchronised passes (forward only; forward+backward; the
data-parallel reduction), so it does not disturb the timed steps. With ``--warmup 0``
(steps of minutes) the timed step is the cold first one: the step is then the warm
passes plus a separately timed optimizer step, the cold step ``first_step_s``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from meshtron.config import MeshtronConfig
from meshtron.validation import validate_run


@dataclass
class RandomTokens:
    """A stand-in for the data bundle: fixed random micro-batches (no I/O in the timed loop)."""

    vocab_size: int
    seq_length: int
    micro_batch_size: int
    num_micro_batches: int
    seed: int
    tokenizer: Any = None
    eod: Optional[int] = None

    def _batch(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed + index)
        tokens = torch.randint(0, self.vocab_size, (self.micro_batch_size, self.seq_length + 1), generator=g)
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(self.micro_batch_size, self.seq_length)}

    def train_batches(self, start_iteration: int = 0) -> Iterator[list[dict]]:
        batches = [self._batch(i) for i in range(self.num_micro_batches)]
        while True:
            yield batches

    def valid_batches(self):
        return None


#: Flags whose own values hold commas (a layer pattern, a list, split weights): never a sweep.
COMMA_VALUED = frozenset({"--layer-pattern", "--moe-layer-freq", "--split", "--ranks", "--emulate-routing"})


def expand_rows(base: list[str]) -> list[list[str]]:
    """Expand comma-separated flag values into the cartesian product of argument lists (except the flags of
    :data:`COMMA_VALUED`, whose commas belong to the value)."""
    groups: list[list[list[str]]] = []
    i = 0
    while i < len(base):
        arg = base[i]
        values = []
        j = i + 1
        while j < len(base) and not base[j].startswith("--"):
            values.append(base[j])
            j += 1
        if len(values) == 1 and "," in values[0] and arg not in COMMA_VALUED:
            groups.append([[arg, v] for v in values[0].split(",")])
        else:
            groups.append([[arg] + values])
        i = j
    return [[tok for part in combo for tok in part] for combo in itertools.product(*groups)] if groups else [[]]


def yaml_rows(path: str) -> tuple[list[str], list[list[str]]]:
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}

    def to_argv(d: dict) -> list[str]:
        out: list[str] = []
        for key, value in d.items():
            flag = "--" + str(key).replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                out += [flag] + [str(v) for v in value]
            elif value is not None:
                out += [flag, str(value)]
        return out

    return to_argv(doc.get("base", {})), [to_argv(r) for r in doc.get("rows", [])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_row(argv: list[str], warmup: int, steps: int, split: bool = True, profile_comm: bool = False,
              memory_sites: bool = False) -> dict:
    """Build the configuration, train ``warmup + steps`` iterations, and measure."""
    from meshtron.cli import build_config
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    cfg: MeshtronConfig = build_config(["--mock-data", "--eval-interval", "0", "--train-iters",
                                        str(warmup + steps), "--log-interval", str(10**9)] + argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = validate_run(cfg, world)
    ctx = context_from_config(cfg, layout)
    dev = ctx.device
    leftover = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        # Memory still held from earlier rows of this launch (after an out-of-memory row, say): it
        # inflates this row's peak, so it is reported beside it.
        leftover = torch.cuda.memory_allocated(dev) / 2**30
    t = cfg.train
    n_micro = t.global_batch_size // (t.micro_batch_size * ctx.dp)
    vocab = cfg.model.vocab_size or 32000
    data = RandomTokens(vocab, cfg.model.seq_length, t.micro_batch_size, n_micro, t.seed)
    if memory_sites:
        from meshtron.memory_report import record_memory

        record_memory(dev.type == "cuda")  # from before the model is built, so weights are in the trace
    from meshtron.emulation.trace import recording

    # --record-collectives: this row's operations (its steps run slower for it: a dispatch mode sees every op).
    with recording(ctx, cfg.log.record_collectives) as recorder:
        trainer = Trainer(cfg, ctx, data=data, layout=layout)
        if recorder is not None:
            recorder.where = lambda: (trainer.progress.iteration, trainer.progress.phase)
        try:
            return _measure(trainer, cfg, ctx, data, warmup, steps, split, profile_comm, memory_sites, leftover,
                            argv)
        finally:
            trainer.close()  # its hooks would keep the parameters alive into the next row


def _alloc_retries(device: torch.device) -> Optional[int]:
    """How often the CUDA caching allocator has freed its cache to retry an allocation (None off CUDA). A step
    near the device's capacity that does so pays device-wide synchronisations: its time is not the layout's."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _measure(trainer, cfg: MeshtronConfig, ctx, data: RandomTokens, warmup: int, steps: int, split: bool,
             profile_comm: bool, memory_sites: bool, leftover: Optional[float], argv: list[str],
             split_repeats: int = 3) -> dict:
    """Time ``warmup + steps`` iterations of ``trainer``, then the step split (each pass the median of
    ``split_repeats`` runs) and the optional profiles. With no warm-up (steps of minutes) the step is the
    warm passes' sum and the optimizer step timed after them; the first, cold step is ``first_step_s``."""
    from meshtron.memory import estimate_memory
    from meshtron.training.metrics import compute_throughput

    dev, t = ctx.device, cfg.train
    vocab = cfg.model.vocab_size or 32000
    batches = next(data.train_batches())
    times = []
    retries = _alloc_retries(dev)
    for it in range(1, warmup + steps + 1):
        _sync(dev)
        start = time.perf_counter()
        trainer.progress.iteration = it  # where the hang watchdog and a collective trace see this rank
        trainer.train_step(batches, it)
        trainer.periodic_checks(it)  # straggler report and weight-hash check, when their flags ask
        _sync(dev)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[warmup:])
    retries = None if retries is None else _alloc_retries(dev) - retries
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    # What the caching allocator took from the device (fragmentation included; what torchtitan reports).
    reserved = torch.cuda.max_memory_reserved(dev) / 2**30 if dev.type == "cuda" else None
    sites = None
    if memory_sites and dev.type == "cuda":
        from meshtron.memory_report import memory_report, record_memory

        sites = memory_report(dev)
        record_memory(False)

    # Step-time split, in separate synchronised passes.
    def timed(fn, repeat=split_repeats) -> float:
        vals = []
        for _ in range(repeat):
            _sync(dev)
            s = time.perf_counter()
            fn()
            _sync(dev)
            vals.append(time.perf_counter() - s)
        return statistics.median(vals)

    fwd = fwdbwd = comm = data_time = first_step = None
    if split:
        # Data: the step's micro-batches moved to the device and given their loss weights.
        data_time = timed(lambda: trainer._prepare(batches))
        mbs = trainer._prepare(batches)
        fwd = timed(lambda: trainer.schedule(trainer.model_chunks, [dict(m) for m in mbs], forward_only=True))

        def fwd_bwd():
            trainer.dp_strategy.zero()
            trainer.schedule(trainer.model_chunks, [dict(m) for m in mbs])

        fwdbwd = timed(fwd_bwd)
        comm = timed(trainer.dp_strategy.finish) if ctx.dp * ctx.cp > 1 else 0.0
        if warmup == 0:
            # Without a warm-up the timed step was the first: it compiled the layers and grew the allocator
            # (7 s of the million-token rank's 83 s step). The passes above ran warm; time the optimizer step alike and
            # take the warm sum as the step (the cold one is reported as first_step_s).
            optimizer_s = timed(lambda: trainer.optimizer.step(trainer.learning_rate(warmup + steps)), repeat=1)
            first_step, step = step, data_time + fwdbwd + comm + optimizer_s
    kernels = None
    if profile_comm:  # one more step under the profiler: communication kernels and what compute hides
        from meshtron.profiling import profile_communication

        kernels = profile_communication(lambda: trainer.train_step(batches, warmup + steps), dev)
    tokens = t.global_batch_size * cfg.model.seq_length
    speed = compute_throughput(tokens, ctx.world_size, step, trainer.flops_per_token, trainer.peak_tflops)
    est = estimate_memory(cfg, vocab, world_size=ctx.world_size)
    row = {
        "model": cfg.model.model or "custom", "layout": ctx.describe(), "micro_batch": t.micro_batch_size,
        "global_batch": t.global_batch_size, "seq": cfg.model.seq_length,
        "recompute": t.recompute_granularity or "none", "precision": (f"fp8-{t.fp8_format}" if t.fp8_format
                                                                      else ("bf16" if t.bf16 else "fp32")),
        "compile": bool(t.compile), "step_s": step, "step_times_s": times[warmup:],
        "tokens_per_sec_per_gpu": speed.tokens_per_sec_per_gpu, "tflops_per_gpu": speed.tflops_per_gpu,
        "mfu": speed.mfu, "peak_mem_gib": peak, "peak_reserved_gib": reserved,
        "est_mem_gib": est.total / 2**30, "leftover_mem_gib": leftover, "alloc_retries": retries,
        "forward_s": fwd,
        "backward_s": None if fwd is None else max(0.0, fwdbwd - fwd),
        "optimizer_s": None if fwd is None else max(0.0, step - fwdbwd - comm - data_time),
        "exposed_comm_s": comm, "data_s": data_time,
        **({"first_step_s": first_step} if first_step is not None else {}),
        "argv": " ".join(argv),
    }
    if sites is not None:
        row["memory_sites_gib"] = sites
    if kernels is not None:
        row.update(comm_kernel_s=kernels.comm_s, exposed_comm_kernel_s=kernels.exposed_comm_s,
                   compute_kernel_s=kernels.compute_s, comm_by_kind_s=kernels.by_kind_s)
    if dist.is_initialized():
        dist.barrier()
    return row


def format_table(rows: Sequence[dict]) -> str:
    cols = [("model", "model", "{}"), ("layout", "layout", "{}"), ("mbs", "micro_batch", "{}"),
            ("gbs", "global_batch", "{}"), ("seq", "seq", "{}"), ("recompute", "recompute", "{}"),
            ("prec", "precision", "{}"), ("tok/s/GPU", "tokens_per_sec_per_gpu", "{:,.0f}"),
            ("TFLOP/s", "tflops_per_gpu", "{:.1f}"), ("MFU", "mfu", "{:.1%}"), ("peak GiB", "peak_mem_gib", "{:.1f}"),
            ("reserved GiB", "peak_reserved_gib", "{:.1f}"), ("est GiB", "est_mem_gib", "{:.1f}"), ("step ms", "step_s", "{:.0f}"), ("fwd ms", "forward_s", "{:.0f}"),
            ("bwd ms", "backward_s", "{:.0f}"), ("opt ms", "optimizer_s", "{:.0f}"), ("comm ms", "exposed_comm_s", "{:.0f}"),
            ("data ms", "data_s", "{:.1f}")]
    ms_keys = {"step_s", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "data_s"}

    def cell(r, key, fmt):
        v = r.get(key)
        if v is None:
            return "-"
        if "error" in r and key not in ("model", "layout"):
            return "-"
        return fmt.format(v * 1000 if key in ms_keys else v)

    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        line = "| " + " | ".join(cell(r, k, f) for _, k, f in cols) + " |"
        if "error" in r:
            line += f" {r['error']}"
        lines.append(line)
    return "\n".join(lines)


def current_commit() -> Optional[str]:
    """The short commit of the code being measured: MESHTRON_COMMIT where the tree was copied without its git
    history (a benchmark host), else ``git rev-parse``; None when neither says."""
    import subprocess

    commit = os.environ.get("MESHTRON_COMMIT") or None
    try:
        return commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def append_record(path: str, row: dict, flags: list[str]) -> None:
    """Append ``row`` to the measured-runs file with where and when it was measured."""
    import datetime

    from meshtron.planning.measured import bench_record, load_records

    commit = current_commit()
    kind = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    existing = load_records(path) if os.path.exists(path) else []
    record = bench_record(row, flags, existing, kind, int(os.environ.get("WORLD_SIZE", "1")), commit,
                          torch.__version__, datetime.date.today().isoformat())
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def bench_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshtron bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", help="YAML file with base: {flags} and rows: [{flags}, ...]")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per row")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per row (median reported)")
    parser.add_argument("--no-split", dest="split", action="store_false",
                        help="skip the step-time split passes (for rows whose steps take many seconds)")
    parser.add_argument("--profile-comm", action="store_true",
                        help="profile one more step: NCCL kernel time per collective, and the part of it that no "
                             "compute kernel overlaps (exposed)")
    parser.add_argument("--memory-sites", action="store_true",
                        help="record the CUDA allocator's history and report what holds memory at the peak, "
                             "grouped by allocation site in meshtron's code (slows the row down)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    parser.add_argument("--out", help="also append the rows as JSON lines to this file")
    parser.add_argument("--record", metavar="FILE",
                        help="also append each row to FILE (benchmarks/measured.jsonl) as a measured record: "
                             "with the device kind, GPU count, commit, torch version and date")
    args, rest = parser.parse_known_args(list(argv))
    base, rows = ([], [[]])
    if args.matrix:
        base, rows = yaml_rows(args.matrix)
        rows = rows or [[]]
    argvs = [a for r in rows for a in expand_rows(base + r + rest)]
    results = []
    rank0 = int(os.environ.get("RANK", "0")) == 0
    for row_argv in argvs:
        try:
            row = bench_row(row_argv, args.warmup, args.steps, args.split, args.profile_comm, args.memory_sites)
        except torch.OutOfMemoryError as err:
            row = {"argv": " ".join(row_argv), "error": "out of memory: " + " ".join(str(err).split())[:260]}
        torch._dynamo.reset()  # compiled code holds references to the previous row's modules
        gc.collect()  # the row's trainer is gone: release its memory before the next row
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if "error" in row and torch.cuda.is_available():
            row["leftover_mem_gib"] = torch.cuda.memory_allocated() / 2**30  # what the failed row left behind
        results.append(row)
        if rank0:
            print(json.dumps(row) if args.json else f"done: {row.get('argv')}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if args.record and "error" not in row:
                append_record(args.record, row, row_argv)
    if rank0 and not args.json:
        print(format_table(results))
        for i, row in enumerate(results, 1):
            if row.get("alloc_retries"):
                print(f"row {i}: the CUDA allocator flushed its cache {row['alloc_retries']} times during the timed "
                      f"steps (memory near the device's capacity): its step time is not the layout's")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
