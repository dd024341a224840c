"""The ZB-H1 zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

A backward pass splits into B, the gradient with respect to the stage's input (on the critical
path: it goes to the previous stage at once), and W, the weight gradients (needed only by the
optimizer step, so it can wait and fill what would be idle time).

Order of rank ``r`` of ``PP`` (one model chunk): the forwards and B passes in 1F1B's order
(``min(PP - r - 1, M)`` warm-up forwards, then one forward and one B, then the remaining B), and
after each B the oldest pending W while more than ``r`` are pending; the last ``r`` W come at the
end. So rank ``r`` holds at most ``PP`` micro-batches of activations (a micro-batch's are freed by
its W), the peak of 1F1B's first stage, and the last stage defers the ``PP - 1`` W that fill the
time in which the last gradients travel back. With forward, B and W of equal length the idle time
per rank is ``PP - 1`` such passes instead of 1F1B's ``3 (PP - 1)``: the bubble is
``(PP - 1) / (3 M)``, a third of 1F1B's (tests/pipeline/test_zero_bubble.py checks it).

The W work comes from :class:`WeightGradStore`: during a B pass, the parallel linear layers of
:mod:`meshtron.layers.linear` hand it their weight-gradient GEMMs instead of running them; the W pass
of that micro-batch runs them and accumulates the results through each parameter's usual gradient
path (its hooks, hence the fp32 gradient buffers). Every other parameter (norms, biases,
embeddings, the output layer, routers, grouped experts) gets its gradient in B.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from meshtron.pipeline.plan import Compute, Unit, WeightGrad

#: ``--pipeline-schedule`` value of this schedule.
ZERO_BUBBLE_H1 = "zero-bubble-h1"


def zero_bubble_h1_order(stages: int, stage: int, num_micro_batches: int,
                         forward_only: bool = False) -> list:
    """The passes of one rank under ZB-H1, in order: forwards and B (:class:`Compute`) and W
    (:class:`WeightGrad`). Forward-only runs are 1F1B's forwards."""
    m = num_micro_batches
    forwards = [Compute(False, 0, i) for i in range(m)]
    if forward_only:
        return forwards
    warmup = min(stages - stage - 1, m)
    order: list = forwards[:warmup]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        order.append(Compute(True, 0, i))
        pending.append(i)
        while len(pending) > stage:  # rank r keeps r W in hand, for the tail of the iteration
            order.append(WeightGrad(0, pending.popleft()))

    for i in range(m - warmup):
        order.append(forwards[warmup + i])
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [WeightGrad(0, i) for i in pending]
    return order


#: ``--pipeline-schedule`` value of the V-shaped zero-bubble schedule.
ZBV = "zbv"


def zbv_orders(stages: int, num_micro_batches: int, forward_only: bool = False) -> list[list]:
    """Every rank's passes under ZBV (two chunks per rank in a V: stage ``r`` holds model chunks ``r`` and
    ``2 PP - 1 - r``; Qi et al., "Pipeline Parallelism with Controllable Memory", 2024), in order.

    The order comes from a greedy simulation in which F, B and W last one tick each and a tensor handed on
    at the end of a tick can be used at the next: at each tick every rank runs, of the passes whose inputs
    are there, the oldest micro-batch's B (the critical path: input gradients travel on at once), else a
    forward (chunk 1's first, whose backward comes sooner) unless the rank already holds ``2 PP``
    chunk-forwards of activations (``PP`` micro-batches of its layers: 1F1B's first stage), else the
    oldest pending W. What it defers into W fills the ticks in which a rank would wait; the last W run at
    the end. Forward-only runs (evaluation) take the same rule without B and W.
    """
    m, p = num_micro_batches, stages
    cap = 2 * p
    done: dict[tuple, int] = {}  # (stage, kind, chunk, micro-batch) -> tick it ended
    orders: list[list] = [[] for _ in range(p)]
    next_forward = [[0, 0] for _ in range(p)]  # per stage and chunk: the next micro-batch to forward
    next_backward = [[0, 0] for _ in range(p)]
    pending_w: list[deque] = [deque() for _ in range(p)]
    held = [0] * p
    total = p * 2 * m * (1 if forward_only else 3)
    tick = 0

    def ready(stage: int, kind: str, chunk: int, mb: int) -> bool:
        if kind == "F":
            if chunk == 0:
                source = None if stage == 0 else (stage - 1, "F", 0, mb)
            else:
                source = (stage, "F", 0, mb) if stage == p - 1 else (stage + 1, "F", 1, mb)
        else:
            if chunk == 1:
                source = (stage, "F", 1, mb) if stage == 0 else (stage - 1, "B", 1, mb)
            else:
                source = (stage, "B", 1, mb) if stage == p - 1 else (stage + 1, "B", 0, mb)
        return source is None or done.get(source, tick) < tick

    while len(done) < total:
        ran = []
        for stage in range(p):
            choice = None
            if not forward_only:
                candidates = [(next_backward[stage][c], -c, c) for c in (0, 1)
                              if next_backward[stage][c] < next_forward[stage][c]
                              and ready(stage, "B", c, next_backward[stage][c])]
                if candidates:
                    mb, _, c = min(candidates)
                    choice = ("B", c, mb)
            if choice is None and (forward_only or held[stage] < cap):
                for c in (1, 0):
                    mb = next_forward[stage][c]
                    if mb < m and ready(stage, "F", c, mb):
                        choice = ("F", c, mb)
                        break
            if choice is None and pending_w[stage]:
                choice = ("W",) + pending_w[stage].popleft()
            if choice is not None:
                ran.append((stage, choice))
        if not ran:
            raise RuntimeError(f"the ZBV order for {p} stages and {m} micro-batches deadlocked at tick {tick}")
        for stage, (kind, c, mb) in ran:
            done[(stage, kind, c, mb)] = tick
            if kind == "F":
                next_forward[stage][c] += 1
                held[stage] += 0 if forward_only else 1
                orders[stage].append(Compute(False, c, mb))
            elif kind == "B":
                next_backward[stage][c] += 1
                pending_w[stage].append((c, mb))
                orders[stage].append(Compute(True, c, mb))
            else:
                held[stage] -= 1
                orders[stage].append(WeightGrad(c, mb))
        tick += 1
    return orders


