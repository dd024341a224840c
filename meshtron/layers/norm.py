"""RMSNorm and LayerNorm whose parameters are replicated over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.parallel.sharding import ShardSpec, new_param, whole


class Norm(nn.Module):
    """RMSNorm (weight only) or LayerNorm (weight and bias) over the last dimension.

    With sequence parallelism each TP rank sees only its sequence shard, so the
    gradients of the (replicated) parameters are summed over TP (``grad_sync="tp"``);
    ``sequence_parallel`` asks for that sum whenever each rank sees only part of the norm's
    inputs (the query/key head norms too, whose heads are split over TP).

    ``zero_centred`` (RMSNorm, --zero-centred-norm, Qwen3.5): the scale is ``1 + weight`` with the weight
    starting at 0, applied in fp32 (a weight near 0 keeps more of its precision in bf16 than one near 1).
    """

    def __init__(self, name: str, hidden: int, kind: str, eps: float, sequence_parallel: bool,
                 zero_centred: bool = False):
        super().__init__()
        self.kind = kind
        self.zero_centred = zero_centred and kind == "RMSNorm"
        self.eps = eps
        self.hidden = hidden
        sync = "tp" if sequence_parallel else None
        init = "zeros" if self.zero_centred else "ones"
        self.weight = new_param(ShardSpec((whole(f"{name}.weight", (hidden,), init),), tp_replicated=True,
                                          grad_sync=sync))
        self.bias = (new_param(ShardSpec((whole(f"{name}.bias", (hidden,), "zeros"),), tp_replicated=True,
                                         grad_sync=sync)) if kind == "LayerNorm" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centred:
            return (F.rms_norm(x.float(), (self.hidden,), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if self.kind == "RMSNorm":
            return F.rms_norm(x, (self.hidden,), self.weight, self.eps)
        return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
