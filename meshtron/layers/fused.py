"""Element-wise helpers compiled into one kernel each where that pays (CUDA), plain functions elsewhere.

Some element-wise work runs outside the compiled transformer layers: inside custom autograd functions
(the fused loss) or in code the compiler skips because its tensors' sizes change every step (the MoE
experts). :func:`compiled_on_cuda` compiles such a pure function once per input shape, so that its
chain of element-wise operations is one kernel that reads each input once, instead of one kernel per
operation with every intermediate written and read back.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiled_on_cuda(fn: F, dynamic: Optional[bool] = False) -> F:
    """``fn`` through ``torch.compile`` when its first argument is a CUDA tensor; ``fn`` itself elsewhere.

    ``dynamic=False`` (static shapes, compiled once per shape): with symbolic sizes every element's row and
    column index can cost a 64-bit division (the fused loss's gradient kernel ran at a fifth of memory
    bandwidth that way on an H200); for tensors whose shapes are fixed for a run (a micro-batch's chunks).
    ``dynamic=None`` (torch.compile's automatic dynamic shapes): the first shape compiles static, a second
    one compiles again with the sizes that changed symbolic, and no further shape recompiles; for a row
    count that may change every step. The compiled function is made on first use (importing compiles
    nothing).
    """
    compiled: list[Callable] = []

    def call(*args):
        if not args[0].is_cuda:
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=dynamic))
        return compiled[0](*args)

    call.__doc__ = fn.__doc__
    call.__name__ = getattr(fn, "__name__", "compiled")
    return call  # type: ignore[return-value]
