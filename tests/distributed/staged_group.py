"""A test-only process group that lets several ranks share one GPU: collectives staged through host memory.

NCCL refuses two ranks on one device, and gloo runs most operations on CPU tensors only. The group
``meshtron_staged`` keeps every rank's tensors on its (shared) GPU and runs each operation through a gloo group
of the same members: inputs are copied to host memory, gloo exchanges them, results are copied back into the
device tensors. Reductions run in fp32 (gloo has no sum of FP8, and bf16 sums of two operands round the same way
in fp32), gathers and exchanges move raw bytes (any dtype, FP8 included). Point-to-point sends return at once;
a receive completes, with its copy to the device, when its future does.

So the GPU-only code paths (compiled layers with functional collectives, FP8 casts under sequence parallelism,
cuDNN attention under context parallelism, side-stream overlap, ZeRO-3 prefetch) run in multi-rank layouts on a
machine with one GPU. It measures nothing about NCCL: it is for equivalence tests, never for timing.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "meshtron_staged"

_REDUCE_IN_FP32 = (torch.float16, torch.bfloat16, torch.float32)


def _completed(result=None) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents in host memory, as bytes (gloo moves any dtype that way)."""
    host = t.detach().contiguous().cpu()
    return host.view(torch.uint8) if host.element_size() > 0 and host.numel() else host


def _host_empty_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)


def _back_from_bytes(out: torch.Tensor, host: torch.Tensor) -> None:
    if out.numel():
        out.detach().copy_(host.view(out.dtype).view(out.shape))  # a receive buffer may require grad


def _host_for_reduce(t: torch.Tensor) -> torch.Tensor:
    """A host copy to reduce in place (never ``t`` itself: a reduce-scatter must leave its input as it was)."""
    dtype = torch.float32 if t.dtype in _REDUCE_IN_FP32 else t.dtype
    return t.detach().to("cpu", dtype, copy=True)


def _op(opts):
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    return op


