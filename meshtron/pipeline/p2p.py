"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Every tensor crossing a stage boundary has the same shape, known before the run:
``[seq / CP / (TP with sequence parallelism), micro-batch, hidden]`` in the compute
dtype, so receivers allocate their buffers without a shape exchange.

One :meth:`PipelineP2P.exchange` posts all of a step's sends and receives as one
``batch_isend_irecv`` and waits for them. Neighbours are taken around a ring
(stage 0's previous stage is the last one): the interleaved schedule sends the
last stage's chunk output to stage 0's next chunk, and its gradient back.

Operations are posted in a fixed order: forward-direction messages (to the next,
from the previous stage) before backward-direction ones, so that when both
neighbours are the same rank (two stages) each pair of ranks posts its sends and
matching receives in the same order; distinct tags make that explicit for gloo.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from meshtron.config import MeshtronConfig
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.layout import sequence_parallel_in_effect

_FORWARD_TAG = 0
_BACKWARD_TAG = 1


def activation_shape(cfg: MeshtronConfig, ctx: ParallelContext) -> tuple[int, int, int]:
    """Shape of a stage's output (and of its gradient): [local seq, micro-batch, hidden]."""
    seq = cfg.model.seq_length // ctx.cp
    if sequence_parallel_in_effect(cfg.parallel.sequence_parallel, ctx.tp):
        seq //= ctx.tp
    return (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)


class PipelineP2P:
    """Sends and receives of one pipeline rank with its neighbouring stages.

    ``log`` (optional, for tests and debugging) receives one entry per exchange: a tuple of
    (op, peer global rank, tag) in posting order. ``ledger`` (set by the trainer; None: no bookkeeping)
    counts every posted operation per peer for the hang report
    (:class:`meshtron.resilience.p2p_ledger.P2PLedger`).
    """

    def __init__(self, ctx: ParallelContext, shape: tuple[int, ...], dtype: torch.dtype,
                 device: Optional[torch.device] = None, log: Optional[list] = None):
        if ctx.pp < 2 or ctx.pp_group is None:
            raise ValueError("PipelineP2P needs a pipeline-parallel group (--pipeline-model-parallel-size > 1)")
        self.group = ctx.pp_group
        self.stages = ctx.pp
        self.stage = ctx.pp_rank
        self.next_rank = ctx.pp_ranks[(ctx.pp_rank + 1) % ctx.pp]
        self.prev_rank = ctx.pp_ranks[(ctx.pp_rank - 1) % ctx.pp]
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device or ctx.device
        self.log = log
        self.ledger = None
        if self.device.type == "cuda":
            # NCCL creates a group's communicator lazily, at its first call, which must involve every
            # rank of the group; point-to-point steps do not, so make the first call a collective one.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline stage {self.stage}: {what} is {tuple(tensor.shape)} {tensor.dtype}, but "
                               f"stages exchange {self.shape} {self.dtype} (--seq-length, --micro-batch-size, "
                               f"--hidden-size, precision); every micro-batch must have that shape")
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def exchange(self, send_next: Optional[torch.Tensor] = None, send_prev: Optional[torch.Tensor] = None,
                 recv_prev: bool = False, recv_next: bool = False, wait: bool = True,
                 units: Optional[dict] = None):
        """Send an activation to the next stage and/or a gradient to the previous one; receive an
        activation from the previous stage and/or a gradient from the next one. Returns
        (from previous, from next), after every operation has completed; with ``wait=False``
        returns at once with (from previous, from next, pending work): the received tensors are
        valid, and sent tensors may be released, only after every work of the list has been
        waited for (``Work.wait()``; on GPUs that orders the current stream after the transfer).
        ``units``: for the ledger, (chunk, micro-batch, "activation" or "gradient") of each message by
        direction ("send_next", "recv_prev", "send_prev", "recv_next")."""
        ops: list[dist.P2POp] = []
        entries: list[tuple] = []
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None

        def add(op, tensor, peer, tag, name, direction):
            ops.append(dist.P2POp(op, tensor, peer, self.group, tag))
            entries.append((name, peer, tag))
            if self.ledger is not None:
                if name == "send" and self.ledger.before_send is not None:
                    self.ledger.before_send()
                chunk, micro_batch, what = (units or {}).get(direction) or (
                    None, None, "activation" if tag == _FORWARD_TAG else "gradient")
                self.ledger.post(name, peer, self.stage, what, chunk, micro_batch)

        if send_next is not None:
            add(dist.isend, self._check(send_next, "the activation sent forward"), self.next_rank, _FORWARD_TAG,
                "send", "send_next")
        if from_prev is not None:
            add(dist.irecv, from_prev, self.prev_rank, _FORWARD_TAG, "recv", "recv_prev")
        if send_prev is not None:
            add(dist.isend, self._check(send_prev, "the gradient sent backward"), self.prev_rank, _BACKWARD_TAG,
                "send", "send_prev")
        if from_next is not None:
            add(dist.irecv, from_next, self.next_rank, _BACKWARD_TAG, "recv", "recv_next")
        works = dist.batch_isend_irecv(ops) if ops else []
        if self.log is not None:
            self.log.append(tuple(entries))
        if not wait:
            return from_prev, from_next, works
        for work in works:
            work.wait()
        return from_prev, from_next


def free_output(tensor: torch.Tensor) -> None:
    """Release the memory of a stage output that has been sent to the next stage.

    Backward needs only the output's autograd node and shape, not its values: a
    stage ends with a residual add, whose backward keeps nothing of its result.
    The storage is shrunk to nothing while the tensor keeps its shape, so that
    ``torch.autograd.backward(output, grad)`` still accepts it. Tensors that are
    views, or not produced by an operation (a stage without layers would return its
    input), are left alone.
    """
    if tensor.grad_fn is None or tensor._base is not None:
        return
    tensor.untyped_storage().resize_(0)
