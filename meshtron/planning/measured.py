"""The record of measured GPU runs (``benchmarks/measured.jsonl``): its schema, and the memory model against it.

One JSON object per line: the row as ``meshtron bench --json`` prints it (model, layout, micro_batch,
global_batch, seq, recompute, precision, compile, step_s, tokens_per_sec_per_gpu, tflops_per_gpu, mfu,
peak_mem_gib, est_mem_gib, argv), plus where it was measured (device_kind, gpu_count, commit, torch, date,
source: the docs/benchmarks.md section, null until the row is written there) and bookkeeping: ``id``, ``flags`` (the ``meshtron train``
flags of the row's configuration), ``peak_mem_trusted`` (false where the peak is known to include
memory of an earlier row of the same launch), ``note``, ``replaces`` (the id of a row this one
corrects; rows are never deleted). A figure the source does not give is null. Optional: ``layer_saves``
(on rows measured while the layers kept more for backward: the revision of that code,
``meshtron.memory.LAYER_SAVES``; the models compare such a row with their model of that code), ``code_changed``,
``"<commit>: <what>"``, on a row whose flags run differently since that commit (a later row measures the code
of today); the comparisons with the models leave such rows out and say why (:func:`left_out`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable, Optional

FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "model": (str,), "layout": (str,), "micro_batch": (int,), "global_batch": (int, type(None)),
    "seq": (int,), "recompute": (str,), "precision": (str,), "fp8_recipe": (str, type(None)), "compile": (bool,),
    "step_s": (float, int, type(None)), "tokens_per_sec_per_gpu": (float, int, type(None)),
    "tflops_per_gpu": (float, int, type(None)), "mfu": (float, int, type(None)),
    "peak_mem_gib": (float, int, type(None)), "est_mem_gib": (float, int, type(None)), "argv": (str, type(None)),
    "flags": (list,), "peak_mem_trusted": (bool,), "device_kind": (str,), "gpu_count": (int,),
    "commit": (str, type(None)), "torch": (str,), "date": (str,), "source": (str, type(None)), "note": (str, type(None)),
    "replaces": (str, type(None)),
}
#: Further fields ``meshtron bench --json`` prints (kept by ``--record``; optional in the schema).
BENCH_EXTRAS = frozenset({"leftover_mem_gib", "peak_reserved_gib", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "data_s",
                          "memory_sites_gib", "comm_kernel_s", "exposed_comm_kernel_s", "compute_kernel_s",
                          "comm_by_kind_s", "error"})
#: Optional fields: present on some records only.
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"code_changed": (str,), "layer_saves": (int,),
                                                "step_model_gap": (str,)}
#: ``step_model_gap``: why the step-time model does not cover the row yet (a cost it does not count); the row
#: stays in the memory comparisons and is left out of the step-time ones, with that reason printed.
#: ``code_changed``: the commit from which the row's flags run differently, and what changed.
CODE_CHANGED = re.compile(r"^[0-9a-f]{7,40}: \S")
#: A peak above the memory an earlier row of the launch left behind by more than this is not trusted.
LEFTOVER_GIB = 0.1
LAYOUT = re.compile(r"^TP=(\d+) CP=(\d+) DP=(\d+) PP=(\d+) EP=(\d+)$")


def load_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def schema_errors(record: dict, known_ids: Iterable[str] = ()) -> list[str]:
    """What is wrong with one record (empty when it is well formed)."""
    errors = [f"missing {k}" for k in FIELDS if k not in record]
    errors += [f"unknown field {k}" for k in record
               if k not in FIELDS and k not in BENCH_EXTRAS and k not in OPTIONAL_FIELDS]
    if "code_changed" in record and not CODE_CHANGED.match(str(record["code_changed"])):
        errors.append(f"code_changed={record['code_changed']!r} is not '<commit>: <what changed>'")
    for key, types in FIELDS.items():
        value = record.get(key)
        if key in record and not (isinstance(value, types) and not (isinstance(value, bool) and bool not in types)):
            errors.append(f"{key}={value!r} is not {'/'.join(t.__name__ for t in types)}")
    layout = LAYOUT.match(str(record.get("layout", "")))
    if layout is None:
        errors.append(f"layout {record.get('layout')!r} is not 'TP=a CP=b DP=c PP=d EP=e'")
    elif isinstance(record.get("gpu_count"), int):
        tp, cp, dp, pp, _ = map(int, layout.groups())
        if tp * cp * dp * pp != record["gpu_count"]:
            errors.append(f"layout {record['layout']} does not use gpu_count={record['gpu_count']} GPUs")
    if record.get("peak_mem_trusted") and record.get("peak_mem_gib") is None:
        errors.append("peak_mem_trusted without peak_mem_gib")
    if record.get("replaces") is not None and record["replaces"] not in set(known_ids):
        errors.append(f"replaces unknown id {record['replaces']!r}")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", str(record.get("date", ""))):
        errors.append(f"date {record.get('date')!r} is not YYYY-MM-DD")
    return errors


def bench_record(row: dict, flags: list[str], existing: list[dict], device_kind: str, gpu_count: int,
                 commit: Optional[str], torch_version: str, date: str) -> dict:
    """A ``meshtron bench`` row as a record of this file (``meshtron bench --record FILE``)."""
    recipe = None
    if str(row.get("precision", "")).startswith("fp8"):
        recipe = flags[flags.index("--fp8-recipe") + 1] if "--fp8-recipe" in flags else "tensorwise"
    leftover = row.get("leftover_mem_gib")
    record = {key: row.get(key) for key in FIELDS}
    record.update(id=f"r{len(existing) + 1}", fp8_recipe=recipe, flags=list(flags), device_kind=device_kind,
                  gpu_count=gpu_count, commit=commit, torch=torch_version, date=date, source=None, note=None,
                  replaces=None, peak_mem_trusted=row.get("peak_mem_gib") is not None
                  and (leftover is None or leftover < LEFTOVER_GIB))
    record.update({k: v for k, v in row.items() if k in BENCH_EXTRAS})
    return record


def record_config(record: dict):
    """The validated configuration of a record's ``flags`` on its GPUs (planned for CUDA, see planning.cli)."""
    from meshtron.cli import build_config
    from meshtron.planning.validate import validate_for_plan

    return validate_for_plan(build_config(record["flags"]), record["gpu_count"])


