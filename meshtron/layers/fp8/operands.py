"""What the FP8 linears of every recipe share: the scaled matmul's output dtype and the zero-bubble hand-over
of the weight-gradient matmul."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def output_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The scaled matmul's output dtype: the activations' half-precision dtype, else fp32."""
    return input_dtype if input_dtype in (torch.bfloat16, torch.float16) else torch.float32


def weight_grad_now_or_deferred(deferral: Optional[tuple], weight_grad: Callable[[], torch.Tensor]
                                ) -> Optional[torch.Tensor]:
    """``weight_grad()`` now (no deferral), or handed to the zero-bubble store of ``deferral`` =
    (store, parameter) for its W pass (then None: the backward returns no weight gradient)."""
    if deferral is None:
        return weight_grad()
    store, param = deferral
    store.defer(param, weight_grad)
    return None
