"""Overlapped weight all-gathers that land only when waited for (CPU tests of ``--overlap-param-gather``).

A real overlapped gather usually lands before the forward reads the weights, so a weight read before
its bucket's wait (a module called around its forward pre-hooks) would go unnoticed on most runs. With
:func:`land_gathers_at_wait` the gathered values arrive at the wait and not before: such a read sees last
step's weights on every run, and the equivalence test fails.
"""

from __future__ import annotations

import torch


class _LateGather:
    def __init__(self, gather, output: torch.Tensor, input: torch.Tensor, group):
        self.output, self.landing = output, torch.empty_like(output)
        self.work = gather(self.landing, input.clone(), group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        self.output.copy_(self.landing)


def land_gathers_at_wait() -> None:
    """In this process, make the weight buffer's overlapped all-gathers land at their wait."""
    import meshtron.optim.param_buffer as param_buffer

    real = param_buffer.all_gather_single
    if getattr(real, "lands_at_wait", False):
        return

    def gather(output, input, group, async_op=False):
        return _LateGather(real, output, input, group) if async_op else real(output, input, group)

    gather.lands_at_wait = True
    param_buffer.all_gather_single = gather