@dataclass(frozen=True)
class PeakComparison:
    """The memory model against one measured peak."""

    id: str
    measured_gib: float
    estimated_gib: float

    @property
    def relative(self) -> float:
        """(estimate - measured) / measured: negative when the model under-estimates."""
        return (self.estimated_gib - self.measured_gib) / self.measured_gib


def left_out(records: Iterable[dict]) -> dict[str, str]:
    """Rows the model comparisons leave out, with the reason: measured at code that has changed since
    (``code_changed``), or replaced by a later record (``replaces``)."""
    records = list(records)
    out = {r["id"]: f"code changed since: {r['code_changed']}" for r in records if r.get("code_changed")}
    for r in records:
        if r.get("replaces") and r["replaces"] not in out:
            out[r["replaces"]] = f"replaced by {r['id']}"
    return out


def layer_saves(record: dict) -> int:
    """The revision of what the layers kept when the row was measured (:data:`meshtron.memory.LAYER_SAVES`)."""
    from meshtron.planning.layer_costs import LAYER_SAVES

    return record.get("layer_saves", LAYER_SAVES)


def trusted_peaks(records: Iterable[dict]) -> list[dict]:
    """The records whose peak is trusted and describes today's code (not :func:`left_out`)."""
    records = list(records)
    gone = left_out(records)
    return [r for r in records if r["peak_mem_trusted"] and r["id"] not in gone]


def memory_errors(records: Iterable[dict]) -> list[PeakComparison]:
    """``meshtron.memory.estimate_memory`` on every record of :func:`trusted_peaks`."""
    from meshtron.memory import estimate_memory

    out = []
    for r in trusted_peaks(records):
        cfg = record_config(r)
        est = estimate_memory(cfg, cfg.model.vocab_size, world_size=r["gpu_count"],
                              saves=layer_saves(r))
        out.append(PeakComparison(r["id"], r["peak_mem_gib"], est.total / 2**30))
    return out


def worst(errors: Iterable[PeakComparison]) -> Optional[PeakComparison]:
    return max(errors, key=lambda e: abs(e.relative), default=None)


