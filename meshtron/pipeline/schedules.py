"""Forward/backward schedules over the micro-batches of one iteration.

No pipelining (one stage): each micro-batch runs forward then backward, and
gradients accumulate in the gradient buffers.

Pipelining: each rank runs its model chunks' forward (F) and backward (B) passes
in the order of one of Megatron-LM's schedules:

* 1F1B: rank ``r`` of ``PP`` runs ``min(PP - r - 1, M)`` warm-up forwards, then
  alternates one forward and one backward, then the remaining backwards. It holds
  at most ``PP - r`` micro-batches of activations. Bubble: ``(PP - 1) / M`` of the
  ideal time.
* interleaved 1F1B (``V`` virtual stages, ``M`` a multiple of ``PP``): forwards
  go through the chunks in groups of ``PP`` micro-batches (chunk 0 of micro-batches
  0..PP-1, chunk 1 of the same, ... then the next group), backwards in the mirrored
  chunk order; ``2 (PP - r - 1) + (V - 1) PP`` warm-up forwards. Rank ``r`` holds at
  most that plus one chunk-forwards of activations (each ``1/V`` of its layers).
  Bubble: ``(PP - 1) / (V M)``.
* ZB-H1 (``--pipeline-schedule zero-bubble-h1``, one chunk): each backward splits into B (input
  gradient) and W (weight gradients, :class:`WeightGrad`), W deferred to fill the bubbles; see
  :mod:`meshtron.pipeline.zero_bubble`. Bubble ``(PP - 1) / (3 M)`` when F, B and W last as long.
* ZBV (``--pipeline-schedule zbv``, two chunks in a V, :class:`Placement`): the same split over two chunks
  per rank, stage 0 holding the first and the last layers; the order comes from a greedy simulation
  (:func:`meshtron.pipeline.zero_bubble.zbv_orders`). Bubble ``(PP - 1) / (6 M)`` for ``M >= PP``, half of
  ZB-H1's, with at most ``2 PP`` chunk-forwards (PP micro-batches of a rank's layers) held on every rank.

Where the point-to-point exchanges go is derived from those orders by a lock-step
simulation (:func:`build_plans`): at each tick every free rank starts its next pass if
its input has arrived (a forward lasts one tick, a backward one or, for overlapped
exchanges, two), and a message sent at tick t is received by the matching exchange of
the receiver at the same tick. Every exchange therefore has its
counterparts at the same tick on the neighbours, and by induction over ticks the
batched exchanges can never wait on each other in a cycle (no deadlock, for NCCL's
blocking groups as for gloo).

The schedules never call a model themselves: the caller supplies a ``forward_step`` (Megatron-LM's
``forward_step_func`` contract, adapted) and, for data-parallel overlap, ``on_chunk_grads_ready``
(see :data:`ForwardStep` and :data:`GradsReady`). So this module knows neither a model's keyword
arguments nor its outputs, and a stage with other outputs or extra losses needs no change here.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.nn as nn

from meshtron.config import PIPELINE_SCHEDULES
from meshtron.pipeline.p2p import PipelineP2P, free_output
from meshtron.pipeline.partition import SPLIT_BACKWARD, check_micro_batches
# The plan's vocabulary lives in its own module, below this one and zero_bubble; re-exported for callers.
from meshtron.pipeline.plan import (Compute, Exchange, Placement, Step, Unit, WeightGrad,  # noqa: F401
                                    labelled_message)

if TYPE_CHECKING:
    from meshtron.pipeline.zero_bubble import WeightGradStore

MicroBatch = dict

#: ``forward_step(chunk, micro_batch, hidden) -> (output, loss_sum)``: run one micro-batch through one
#: model chunk (``hidden``: the previous stage's output, None on the first chunk of the first stage).
#: A chunk without the loss returns ``(output, None)``, the output sent to the next stage; the chunk
#: with the loss returns ``(None, loss_sum)``, the scalar whose backward the schedule runs and whose
#: detached values it sums.
ForwardStep = Callable[[nn.Module, MicroBatch, Optional[torch.Tensor]],
                       tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]

#: ``on_chunk_grads_ready(chunk)``: called right before the last backward pass of model chunk
#: ``chunk`` (an index into this rank's chunks), after which that chunk's gradients are final: where
#: its data-parallel reduction may start overlapping the remaining compute.
GradsReady = Callable[[int], None]


def _stage_tensor(output: Optional[torch.Tensor], loss_sum: Optional[torch.Tensor], has_loss: bool) -> torch.Tensor:
    """What a forward pass hands on: its loss sum on the loss stage, its output elsewhere."""
    wanted = loss_sum if has_loss else output
    if wanted is None:
        raise ValueError("forward_step must return (None, loss_sum) on the chunk that computes the loss and "
                         f"(output, None) on the others; this chunk {'has' if has_loss else 'has no'} loss")
    return wanted


def forward_backward_no_pipelining(model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch],
                                   forward_only: bool = False, on_chunk_grads_ready: Optional[GradsReady] = None,
                                   *, forward_step: ForwardStep) -> torch.Tensor:
    """Run every micro-batch forward (and backward); return the summed weighted loss (detached).

    ``on_chunk_grads_ready(0)`` runs just before the last micro-batch's backward pass, which
    is where data-parallel gradient reduction may start overlapping with compute.
    """
    model = model_chunks[0]
    total = None
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        with torch.set_grad_enabled(not forward_only):
            loss_sum = _stage_tensor(*forward_step(model, mb, None), has_loss=True)
        if not forward_only:
            if i == n - 1 and on_chunk_grads_ready is not None:
                on_chunk_grads_ready(0)
            loss_sum.backward()
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    return total


# ------------------------------------------------------------------------------------------- plans
#: ``--pipeline-schedule`` values (None: 1F1B, or interleaved 1F1B with virtual stages): the schema's one list.
SCHEDULES = PIPELINE_SCHEDULES


def one_f_one_b_order(stages: int, stage: int, num_micro_batches: int, forward_only: bool = False) -> list[Compute]:
    """The passes of one rank under 1F1B, in order."""
    m = num_micro_batches
    forwards = [Compute(False, 0, i) for i in range(m)]
    if forward_only:
        return forwards
    backwards = [Compute(True, 0, i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    order = forwards[:warmup]
    for i in range(m - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[m - warmup:]


def interleaved_unit(k: int, stages: int, virtual: int, backward: bool) -> Unit:
    """The (chunk, micro-batch) of a rank's k-th forward (or backward) pass under interleaving."""
    group, in_group = divmod(k, stages * virtual)
    chunk = in_group // stages
    if backward:
        chunk = virtual - 1 - chunk
    return chunk, group * stages + in_group % stages


