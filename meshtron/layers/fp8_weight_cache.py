"""FP8 copies of the weights, made once per optimizer step instead of once per micro-batch.

With tensorwise current scaling each FP8 linear casts its weight in every forward pass: an absolute
maximum over the weight, a scale, and a cast into both layouts its matmuls need. The weights change only
when the optimizer steps, so with several micro-batches per step all but the first of those casts repeat
the same work: GPU time, and on two H200s (llama3-8b, TP=2) host time too, since the forward pass of a
step was bound by how fast the host launched its many small kernels.

:class:`FP8WeightCache` casts every tensorwise FP8 linear's weight into buffers that the layer keeps
(``fp8_weight_q``, ``fp8_weight_q_t``, ``fp8_weight_inv``; not saved in checkpoints) and the layers read
them instead of casting. The trainer refreshes them before the first forward pass of each step and of
each evaluation, after anything that rewrites weights (optimizer step, checkpoint load) has run. The
values are the ones the layers would compute themselves, bit for bit. It costs two bytes per weight
element (both layouts) and is left off with ``--overlap-param-gather``, where the updated weights
arrive during the first forward pass (the layers then cast in every pass, as without the cache).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from meshtron.layers.fp8 import E4M3, scale_from_amax
from meshtron.layers.fp8_cast import cast_transpose
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear


class FP8WeightCache:
    """The FP8 weight copies of every tensorwise FP8 linear in ``model_chunks``; ``refresh()`` recasts them."""

    def __init__(self, model_chunks: Sequence[nn.Module]):
        self.layers = [m for chunk in model_chunks for m in chunk.modules()
                       if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                       and m.fp8_format is not None and m.fp8_recipe == "tensorwise"]
        for layer in self.layers:
            w = layer.weight
            layer.register_buffer("fp8_weight_q", torch.empty(w.shape, dtype=E4M3, device=w.device), persistent=False)
            layer.register_buffer("fp8_weight_q_t", torch.empty((w.shape[1], w.shape[0]), dtype=E4M3, device=w.device),
                                  persistent=False)
            layer.register_buffer("fp8_weight_inv", torch.ones((), dtype=torch.float32, device=w.device),
                                  persistent=False)

    def __len__(self) -> int:
        return len(self.layers)

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every cached weight from its current values."""
        for layer in self.layers:
            # The same amax (exact) and scale as the layers' own cast; one reduction pass in eager mode.
            scale, inv = scale_from_amax(torch.linalg.vector_norm(layer.weight, float("inf")), E4M3)
            q, q_t = cast_transpose(layer.weight, scale, E4M3)
            layer.fp8_weight_q.copy_(q)
            layer.fp8_weight_q_t.copy_(q_t)
            layer.fp8_weight_inv.copy_(inv)
