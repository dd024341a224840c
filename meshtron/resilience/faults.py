"""Fault injection (``--inject-fault KIND:RANK:ITERATION[:ARG]``): drills for the recovery setup.

Each spec makes one global rank misbehave at one iteration, so that the hang detector,
the NaN re-run, the weight-hash check and the automatic restart can be exercised on a
real multi-process run:

==================  ====================================================================
``crash``           the rank's process dies at once (SIGKILL) when ITERATION starts
``hang``            the rank blocks forever right before ITERATION's first collective
``hang-send``       the rank blocks forever right before its first pipeline send of ITERATION
``slow``            the rank sleeps ARG seconds in every iteration from ITERATION on
``nan``             the rank's loss and gradients of ITERATION are NaN once; a re-run of
                    the iteration is clean
``nan-persistent``  every execution of ITERATION is NaN on the rank
``bitflip``         after ITERATION's optimizer step one bit (ARG, default 22, the top
                    mantissa bit of fp32) of one element of one parameter flips, silently
==================  ====================================================================

A fault fires in the first attempt of a job only: an attempt started by an automatic
restart (see :mod:`meshtron.resilience.restart`) runs clean, so that a drill shows the
recovery rather than the same fault again. ``crash``, ``hang``, ``nan`` and ``bitflip``
fire once; ``nan-persistent`` fires on every re-run of its iteration within the attempt.

Without any ``--inject-fault`` :meth:`FaultInjector.from_config` returns None and the
trainer's hooks are skipped by one ``is not None`` test.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable, Optional, Sequence

import torch

from meshtron.resilience.fault_specs import (  # noqa: F401  (re-exported: the spec API lives with the injector)
    FAULT_KINDS, FLAG, FORM, FaultSpec, check_faults, parse_fault, parse_faults,
)
from meshtron.resilience.restart import restart_count

#: Bit flipped by ``bitflip`` without ARG: the top mantissa bit of an fp32 value (finite, visible in a hash).
DEFAULT_FLIP_BIT = 22


def _block_forever() -> None:
    """Stay stopped like a rank stuck in a collective (signals still end the process)."""
    while True:
        time.sleep(3600)


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``index`` (of the flattened tensor) in place."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    bit %= 8 * tensor.element_size()  # 22 (fp32's top mantissa bit) is bf16's top mantissa bit, 6
    word = tensor.detach().view(-1)[index:index + 1].view(ints)
    mask = (1 << bit) if bit < 8 * tensor.element_size() - 1 else -(1 << bit)  # the sign bit of a signed int
    word.bitwise_xor_(torch.tensor(mask, dtype=ints, device=tensor.device))


class FaultInjector:
    """The faults of this rank, called from the trainer's hooks. Build it with :meth:`from_config`."""

    def __init__(self, faults: Sequence[FaultSpec], rank: int, attempt: int = 0):
        self.rank = rank
        self.attempt = attempt
        self.faults = tuple(f for f in faults if f.rank == rank) if attempt == 0 else ()
        self._fired: set[FaultSpec] = set()
        #: What ``bitflip`` changed, for tests and drills: (parameter index, element, bit), or None.
        self.last_flip: Optional[tuple[int, int, int]] = None

    @classmethod
    def from_config(cls, cfg, rank: int) -> Optional["FaultInjector"]:
        """This rank's injector, or None when ``--inject-fault`` is not given (the hooks cost nothing)."""
        texts = getattr(cfg.train, "inject_fault", None) or []
        if not texts:
            return None
        return cls(parse_faults(texts), rank, restart_count())

    @property
    def active(self) -> bool:
        """Whether any fault may still fire on this rank."""
        return bool(self.faults)

    def _due(self, kind: str, iteration: int, once: bool = True) -> Optional[FaultSpec]:
        for spec in self.faults:
            if spec.kind == kind and spec.iteration == iteration and not (once and spec in self._fired):
                self._fired.add(spec)
                return spec
        return None

    # -- hooks, in the order an iteration calls them --------------------------------------------

    def at_iteration_start(self, iteration: int) -> None:
        """``crash``: die at once, as SIGKILL would. ``slow``: sleep ARG seconds from ITERATION on."""
        for spec in self.faults:
            if spec.kind == "slow" and iteration >= spec.iteration:
                time.sleep(float(spec.arg or 0.0))
        if self._due("crash", iteration) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def hang_point(self, iteration: int) -> None:
        """``hang``: block forever; call right before the iteration's first collective."""
        if self._due("hang", iteration) is not None:
            _block_forever()

    def hang_before_send(self, iteration: int) -> None:
        """``hang-send``: block forever; call right before each pipeline send is posted."""
        if self._due("hang-send", iteration) is not None:
            _block_forever()

    def _nan_due(self, iteration: int, attempt: int) -> bool:
        persistent = any(s.kind == "nan-persistent" and s.iteration == iteration for s in self.faults)
        transient = attempt == 0 and any(s.kind == "nan" and s.iteration == iteration for s in self.faults)
        return persistent or transient

    def corrupt_loss(self, iteration: int, attempt: int, loss: torch.Tensor) -> torch.Tensor:
        """``nan``/``nan-persistent``: the loss as NaN (``attempt`` counts re-runs of the iteration, from 0)."""
        if not self._nan_due(iteration, attempt):
            return loss
        return loss + float("nan")

    def corrupt_grads(self, iteration: int, attempt: int, grads: Iterable[torch.Tensor]) -> None:
        """``nan``/``nan-persistent``: fill this rank's gradient tensors (e.g. the grad buffer's) with NaN."""
        if not self._nan_due(iteration, attempt):
            return
        for g in grads:
            if g.is_floating_point():
                g.fill_(float("nan"))

    def after_optimizer_step(self, iteration: int, params: Sequence[torch.Tensor]) -> None:
        """``bitflip``: flip one bit of one element of the first non-empty parameter, in place, silently."""
        spec = self._due("bitflip", iteration)
        if spec is None:
            return
        bit = DEFAULT_FLIP_BIT if spec.arg is None else int(spec.arg)
        for i, p in enumerate(params):
            if p.numel() > 0 and p.is_floating_point():
                element = p.numel() // 2
                with torch.no_grad():
                    flip_bit(p, element, bit)
                self.last_flip = (i, element, bit)
                return