def interleaved_warmup(stages: int, stage: int, virtual: int) -> int:
    """Warm-up forwards of a rank under interleaved 1F1B (before capping by the number of passes)."""
    return 2 * (stages - stage - 1) + (virtual - 1) * stages


def interleaved_order(stages: int, stage: int, virtual: int, num_micro_batches: int,
                      forward_only: bool = False) -> list[Compute]:
    """The passes of one rank under interleaved 1F1B, in order (``num_micro_batches`` % ``stages`` == 0)."""
    total = num_micro_batches * virtual
    forwards = [Compute(False, *interleaved_unit(k, stages, virtual, False)) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [Compute(True, *interleaved_unit(k, stages, virtual, True)) for k in range(total)]
    warmup = min(interleaved_warmup(stages, stage, virtual), total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup:]


def _message(stage: int, c: Compute, place: Placement) -> Optional[tuple[int, Compute]]:
    """(receiving stage, the pass that consumes it) of the tensor ``c`` produces, if any: the next model
    chunk's forward, or the previous model chunk's backward (on the same stage for a V's hand-over)."""
    if isinstance(c, WeightGrad):
        return None
    pos = place.position(stage, c.chunk)
    pos += -1 if c.backward else 1
    if pos < 0 or pos >= place.stages * place.virtual:
        return None  # the embedding's backward, or the loss
    dest, chunk = place.at(pos)
    return dest, Compute(c.backward, chunk, c.micro_batch)


def _needs_message(stage: int, c: Compute, place: Placement) -> bool:
    """Whether pass ``c`` consumes a tensor from another pass (input activation or output gradient)."""
    if isinstance(c, WeightGrad):
        return False
    if c.backward:
        return not place.has_loss(stage, c.chunk)
    return not place.has_embedding(stage, c.chunk)


def build_plans(orders: Sequence[Sequence[Compute]], virtual: int, backward_ticks: int = 1,
                v_shape: bool = False) -> list[list[Step]]:
    """Interleave every rank's passes with the exchanges that carry their tensors (lock-step simulation)."""
    return _simulate(orders, Placement(len(orders), virtual, v_shape), backward_ticks)[0]


#: Lock-step ticks of a backward pass when the exchanges are overlapped (--overlap-p2p-comm): a
#: backward does two matmuls (input and weight gradients) for every forward matmul, so it takes about
#: twice as long, and exchanges placed for those durations let every rank post its transfers in the
#: order the others need them (meshtron/pipeline/timing.py). Blocking exchanges keep the plans of
#: equal durations that were measured (docs/benchmarks.md).
OVERLAPPED_BACKWARD_TICKS = 2


def _simulate(orders: Sequence[Sequence[Compute]], place: Placement,
              backward_ticks: int = 1, forward_ticks: int = 1, weight_ticks: int = 1) -> tuple[list[list[Step]], int]:
    """Run every rank's passes in lock-step ticks (a forward takes ``forward_ticks``, a backward
    ``backward_ticks``, a W pass ``weight_ticks``); return the plans and the number of ticks.

    A pass starts at the first tick at which its rank is free and its input has arrived (was sent
    at an earlier tick); its output is sent at its last tick. Each rank's plan lists, tick by tick,
    the passes it starts, then its one batched exchange of that tick. An exchange at tick t only
    carries tensors of passes that started by tick t, so every rank reaches its tick-t exchange once
    the exchanges of earlier ticks have completed: no cycle of waiting exchanges.
    """
    stages = len(orders)
    position = [0] * stages
    free_at = [0] * stages
    arrived: dict[tuple[int, Compute], int] = {}  # (stage, consuming pass) -> tick its tensor was sent
    exchanges: dict[int, list[dict]] = {}  # tick -> each stage's exchange fields at that tick
    plans: list[list[Step]] = [[] for _ in range(stages)]
    tick = 0
    while any(position[s] < len(orders[s]) for s in range(stages)) or any(t > tick for t in exchanges):
        started = False
        for s in range(stages):
            if position[s] == len(orders[s]) or free_at[s] > tick:
                continue
            c = orders[s][position[s]]
            if _needs_message(s, c, place) and arrived.get((s, c), tick) >= tick:
                continue  # its input has not arrived yet: idle this tick
            plans[s].append(c)
            position[s] += 1
            started = True
            if isinstance(c, WeightGrad):
                duration = weight_ticks
            else:
                duration = backward_ticks if c.backward else forward_ticks
            end = tick + duration - 1
            free_at[s] = end + 1
            message = _message(s, c, place)
            if message is not None:
                dest, consumer = message
                arrived[(dest, consumer)] = end
                if dest != s:  # a V's hand-over on the last stage needs no message
                    send, recv = _exchange_fields(place.towards_next(c.chunk, c.backward), c.backward)
                    at = exchanges.setdefault(end, [{} for _ in range(stages)])
                    at[s][send] = c.unit
                    at[dest][recv] = consumer.unit
        if not started and all(f <= tick for f in free_at) and tick not in exchanges:
            stuck = {s: orders[s][position[s]] for s in range(stages) if position[s] < len(orders[s])}
            raise RuntimeError(f"pipeline schedule deadlocks: every rank waits ({stuck})")
        for s, fields in enumerate(exchanges.pop(tick, [])):
            if fields:
                plans[s].append(Exchange(**fields))
        tick += 1
    return plans, max([tick] + free_at)


def _exchange_fields(towards_next: bool, backward: bool) -> tuple[str, str]:
    """The :class:`Exchange` fields (sender's, receiver's) of a tensor travelling that way."""
    if towards_next:
        return ("send_next_grad", "recv_prev_grad") if backward else ("send_next", "recv_prev")
    return ("send_prev", "recv_next") if backward else ("send_prev_activation", "recv_next_activation")


def _orders(stages: int, virtual: int, num_micro_batches: int, forward_only: bool,
            schedule: Optional[str] = None) -> list[list[Step]]:
    schedule = _schedule_name(schedule, virtual)
    if schedule == "zero-bubble-h1":
        from meshtron.pipeline.zero_bubble import zero_bubble_h1_order

        return [zero_bubble_h1_order(stages, s, num_micro_batches, forward_only) for s in range(stages)]
    if schedule == "zbv":
        from meshtron.pipeline.zero_bubble import zbv_orders

        return zbv_orders(stages, num_micro_batches, forward_only)
    if virtual > 1:
        check_micro_batches(num_micro_batches, stages, virtual)
        return [interleaved_order(stages, s, virtual, num_micro_batches, forward_only) for s in range(stages)]
    return [one_f_one_b_order(stages, s, num_micro_batches, forward_only) for s in range(stages)]


def _schedule_name(schedule: Optional[str], virtual: int) -> str:
    """The schedule a name stands for (None: the one the virtual stages imply), checked against them."""
    if schedule is None:
        return "interleaved" if virtual > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if schedule == "zbv":
        if virtual != 2:
            raise ValueError(f"pipeline schedule 'zbv' runs two model chunks per rank, not {virtual}")
        return schedule
    if (schedule == "interleaved") != (virtual > 1):
        raise ValueError(f"pipeline schedule {schedule!r} with {virtual} model chunk(s) per rank: interleaved "
                         f"takes several, zbv two, the others one")
    return schedule


@functools.lru_cache(maxsize=64)
def pipeline_plans(stages: int, virtual: int, num_micro_batches: int, forward_only: bool,
                   backward_ticks: int = 1, schedule: Optional[str] = None) -> tuple[tuple[Step, ...], ...]:
    """Every rank's plan (passes and exchanges, in order) for one iteration.

    ``schedule``: a ``--pipeline-schedule`` value (None: 1F1B or interleaved, by ``virtual``). The
    zero-bubble plans are placed for passes of equal length (B and W each about a forward), whatever
    ``backward_ticks``.
    """
    name = _schedule_name(schedule, virtual)
    orders = _orders(stages, virtual, num_micro_batches, forward_only, name)
    plans = build_plans(orders, virtual, 1 if name in SPLIT_BACKWARD else backward_ticks, v_shape=name == "zbv")
    return tuple(tuple(plan) for plan in plans)


def simulated_bubble(stages: int, virtual: int, num_micro_batches: int, backward_ticks: int = 1,
                     schedule: Optional[str] = None) -> float:
    """Idle time over busy time of the lock-step simulation (a backward lasting ``backward_ticks``
    forwards, exchanges completing at once): ``(PP - 1) / (V * M)`` for 1F1B and interleaved.

    ``schedule``: a ``--pipeline-schedule`` value (None: by ``virtual``, as above). For
    ``zero-bubble-h1`` the backward's ``backward_ticks`` split evenly into B and W, and the bubble
    is ``(PP - 1) / ((1 + backward_ticks) M)``: a third of 1F1B's for ``backward_ticks=2``.
    """
    name = _schedule_name(schedule, virtual)
    orders = _orders(stages, virtual, num_micro_batches, False, name)
    place = Placement.of(stages, virtual, name)
    if name in SPLIT_BACKWARD:  # ticks doubled so that B and W are whole ticks: F 2, B and W backward_ticks each
        _, ticks = _simulate(orders, place, backward_ticks, forward_ticks=2, weight_ticks=backward_ticks)
        busy = 2 * (1 + backward_ticks) * virtual * num_micro_batches
    else:
        _, ticks = _simulate(orders, place, backward_ticks)
        busy = (1 + backward_ticks) * virtual * num_micro_batches
    return (ticks - busy) / busy


def max_in_flight(plan: Sequence[Step]) -> int:
    """Most (chunk, micro-batch) forwards whose backward has not run yet, over a plan (with W
    passes: whose W has not run yet, as a micro-batch's activations live until its W)."""
    split = any(isinstance(step, WeightGrad) for step in plan)
    held = peak = 0
    for step in plan:
        if isinstance(step, Compute) and not step.backward:
            held += 1
            peak = max(peak, held)
        elif isinstance(step, WeightGrad) or (isinstance(step, Compute) and not split):
            held -= 1
    return peak


# ------------------------------------------------------------------------------------------- execution
@dataclass
class ScheduleStats:
    """What a pipelined iteration did on this rank (for tests and diagnostics)."""

    max_in_flight: int = 0  # most micro-batch chunks holding activations at once
    forwards: int = 0
    backwards: int = 0
    exchanges: int = 0
    weight_grads: int = 0  # W passes (zero-bubble schedules)
    deferred_gemms: int = 0  # weight-gradient GEMMs those W passes ran


class _Transfer:
    """The works of one posted exchange, waited for at most once (waiting twice on a gloo work
    waits for a second message that never comes)."""

    def __init__(self, works: list) -> None:
        self.works, self.done = works, False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True

    def completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)