class StagedProcessGroup(dist.ProcessGroup):
    """A group whose members may share one GPU: every operation runs on gloo through host memory."""

    def __init__(self, rank: int, size: int, gloo):
        super().__init__(rank, size)
        self._gloo = gloo  # a gloo backend (CPU tensors) of the same members

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # -- reductions ------------------------------------------------------------------------------------------
    def _reduce_host(self, host: torch.Tensor, op) -> torch.Tensor:
        average = op == dist.ReduceOp.AVG
        opts = _c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if average else op
        self._gloo.allreduce([host], opts).wait()
        if average:
            host /= self.size()
        return host

    def allreduce(self, tensors, opts):
        for t in tensors:
            t.detach().copy_(self._reduce_host(_host_for_reduce(t), _op(opts)))
        return _completed(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        for out, parts in zip(outputs, input_lists):
            whole = self._reduce_host(torch.stack([_host_for_reduce(p) for p in parts]), _op(opts))
            out.detach().copy_(whole[self.rank()])
        return _completed(outputs)

    def _reduce_scatter_one(self, out: torch.Tensor, whole: torch.Tensor, opts) -> None:
        summed = self._reduce_host(_host_for_reduce(whole).reshape(-1), _op(opts))
        n = out.numel()
        out.detach().copy_(summed[self.rank() * n:(self.rank() + 1) * n].view(out.shape))

    def reduce_scatter_single(self, output, input, opts):
        self._reduce_scatter_one(output, input, opts)
        return _completed([output])

    _reduce_scatter_base = reduce_scatter_single  # the name before torch 2.13

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for out, whole in zip(outputs, inputs):
            self._reduce_scatter_one(out, whole, opts)
        return _completed(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ---------------------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        for t in tensors:
            host = _host_bytes(t)
            bopts = _c10d.BroadcastOptions()
            bopts.rootRank, bopts.rootTensor = opts.rootRank, 0
            self._gloo.broadcast([host], bopts).wait()
            _back_from_bytes(t, host)
        return _completed(tensors)

    def barrier(self, opts):
        self._gloo.barrier(_c10d.BarrierOptions()).wait()
        return _completed()

    def _gather_bytes(self, part: torch.Tensor) -> list[torch.Tensor]:
        host = _host_bytes(part)
        outs = [torch.empty_like(host) for _ in range(self.size())]
        self._gloo.allgather([outs], [host], _c10d.AllgatherOptions()).wait()
        return outs

    def allgather(self, output_lists, inputs, opts):
        for outputs, part in zip(output_lists, inputs):
            for out, host in zip(outputs, self._gather_bytes(part)):
                _back_from_bytes(out, host)
        return _completed(output_lists)

    def _gather_into(self, out: torch.Tensor, part: torch.Tensor) -> None:
        _back_from_bytes(out, torch.cat(self._gather_bytes(part)))

    def all_gather_single(self, output, input, opts):
        self._gather_into(output, input)
        return _completed([output])

    _allgather_base = all_gather_single  # the name before torch 2.13

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        for out, part in zip(outputs, inputs):
            self._gather_into(out, part)
        return _completed(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the name before torch 2.13

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        size = self.size()
        ins = list(input.split(list(input_splits) or [input.shape[0] // size] * size))
        outs = list(output.split(list(output_splits) or [output.shape[0] // size] * size))
        self._exchange(outs, ins)
        return _completed([output])

    alltoall_base = all_to_all_single  # the name before torch 2.13

    def alltoall(self, outputs, inputs, opts):
        self._exchange(list(outputs), list(inputs))
        return _completed(outputs)

    def _exchange(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """Rank r's ins[j] becomes rank j's outs[r]: pairwise sends and receives of bytes on gloo."""
        me = self.rank()
        recv_bufs = {}
        works = []
        for peer in range(self.size()):
            if peer == me:
                continue
            recv_bufs[peer] = _host_empty_bytes(outs[peer])
            if recv_bufs[peer].numel():
                works.append(self._gloo.recv([recv_bufs[peer]], peer, 0))
        sends = []
        for peer in range(self.size()):
            if peer != me and ins[peer].numel():
                host = _host_bytes(ins[peer])
                sends.append(host)
                works.append(self._gloo.send([host], peer, 0))
        for w in works:
            w.wait()
        outs[me].detach().copy_(ins[me])
        for peer, host in recv_bufs.items():
            if host.numel():
                _back_from_bytes(outs[peer], host)

    def send(self, tensors, dst, tag):
        # Returns at once (the peer may post its receive later): the bytes are in host memory already.
        hosts = [_host_bytes(t) for t in tensors]
        return _Pending([self._gloo.send([h], dst, tag) for h in hosts], hosts)

    def recv(self, tensors, src, tag):
        hosts = [_host_empty_bytes(t) for t in tensors]
        works = [self._gloo.recv([h], src, tag) for h in hosts]
        return _Pending(works, hosts, lambda: [_back_from_bytes(t, h) for t, h in zip(tensors, hosts)])


class _Pending(dist.Work):
    """gloo point-to-point operations in flight, with what to do once they are done (gloo's own works
    have no futures to chain on)."""

    def __init__(self, works: list, keep: list, then=None):
        super().__init__()
        self._works, self._keep, self._then = works, keep, then

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        if self._then is not None:
            self._then()
            self._then = None
        return True

    def is_completed(self) -> bool:
        return self._then is None and all(w.is_completed() for w in self._works)


def _create(common_opts, backend_opts) -> StagedProcessGroup:
    timeout = getattr(common_opts, "timeout", None) or datetime.timedelta(minutes=10)
    gloo = dist.ProcessGroupGloo(common_opts.store, common_opts.group_rank, common_opts.group_size, timeout)
    group = StagedProcessGroup(common_opts.group_rank, common_opts.group_size, gloo)
    # Operations that torch sends past Python groups to the device's backend reach gloo.
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


def _let_the_compiler_trace_it() -> None:
    """torch 2.11's compiler traces a process group passed into compiled code only when its type is exactly
    torch's (or torch's fake group): admit this one too. Later versions handle groups without this."""
    try:
        from torch._dynamo.variables.distributed import ProcessGroupVariable
    except ImportError:
        return
    check = getattr(ProcessGroupVariable, "is_process_group", None)
    if check is None or getattr(check, "admits_staged", False):
        return

    def is_process_group(value: object) -> bool:
        return isinstance(value, StagedProcessGroup) or check(value)

    is_process_group.admits_staged = True
    ProcessGroupVariable.is_process_group = staticmethod(is_process_group)


def register_backend() -> None:
    """Make ``meshtron_staged`` a torch.distributed backend (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _let_the_compiler_trace_it()
