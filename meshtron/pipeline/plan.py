"""The vocabulary of a pipeline plan: the passes, exchanges and weight-gradient steps a rank runs in order,
and where the model chunks sit over the stages.

Both the schedules (:mod:`meshtron.pipeline.schedules`, which build and run plans) and the zero-bubble orders
(:mod:`meshtron.pipeline.zero_bubble`) speak it, so it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from meshtron.pipeline.partition import chunk_position

Unit = tuple[int, int]  # (model chunk on this rank, micro-batch)


@dataclass(frozen=True)
class Compute:
    """A forward or backward pass of one micro-batch through one of this rank's chunks."""

    backward: bool
    chunk: int
    micro_batch: int

    @property
    def unit(self) -> Unit:
        return (self.chunk, self.micro_batch)


def labelled_message(unit: Optional[Unit], what: str, other: Optional[Unit], other_what: str) -> Optional[tuple]:
    """(chunk, micro-batch, what travels) of an exchange's message in one direction, for the hang report."""
    if unit is not None:
        return (*unit, what)
    return (*other, other_what) if other is not None else None


@dataclass(frozen=True)
class Exchange:
    """One batched exchange: each field names the (chunk, micro-batch) whose tensor travels.

    send_next: that forward's output goes to the next stage. recv_prev: that forward's input
    comes from the previous stage. send_prev: that backward's input gradient goes to the
    previous stage. recv_next: the gradient of that forward's output comes from the next stage.
    """

    send_next: Optional[Unit] = None
    recv_prev: Optional[Unit] = None
    send_prev: Optional[Unit] = None
    recv_next: Optional[Unit] = None
    # ZBV's second chunk runs the other way over the stages: its forward outputs travel to the previous
    # stage and its input gradients to the next one.
    send_prev_activation: Optional[Unit] = None
    recv_next_activation: Optional[Unit] = None
    send_next_grad: Optional[Unit] = None
    recv_prev_grad: Optional[Unit] = None

    def receives(self) -> list[tuple[str, Unit]]:
        """(``"input"`` or ``"grad"``, unit) of every tensor this exchange receives."""
        fields = (("input", self.recv_prev), ("grad", self.recv_next), ("input", self.recv_next_activation),
                  ("grad", self.recv_prev_grad))
        return [(kind, unit) for kind, unit in fields if unit is not None]


@dataclass(frozen=True)
class WeightGrad:
    """The W pass of a zero-bubble schedule: the deferred weight gradients of one micro-batch's
    backward through one of this rank's chunks (local work: it neither sends nor receives)."""

    chunk: int
    micro_batch: int

    @property
    def unit(self) -> Unit:
        return (self.chunk, self.micro_batch)


Step = Union[Compute, Exchange, WeightGrad]




@dataclass(frozen=True)
class Placement:
    """Where the model chunks sit: chunk ``v`` of stage ``r`` holds model chunk ``position(r, v)``.

    Round-robin (1F1B, interleaved): ``v * stages + r``, the last stage's output going around the ring to
    stage 0's next chunk. V-shaped (ZBV, two chunks): chunk 0 of stage ``r`` is model chunk ``r`` and chunk 1
    is ``2 * stages - 1 - r``, so stage 0 holds the first and the last layers (embedding and loss), and the
    last stage hands its chunk 0's output to its own chunk 1 without a message.
    """

    stages: int
    virtual: int
    v_shape: bool = False

    def position(self, stage: int, chunk: int) -> int:
        return chunk_position(self.stages, stage, chunk, self.v_shape)

    def at(self, position: int) -> tuple[int, int]:
        """(stage, chunk) of model chunk ``position``."""
        if self.v_shape:
            return (position, 0) if position < self.stages else (2 * self.stages - 1 - position, 1)
        return position % self.stages, position // self.stages

    def has_loss(self, stage: int, chunk: int) -> bool:
        return self.position(stage, chunk) == self.stages * self.virtual - 1

    def has_embedding(self, stage: int, chunk: int) -> bool:
        return self.position(stage, chunk) == 0

    def towards_next(self, chunk: int, backward: bool) -> bool:
        """Whether the tensor a pass of ``chunk`` hands on goes to the next stage (else the previous)."""
        forward_goes_next = not (self.v_shape and chunk == 1)
        return forward_goes_next != backward

    @staticmethod
    def of(stages: int, virtual: int, schedule: Optional[str]) -> "Placement":
        return Placement(stages, virtual, v_shape=schedule == "zbv")
