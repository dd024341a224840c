"""The CUDA caching allocator's setting that meshtron starts with unless the user chose their own.

Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) let the allocator grow a segment in
place instead of reserving a new block of the requested size, so that memory freed by one size of tensor can
serve the next: the reserved peak comes closer to the allocated one. It matters more since the gradient buffer
is freed between steps (its buckets are re-allocated every iteration) and on fine-grained MoE, whose dispatch
buffers change size every step. torchtitan starts its runs with the same setting.

The allocator reads the variable once, when the process first uses CUDA, so ``meshtron``'s entry point sets it
before anything else runs; processes that ``meshtron train --nproc-per-node`` or torchrun start inherit it or set
it themselves. A user who sets ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) to anything, for example
``expandable_segments:False``, keeps exactly that.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

EXPANDABLE_SEGMENTS = "expandable_segments:True"
ALLOCATOR_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def default_to_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where the user set no allocator variable and
    CUDA is not in use yet in this process; True when it was set here."""
    if any(name in environ for name in ALLOCATOR_ENV_VARS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # too late: the allocator has read its settings
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True