class WeightGradStore:
    """The weight-gradient GEMMs that B passes deferred, by micro-batch, until their W pass.

    The linear layers call :meth:`defer` from their backward; the schedule wraps each B in
    :meth:`collecting` and runs :meth:`compute` in each W. ``enabled`` (set by the schedule for a
    training iteration) is what makes a layer's forward choose the deferring matmul.

    ``hold_after_last_backward``: whether the W passes that follow a chunk's last B hold their sums
    until the chunk's last W (needed when ``on_chunk_grads_ready`` arms an overlapped gradient
    reduction, ``--overlap-grad-reduce``; see :func:`~meshtron.pipeline.schedules.run_plan`). Without
    it every W accumulates at once, in the parameter's dtype, as a plain backward would.
    """

    def __init__(self, hold_after_last_backward: bool = True) -> None:
        self.hold_after_last_backward = hold_after_last_backward
        self.enabled = False
        self._unit: Optional[Unit] = None
        self._deferred: dict[Unit, list[tuple[nn.Parameter, Callable[[], torch.Tensor]]]] = {}
        # model chunk -> id(param) -> (param, fp32 sum): each chunk's reduction is armed at its own last B
        self._held: dict[int, dict[int, tuple[nn.Parameter, torch.Tensor]]] = {}

    def defer(self, param: nn.Parameter, weight_grad: Callable[[], torch.Tensor]) -> None:
        """Keep ``weight_grad()`` (the GEMM producing ``param``'s gradient) for the current B's W."""
        if self._unit is None:
            raise RuntimeError("a linear layer deferred its weight gradient outside a zero-bubble B pass: a "
                               "backward ran over a forward of an enabled WeightGradStore without the schedule")
        self._deferred[self._unit].append((param, weight_grad))

    @contextlib.contextmanager
    def collecting(self, unit: Unit) -> Iterator[None]:
        """Within: the B pass of ``unit``, whose deferred GEMMs are kept under that unit."""
        self._unit = unit
        self._deferred.setdefault(unit, [])
        try:
            yield
        finally:
            self._unit = None

    def compute(self, unit: Unit, hold: bool = False) -> int:
        """The W pass of ``unit``: run its GEMMs and accumulate the gradients (summed per parameter).

        ``hold``: keep the sums (in fp32) for :meth:`accumulate_held` instead, so that each parameter
        receives one accumulation after the gradient reduction was armed (see :func:`run_plan`).
        Returns the number of GEMMs run.
        """
        entries = self._deferred.pop(unit, [])
        sums: dict[int, tuple[nn.Parameter, torch.Tensor]] = self._held.setdefault(unit[0], {}) if hold else {}
        for param, weight_grad in entries:
            grad = weight_grad()
            key = id(param)
            if key in sums:
                sums[key][1].add_(grad)
            else:
                sums[key] = (param, grad.float() if hold else grad)
        if not hold:
            _accumulate(sums)
        return len(entries)

    def accumulate_held(self, chunk: int = 0) -> None:
        """Accumulate the sums that :meth:`compute` held for model chunk ``chunk``, once per parameter."""
        _accumulate(self._held.pop(chunk, {}))

    def discard(self) -> None:
        """Drop every deferred GEMM and held sum (after a failed iteration)."""
        self._deferred, self._held, self._unit = {}, {}, None

    def pending_units(self) -> list[Unit]:
        """Micro-batches whose B ran and whose W has not (empty after a complete iteration)."""
        return list(self._deferred)


def _accumulate(sums: dict[int, tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Add each gradient into its parameter as autograd would (``.grad`` and its post-accumulate
    hooks: the gradient buffers and overlapped reduction see the same events as in a plain backward)."""
    if sums:
        params = [p for p, _ in sums.values()]
        torch.autograd.backward(params, [g.to(p.dtype) for p, g in sums.values()])


def attach_weight_grad_store(model_chunks: Sequence[nn.Module], store: Optional[WeightGradStore]) -> int:
    """Give ``store`` to every layer of ``model_chunks`` that can defer its weight gradient (the
    modules with a ``wgrad_store`` attribute: the column- and row-parallel linears); returns how many."""
    count = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if hasattr(module, "wgrad_store"):
                module.wgrad_store = store
                count += 1
    return count
