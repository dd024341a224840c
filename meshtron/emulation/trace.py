"""Collective traces: every communication operation of a run, one JSON line each (``--record-collectives``).

A trace is the contract between a real rank and its emulated twin (DESIGN.md section 13): both run the same
program, so they issue the same operations, in the same order, on the same groups, with the same bytes.

:class:`CollectiveRecorder` sees every operation whichever way it was issued:

* through torch's dispatcher (``torch.distributed`` calls on gloo or NCCL groups, functional collectives,
  in eager or compiled code): a dispatch mode that notes the ``c10d`` and ``_c10d_functional`` operators;
* on an emulated group (:mod:`meshtron.emulation.process_group`), whose Python methods torch calls without
  the dispatcher: the group reports each call itself.

An operation is noted once, at its outermost entry (a functional all-reduce is not noted again when it reaches
the group). Each record: ``iteration`` (0 while the run sets up), ``phase`` (what the rank was doing),
``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, barrier, ...), ``group``
(meshtron's name of the group: tp, cp, dp, pp, dp_cp, tp_cp, model_parallel, embedding, ep, expert_dp,
dp_cp_shard, dp_cp_replica (hybrid sharding), world,
...), ``group_size``, ``bytes``, ``dtype`` and ``async`` (issued without waiting; null where the call does
not say). ``bytes`` is the whole buffer of the operation as this rank sees it: the gathered output of an
all-gather, the input of a reduce-scatter and of an all-to-all, the tensor of the others.

Recording runs Python on every operator of the step (a dispatch mode), so recorded steps are slower than
plain ones: timings come from steps that are not recorded.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Operator name (without overload) -> the trace's op name.
_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv",
    "recv_any_source_": "recv", "barrier": "barrier", "monitored_barrier_": "barrier", "reduce_": "reduce",
    "gather_": "gather", "scatter_": "scatter",
}
# Arguments (by schema name) that hold the buffer ``bytes`` counts, per op; functional all-gathers count
# their input times the group size.
_BUFFER_ARGS = {
    "all_gather": ("output_tensor", "output_tensors", "output", "outputs"),
    "reduce_scatter": ("input_tensor", "input_tensors", "input", "inputs"),
    "all_to_all": ("input", "input_tensors", "input_tensor"),
}
_DEFAULT_ARGS = ("tensors", "tensor", "input", "inputs", "self")


def nbytes(value) -> int:
    """Bytes of a tensor or of the tensors in (nested) lists."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def first_dtype(value) -> Optional[str]:
    """The dtype name of the first tensor in ``value`` (a tensor or nested lists), None without one."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        for v in value:
            found = first_dtype(v)
            if found:
                return found
    return None


#: meshtron's names of a ParallelContext's groups (its ``<name>_group`` fields).
GROUP_FIELDS = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "model_parallel", "embedding", "ep", "expert_dp",
                "dp_cp_shard", "dp_cp_replica")


def group_names(ctx) -> dict[str, str]:
    """torch's name of each of ``ctx``'s groups -> meshtron's (the ParallelContext field without ``_group``)."""
    names: dict[str, str] = {}
    for field in GROUP_FIELDS:
        group = getattr(ctx, f"{field}_group", None)
        if group is not None:
            names.setdefault(group.group_name, field)
    later = getattr(ctx, "later_groups", None)
    for size, group in (later.tp if later is not None else {}).items():
        if group is not None:
            names.setdefault(group.group_name, f"tp_sub{size}")
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, "world")
    return names