class _PendingTransfers:
    """Exchanges posted without waiting (``--overlap-p2p-comm``): a received tensor is waited for
    right before the pass that consumes it, and a sent output is released once its exchange has
    completed (on GPUs checked without blocking at every exchange; everything is waited for at the
    end of the iteration)."""

    def __init__(self, poll: bool) -> None:
        self.poll = poll
        self.receives: dict[tuple[str, Unit], _Transfer] = {}  # ("input" | "grad", unit) -> its exchange
        # (exchange, the sent tensors, kept alive until the transfer is done, and the output to free then)
        self.sends: list[tuple[_Transfer, tuple, Optional[torch.Tensor]]] = []

    def add(self, works: list, step: "Exchange", sent: tuple, output_to_free: Optional[torch.Tensor]) -> None:
        transfer = _Transfer(works)
        for received in step.receives():
            self.receives[received] = transfer
        if sent:
            self.sends.append((transfer, sent, output_to_free))

    def wait_for(self, kind: str, unit: Unit) -> None:
        transfer = self.receives.pop((kind, unit), None)
        if transfer is not None:
            transfer.wait()

    def release_completed(self) -> None:
        """Free the outputs whose transfers have finished. Only NCCL's works answer ``is_completed``
        from the device's own record (a CUDA event); elsewhere the outputs wait for :meth:`finish`."""
        if not self.poll:
            return
        still = []
        for entry in self.sends:
            transfer, _, output = entry
            if transfer.completed():
                if output is not None:
                    free_output(output)
            else:
                still.append(entry)
        self.sends = still

    def finish(self) -> None:
        for transfer, _, output in self.sends:
            transfer.wait()
            if output is not None:
                free_output(output)
        self.sends = []
        for transfer in self.receives.values():
            transfer.wait()
        self.receives = {}


