"""Forward/backward schedules over the micro-batches of one iteration.

With one pipeline stage there is nothing to schedule: each micro-batch runs
forward then backward, and gradients accumulate in the gradient buffers.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

MicroBatch = dict


def run_stage(model: nn.Module, mb: MicroBatch, hidden: Optional[torch.Tensor] = None):
    """Forward one micro-batch through a model stage."""
    return model(tokens=mb.get("tokens"), position_ids=mb.get("position_ids"), labels=mb.get("labels"),
                 loss_weight=mb.get("loss_weight"), document_ids=mb.get("document_ids"), hidden=hidden)


def forward_backward_no_pipelining(model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch],
                                   forward_only: bool = False,
                                   before_last_backward: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Run every micro-batch forward (and backward); return the summed weighted loss (detached).

    ``before_last_backward`` runs just before the last micro-batch's backward pass, which
    is where data-parallel gradient reduction may start overlapping with compute.
    """
    model = model_chunks[0]
    total = None
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        with torch.set_grad_enabled(not forward_only):
            loss_sum, _ = run_stage(model, mb)
        if not forward_only:
            if i == n - 1 and before_last_backward is not None:
                before_last_backward()
            loss_sum.backward()
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    return total