class CollectiveRecorder(TorchDispatchMode):
    """Notes every collective and point-to-point operation while active (``with recorder:``).

    ``ctx``: the ParallelContext whose groups name the records; ``where``: returns (iteration, phase) now.
    """

    def __init__(self, ctx, where: Callable[[], tuple[int, str]] = lambda: (0, "setup")):
        super().__init__()
        self.ctx = ctx
        self.where = where
        self.records: list[dict] = []
        self._inside = 0  # >0 while an operation noted here runs: its inner calls are not noted again
        self._names: dict[str, str] = {}

    # ---------------------------------------------------------------- naming
    def _group_name(self, group) -> str:
        torch_name = group if isinstance(group, str) else getattr(group, "group_name", None)
        if torch_name is None:
            return "unknown"
        if torch_name not in self._names:
            self._names = group_names(self.ctx)
        return self._names.get(torch_name, f"group{torch_name}")

    @staticmethod
    def _group_size(group) -> int:
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        return group.size()

    # ---------------------------------------------------------------- noting
    def note(self, op: str, group, nbytes_: int, dtype: Optional[str], is_async: Optional[bool]) -> None:
        """Add one record (a no-op inside an operation already noted)."""
        if self._inside:
            return
        iteration, phase = self.where()
        self.records.append({"iteration": iteration, "phase": phase, "op": op, "group": self._group_name(group),
                             "group_size": self._group_size(group), "bytes": int(nbytes_), "dtype": dtype,
                             "async": is_async})

    # Higher-order operators reach __torch_dispatch__ too. Flex attention's (its backward runs under the recorder
    # when the step's backward does) hold no collective and run as without the recorder; any other is refused
    # rather than run unrecorded, since its body might hold a collective.
    supports_higher_order_operators = True
    _COLLECTIVE_FREE_HOPS = frozenset({"flex_attention", "flex_attention_backward"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            if func.name() in self._COLLECTIVE_FREE_HOPS:
                return func(*args, **kwargs)
            raise NotImplementedError(f"collective recorder: the higher-order operator {func.name()} may hold "
                                      "collectives the recorder would not see; it is not supported while recording")
        op = _OPS.get(func._schema.name.split("::")[-1]) if func.namespace in ("c10d", "_c10d_functional") else None
        if op is None or self._inside:
            return func(*args, **kwargs)
        named = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(func._schema.arguments)}
        group = named.get("process_group")
        group = dist.ProcessGroup.unbox(group) if group is not None else named.get("group_name")
        buffer = next((named[n] for n in _BUFFER_ARGS.get(op, ()) + _DEFAULT_ARGS if n in named), None)
        size = nbytes(buffer)
        if func.namespace == "_c10d_functional" and op == "all_gather":
            size *= int(named.get("group_size", 1))
        is_async = named.get("async_op") if "async_op" in named else (True if func.namespace == "_c10d_functional"
                                                                      else None)
        self.note(op, group, size, first_dtype(buffer), None if is_async is None else bool(is_async))
        self._inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._inside -= 1

    # ---------------------------------------------------------------- output
    def write(self, path: str) -> None:
        """Write the records as JSON lines to ``path`` (its folder created)."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            for record in self.records:
                out.write(json.dumps(record) + "\n")


def active_recorder() -> Optional[CollectiveRecorder]:
    """The recorder in use, if any (emulated groups report their operations to it): the innermost
    :class:`CollectiveRecorder` on torch's stack of dispatch modes."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    found = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, CollectiveRecorder)]
    return found[-1] if found else None


@contextmanager
def outside_recorder() -> Iterator[None]:
    """Run the block with the innermost dispatch mode popped if it is a :class:`CollectiveRecorder`, else as is.

    For operations that hold no collective and cannot run under a user dispatch mode: flex attention compiles
    itself (even eagerly), and torch.compile refuses a frame while such a mode is active."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if isinstance(_get_current_dispatch_mode(), CollectiveRecorder):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def trace_path(path: str, rank: int) -> str:
    """This rank's trace file for ``--record-collectives PATH``: ``PATH.rank<r>.jsonl`` (``PATH`` a file stem)."""
    stem = path[:-len(".jsonl")] if path.endswith(".jsonl") else path
    return f"{stem}.rank{rank}.jsonl"


@contextmanager
def recording(ctx, path: Optional[str], where: Callable[[], tuple[int, str]] = lambda: (0, "setup"),
              rank: Optional[int] = None) -> Iterator[Optional[CollectiveRecorder]]:
    """Record this rank's operations while the block runs and write them to :func:`trace_path` at its end
    (also when it fails: a trace up to a fault is what explains it). ``path`` None: no recording."""
    if not path:
        yield None
        return
    recorder = CollectiveRecorder(ctx, where)
    try:
        with recorder:
            yield recorder
    finally:
        recorder.write(trace_path(path, ctx.rank if rank is None else rank))


def read_trace(path: str) -> list[dict]:
    """The records of one trace file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def comparable(records: list[dict]) -> list[tuple]:
    """What must agree between a real rank and its emulated twin: (iteration, op, group, size, bytes, dtype),
    in order."""
    return [(r["iteration"], r["op"], r["group"], r["group_size"], r["bytes"], r["dtype"]) for r in records]