def run_plan(plan: Sequence[Step], model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch],
             p2p: PipelineP2P, forward_step: ForwardStep, forward_only: bool = False,
             on_chunk_grads_ready: Optional[GradsReady] = None,
             stats: Optional[ScheduleStats] = None, overlap_p2p: bool = False,
             wgrad_store: Optional[WeightGradStore] = None, v_shape: bool = False) -> torch.Tensor:
    """Execute one rank's plan; return its summed weighted loss (zero on ranks without the loss).

    ``overlap_p2p``: post each exchange without waiting; wait for a received tensor only right
    before the pass that consumes it (so a rank never stalls for a transfer that it does not need yet).

    ``wgrad_store`` (plans with W passes): each B runs collecting into it, each W computes that
    micro-batch's deferred weight gradients. ``on_chunk_grads_ready(chunk)`` still comes right
    before the chunk's last B, when its other parameters receive their last gradient; the W passes
    that follow (those of the micro-batches whose W the rank kept in hand) run their GEMMs at once
    but accumulate the per-parameter sums only at the chunk's last W, so every parameter receives
    exactly one gradient after the reduction was armed, and a bucket starts only once complete
    (unless the store's ``hold_after_last_backward`` is off: no reduction is armed then).

    ``v_shape``: the chunks sit in a V (:class:`Placement`, ZBV): the last stage hands its first chunk's
    output to its second chunk, and that chunk's input gradient back, without a message.
    """
    stages, stage, virtual = p2p.stages, p2p.stage, len(model_chunks)
    place = Placement(stages, virtual, v_shape)
    inputs: dict[Unit, torch.Tensor] = {}  # received stage inputs, kept for their gradient
    outputs: dict[Unit, torch.Tensor] = {}  # stage outputs (or loss sums) awaiting their backward
    output_grads: dict[Unit, torch.Tensor] = {}
    input_grads: dict[Unit, torch.Tensor] = {}
    total: Optional[torch.Tensor] = None
    # Each chunk's gradients are final after its own last backward: the data-parallel reduction of that
    # chunk can start then, not only at the very end (with one chunk, that is this rank's last backward).
    chunk_last_backward, chunk_last_weight = {}, {}
    for i, s in enumerate(plan):
        if isinstance(s, Compute) and s.backward:
            chunk_last_backward[s.chunk] = i
        elif isinstance(s, WeightGrad):
            chunk_last_weight[s.chunk] = i
    if chunk_last_weight and wgrad_store is None:
        raise ValueError("a plan with W passes needs the weight-gradient store its B passes defer into")
    awaiting_w: set[Unit] = set()  # forwarded micro-batches whose activations live until their W
    stats = stats if stats is not None else ScheduleStats()
    pending = _PendingTransfers(poll=p2p.device.type == "cuda") if overlap_p2p else None
    for index, step in enumerate(plan):
        if isinstance(step, WeightGrad):
            hold = (wgrad_store.hold_after_last_backward and on_chunk_grads_ready is not None
                    and index > chunk_last_backward[step.chunk])
            stats.deferred_gemms += wgrad_store.compute(step.unit, hold=hold)
            if hold and index == chunk_last_weight[step.chunk]:
                wgrad_store.accumulate_held(step.chunk)
            awaiting_w.discard(step.unit)
            stats.weight_grads += 1
            continue
        if isinstance(step, Exchange):
            # By direction: an activation or (ZBV's second chunk) a gradient to the next stage, and so on.
            sent_output = step.send_next if step.send_next is not None else step.send_prev_activation
            to_next = (outputs[step.send_next] if step.send_next is not None
                       else input_grads.pop(step.send_next_grad) if step.send_next_grad is not None else None)
            to_prev = (input_grads.pop(step.send_prev) if step.send_prev is not None
                       else outputs[step.send_prev_activation] if step.send_prev_activation is not None else None)
            want_prev = step.recv_prev is not None or step.recv_prev_grad is not None
            want_next = step.recv_next is not None or step.recv_next_activation is not None
            units = None
            if p2p.ledger is not None:  # what each message is, for the hang report
                units = {"send_next": labelled_message(step.send_next, "activation", step.send_next_grad, "gradient"),
                         "recv_prev": labelled_message(step.recv_prev, "activation", step.recv_prev_grad, "gradient"),
                         "send_prev": labelled_message(step.send_prev, "gradient", step.send_prev_activation, "activation"),
                         "recv_next": labelled_message(step.recv_next, "gradient", step.recv_next_activation, "activation")}
            if pending is None:
                from_prev, from_next = p2p.exchange(to_next, to_prev, want_prev, want_next, units=units)
            else:
                pending.release_completed()
                from_prev, from_next, works = p2p.exchange(to_next, to_prev, want_prev, want_next, wait=False,
                                                           units=units)
                pending.add(works, step, tuple(t for t in (to_next, to_prev) if t is not None),
                            None if forward_only or sent_output is None else outputs[sent_output])
            stats.exchanges += 1
            if sent_output is not None:
                if forward_only:
                    del outputs[sent_output]
                elif pending is None:
                    free_output(outputs[sent_output])
            if step.recv_prev is not None:
                inputs[step.recv_prev] = from_prev.requires_grad_(not forward_only)
            if step.recv_prev_grad is not None:
                output_grads[step.recv_prev_grad] = from_prev
            if step.recv_next is not None:
                output_grads[step.recv_next] = from_next
            if step.recv_next_activation is not None:
                inputs[step.recv_next_activation] = from_next.requires_grad_(not forward_only)
            continue
        unit, model = step.unit, model_chunks[step.chunk]
        if pending is not None:
            pending.wait_for("grad" if step.backward else "input", unit)
        if not step.backward:
            is_loss = place.has_loss(stage, step.chunk)
            with torch.set_grad_enabled(not forward_only):
                out = _stage_tensor(*forward_step(model, micro_batches[step.micro_batch], inputs.get(unit)),
                                    has_loss=is_loss)
            stats.forwards += 1
            if is_loss:
                total = out.detach() if total is None else total + out.detach()
            handed_over = _local_consumer(stage, step, place)
            if handed_over is not None:  # a V's turn on the last stage: the next chunk's input, no message
                inputs[handed_over.unit] = out if forward_only else out.detach().requires_grad_()
            if forward_only:
                inputs.pop(unit, None)
                if not is_loss and handed_over is None:
                    outputs[unit] = out  # until it is sent
                continue
            outputs[unit] = out
            if wgrad_store is not None:
                awaiting_w.add(unit)
            stats.max_in_flight = max(stats.max_in_flight, len(outputs) + len(awaiting_w - outputs.keys()))
        else:
            if on_chunk_grads_ready is not None and index == chunk_last_backward[step.chunk]:
                on_chunk_grads_ready(step.chunk)
            out = outputs.pop(unit)
            with wgrad_store.collecting(unit) if wgrad_store is not None else contextlib.nullcontext():
                torch.autograd.backward(out, grad_tensors=output_grads.pop(unit, None))
            x = inputs.pop(unit, None)
            if x is not None:  # a stage whose output ignores its input still owes the previous one a gradient
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
                handed_back = _local_consumer(stage, step, place)
                if handed_back is not None:  # back down the V's turn: the previous chunk's output gradient
                    output_grads[handed_back.unit] = grad
                else:
                    input_grads[unit] = grad
            stats.backwards += 1
    if pending is not None:
        pending.finish()
    if total is None:
        device = next(model_chunks[0].parameters()).device
        total = torch.zeros((), dtype=torch.float32, device=device)
    return total


