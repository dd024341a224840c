"""An emulated world: this process plays one rank of N, and every collective completes locally.

:func:`init_emulated_world` initialises torch.distributed with the backend ``meshtron_emulated`` for a world of
``world_size`` ranks in which this process is ``rank``. meshtron then builds its groups exactly as in a real
launch (:func:`meshtron.parallel.context.build_groups`: every ``new_group`` call, true sizes and members), and
every group this rank belongs to is an :class:`EmulatedProcessGroup`.

Why meshtron's own group and not torch's ``fake`` backend: torch's fake group leaves every output as it was
allocated, so a pipeline stage would compute on whatever memory the allocator handed out and the MoE
dispatch would size its buffers from garbage token counts. Here an operation completes with well-formed
contents: an all-to-all returns what this rank sent (the exchange of a balanced world, where every rank sends
and receives alike), an all-gather repeats this rank's part, a receive is standard normal values, a reduction
keeps this rank's values. The values are never the real ones; the shapes, dtypes, devices and the order of operations are.

torch routes two operations past Python process groups: the single-tensor all-gather and reduce-scatter
(``all_gather_single`` / ``reduce_scatter_single``, also inside compiled code) go straight to the group's
device backend, which here is torch's fake backend: those outputs keep what was in them. meshtron's control
flow never branches on those values, and the checks that would react to them are off under emulation
(:func:`meshtron.emulation.runner.emulation_overrides`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future
from torch.futures import Future

BACKEND = "meshtron_emulated"


def _completed(result=None) -> dist.Work:
    """A Work that has already finished."""
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _note(op: str, group: "EmulatedProcessGroup", buffer, opts=None) -> None:
    """Report an operation to the collective recorder in use (torch calls these methods without its
    dispatcher, where the recorder would see them)."""
    from meshtron.emulation.trace import active_recorder, first_dtype, nbytes

    recorder = active_recorder()
    if recorder is not None:
        is_async = getattr(opts, "asyncOp", None)
        recorder.note(op, group, nbytes(buffer), first_dtype(buffer), None if is_async is None else bool(is_async))


def _repeat_into(output: torch.Tensor, part: torch.Tensor) -> None:
    """Fill ``output`` (a whole number of ``part``s) with copies of ``part``."""
    n = part.numel()
    if n and output.numel() % n == 0:
        output.view(-1, n).copy_(part.reshape(1, n).to(output.dtype))


class EmulatedProcessGroup(dist.ProcessGroup):
    """A group of ``size`` ranks in which this process is ``rank``; every operation completes at once, here.

    ``counts_from_own_share``: under a routing skew (``--emulate-routing skew:S``) every rank routes as this
    one does, so each peer sends this rank what this rank routes to itself: an integer all-to-all (the MoE
    dispatch's exchange of token counts) returns this rank's own block from every peer. A rank that holds hot
    experts then receives more rows than it sends (the token all-to-all's output is larger than its input)."""

    counts_from_own_share = False

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # Reductions keep this rank's values (finite where they were finite).
    def allreduce(self, tensors, opts):
        _note("all_reduce", self, tensors, opts)
        return _completed(tensors)

    def allreduce_coalesced(self, tensors, opts):
        _note("all_reduce", self, tensors, opts)
        return _completed(tensors)

    def broadcast(self, tensors, opts):
        _note("broadcast", self, tensors, opts)
        return _completed(tensors)

    def barrier(self, opts):
        _note("barrier", self, None, opts)
        return _completed()

    def allgather(self, output_lists, inputs, opts):
        _note("all_gather", self, output_lists, opts)
        for outputs, part in zip(output_lists, inputs):
            for out in outputs:
                out.copy_(part)
        return _completed(output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        _note("all_gather", self, outputs, opts)
        for out, part in zip(outputs, inputs):
            _repeat_into(out, part)
        return _completed(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the name before torch 2.13

    def reduce_scatter(self, outputs, input_lists, opts):
        _note("reduce_scatter", self, input_lists, opts)
        for out, parts in zip(outputs, input_lists):
            out.copy_(parts[self.rank()])
        return _completed(outputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        _note("reduce_scatter", self, inputs, opts)
        for out, whole in zip(outputs, inputs):
            out.copy_(whole.reshape(-1)[self.rank() * out.numel():(self.rank() + 1) * out.numel()].view_as(out))
        return _completed(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        # The larger side: a rank holding hot experts receives more than it sends.
        _note("all_to_all", self, output if output.numel() > input.numel() else input, opts)
        size, rank = self.size(), self.rank()
        if (self.counts_from_own_share and not output.is_floating_point() and output.numel() == input.numel()
                and input.numel() % size == 0):
            block = input.numel() // size
            own = input.reshape(-1)[rank * block:(rank + 1) * block]
            output.view(size, block).copy_(own.reshape(1, block))
            return _completed(output)
        # Every rank sends and receives alike: what arrives is what this rank sent, where the sizes agree.
        if output.numel() == input.numel():
            output.copy_(input.view_as(output))
        else:
            output.zero_()
        return _completed(output)

    alltoall_base = all_to_all_single  # the name before torch 2.13

    def alltoall(self, outputs, inputs, opts):
        _note("all_to_all", self, inputs, opts)
        for out, part in zip(outputs, inputs):
            if out.shape == part.shape:
                out.copy_(part)
            else:
                out.zero_()
        return _completed(outputs)

    def send(self, tensors, dst, tag):
        _note("send", self, tensors)
        return _completed()

    def recv(self, tensors, src, tag):
        _note("recv", self, tensors)
        for t in tensors:
            # An activation or gradient from a neighbour: finite, of the right shape, and varied (a stage's MoE
            # router would send every token of an all-zero input to the same experts).
            if t.is_floating_point():
                t.normal_()
            else:
                t.zero_()
        return _completed(tensors)


def _create(common_opts, backend_opts) -> EmulatedProcessGroup:
    group = EmulatedProcessGroup(common_opts.group_rank, common_opts.group_size)
    # torch keeps a group's name on its device backends: torch's fake backend holds it (and takes the two
    # operations that torch does not route through Python groups).
    holder = FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, holder)
    return group


def register_backend() -> None:
    """Make ``meshtron_emulated`` a torch.distributed backend (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def init_emulated_world(world_size: int, rank: int) -> None:
    """Initialise torch.distributed as rank ``rank`` of an emulated world of ``world_size`` ranks."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    register_backend()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


def is_emulated(group=None) -> bool:
    """Whether ``group`` (default: the world) is emulated."""
    if not dist.is_initialized():
        return False
    group = group if group is not None else dist.group.WORLD
    return isinstance(group, EmulatedProcessGroup)