def superseded_ids(records: Iterable[dict]) -> set[str]:
    """Ids of rows that a later record measured again (its ``replaces``)."""
    return {r["replaces"] for r in records if r.get("replaces")}


def step_model_gaps(records: Iterable[dict]) -> dict[str, str]:
    """Rows whose step time the model does not cover yet (``step_model_gap``), with the reason."""
    return {r["id"]: r["step_model_gap"] for r in records if r.get("step_model_gap")}


def timed_records(records: list[dict]) -> list[dict]:
    """The records with a measured throughput that describe today's code (not :func:`left_out`) and whose cost
    the step-time model covers (no ``step_model_gap``)."""
    gone = left_out(records)
    return [r for r in records if r.get("tokens_per_sec_per_gpu") and r["id"] not in gone
            and not r.get("step_model_gap")]


def measured_step_s(record: dict, cfg) -> float:
    """The record's step time: tokens of a step over its tokens per second (per GPU x GPUs)."""
    t = cfg.train
    tokens = t.global_batch_size * cfg.model.seq_length
    return tokens / (record["tokens_per_sec_per_gpu"] * record["gpu_count"])


@dataclass(frozen=True)
class StepComparison:
    """The step-time model against one measured row."""

    id: str
    measured_s: float
    predicted_s: float

    @property
    def relative(self) -> float:
        """(predicted - measured) / measured: negative when the model is too fast."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def record_links(record: dict):
    """The links of a record's machine: every measured row so far ran on one node."""
    from meshtron.planning.step_time import Links

    return Links(gpus_per_node=max(8, record["gpu_count"]))


def step_errors(records: list[dict], profile, configs: Optional[dict] = None) -> list[StepComparison]:
    """:func:`meshtron.planning.step_time.predict_step` on every timed record (``configs``: id -> config cache)."""
    from meshtron.planning.step_time import predict_step

    out = []
    for r in timed_records(records):
        cfg = configs[r["id"]] if configs is not None and r["id"] in configs else record_config(r)
        if configs is not None:
            configs[r["id"]] = cfg
        pred = predict_step(cfg, r["gpu_count"], profile, links=record_links(r),
                            saves=layer_saves(r))
        out.append(StepComparison(r["id"], measured_step_s(r, cfg), pred.step_s))
    return out


#: The features a record is counted under in the error tables of docs/planning.md, in their order.
FEATURES = ("one GPU, dense, bf16, no recomputation", "DP > 1", "TP > 1 (+SP)", "PP > 1", "CP > 1", "EP > 1", "MoE",
            "MLA", "FP8", "recomputation", "activation offloading", "sharding strategies", "no torch.compile")


def record_features(record: dict) -> set[str]:
    """The :data:`FEATURES` a record has (from its configuration)."""
    cfg = record_config(record)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = record["gpu_count"] // (tp * pp * cp)
    moe = bool(m.num_experts)
    out = {name for name, has in (
        ("DP > 1", dp > 1), ("TP > 1 (+SP)", tp > 1), ("PP > 1", pp > 1), ("CP > 1", cp > 1),
        ("EP > 1", p.expert_model_parallel_size > 1), ("MoE", moe), ("MLA", bool(m.multi_latent_attention)),
        ("FP8", bool(t.fp8_format)), ("recomputation", bool(t.recompute_granularity)),
        ("activation offloading", bool(t.offload_activations)),
        ("sharding strategies", p.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")),
        ("no torch.compile", t.compile is False)) if has}
    if record["gpu_count"] == 1 and not (out - {"no torch.compile"}):
        out.add("one GPU, dense, bf16, no recomputation")
    return out


def errors_by_feature(errors: Iterable, records: Iterable[dict]) -> list[tuple[str, int, float, object]]:
    """(feature, rows, median |relative error|, worst comparison) for each feature some compared row has;
    ``errors`` are :class:`PeakComparison` or :class:`StepComparison` objects (their ``id`` and ``relative``)."""
    import statistics

    by_id = {r["id"]: r for r in records}
    groups: dict[str, list] = {name: [] for name in FEATURES}
    for e in errors:
        for name in record_features(by_id[e.id]):
            groups[name].append(e)
    return [(name, len(rows), statistics.median(abs(e.relative) for e in rows), worst(rows))
            for name, rows in groups.items() if rows]