def _local_consumer(stage: int, c: Compute, place: Placement) -> Optional[Compute]:
    """The pass on this same stage that consumes what ``c`` produces (a V's turn), else None."""
    message = _message(stage, c, place)
    return message[1] if message is not None and message[0] == stage else None


def forward_backward_pipelining(model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch],
                                forward_only: bool = False, on_chunk_grads_ready: Optional[GradsReady] = None, *,
                                forward_step: ForwardStep, p2p: PipelineP2P, stats: Optional[ScheduleStats] = None,
                                overlap_p2p: bool = False, schedule: Optional[str] = None,
                                wgrad_store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """1F1B (one model chunk per rank), interleaved 1F1B (several) or ZB-H1 over ``micro_batches``.

    Returns the summed weighted loss on the last stage, zero elsewhere. ``on_chunk_grads_ready(chunk)``
    runs once per model chunk, right before that chunk's last backward, after which that chunk's
    gradients are final (``GradientSync.start_overlap`` takes that argument; with W passes see
    :func:`run_plan`). ``overlap_p2p`` (``--overlap-p2p-comm``): see :func:`run_plan`.
    ``schedule``: a ``--pipeline-schedule`` value (None: by the number of chunks); ``zero-bubble-h1``
    needs ``wgrad_store``, which this call gives to the chunks' linear layers and enables for a
    training iteration.
    """
    name = _schedule_name(schedule, len(model_chunks))
    plan = pipeline_plans(p2p.stages, len(model_chunks), len(micro_batches), forward_only,
                          OVERLAPPED_BACKWARD_TICKS if overlap_p2p else 1, name)[p2p.stage]
    v_shape = name == "zbv"
    if name not in SPLIT_BACKWARD:
        return run_plan(plan, model_chunks, micro_batches, p2p, forward_step, forward_only, on_chunk_grads_ready,
                        stats, overlap_p2p)
    from meshtron.pipeline.zero_bubble import attach_weight_grad_store

    if wgrad_store is None:
        raise ValueError("the zero-bubble schedule needs a WeightGradStore")
    attach_weight_grad_store(model_chunks, wgrad_store)
    wgrad_store.enabled = not forward_only
    try:
        total = run_plan(plan, model_chunks, micro_batches, p2p, forward_step, forward_only, on_chunk_grads_ready,
                         stats, overlap_p2p, wgrad_store if not forward_only else None, v_shape)
    except BaseException:
        wgrad_store.discard()  # a failed iteration's deferred GEMMs must not reach the next one
        raise
    finally:
        wgrad_store.enabled = False
    if wgrad_store.pending_units():
        raise RuntimeError(f"the zero-bubble plan left the W passes of {wgrad_store.pending_units()} undone")
    return total
