"""The Triton AdamW's argument checks (they run before any kernel, so also on CPU)."""

import pytest
import torch

from meshtron.optim.fused_adamw import adamw_step_


def test_refuses_strided_or_mismatched_tensors():
    master = torch.zeros(8, 4)
    moments = (torch.zeros(8, 4), torch.zeros(8, 4))
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="contiguous and of one size"):
        adamw_step_(master, torch.zeros(4, 8).t(), *moments, None, **kwargs)
    with pytest.raises(ValueError, match="contiguous and of one size"):
        adamw_step_(master, torch.zeros(8, 4), *moments, torch.zeros(16, dtype=torch.bfloat16), **kwargs)
