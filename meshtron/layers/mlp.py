"""The feed-forward block: SwiGLU or GeLU, tensor-parallel (column then row)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.config import ModelConfig, ffn_size
from meshtron.layers.fp8 import gradient_dtype
from meshtron.layers.fp8.swiglu import fp8_swiglu_mlp
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear, fuses_fp8_swiglu
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import Piece, scaled_std, shard


class MLP(nn.Module):
    """fc1 (gate and up fused for SwiGLU) split by columns, fc2 (down) split by rows."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, sequence_parallel: bool,
                 ffn_hidden: int | None = None):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        H = cfg.hidden_size
        F_ = ffn_hidden or ffn_size(cfg)
        std, out_std = cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers)
        bias = not cfg.disable_bias_linear
        self.swiglu = cfg.swiglu
        names = ["gate", "up"] if cfg.swiglu else ["up"]
        self.fc1 = ColumnParallelLinear(
            ctx, [shard(f"{prefix}.{n}.weight", (F_, H), 0, r, tp, std=std) for n in names],
            [shard(f"{prefix}.{n}.bias", (F_,), 0, r, tp, "zeros") for n in names] if bias else None,
            sequence_parallel)
        self.fc2 = RowParallelLinear(ctx, shard(f"{prefix}.down.weight", (H, F_), 1, r, tp, std=out_std),
                                     Piece(f"{prefix}.down.bias", (H,), 0, 0, H, "zeros") if bias else None,
                                     sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu and fuses_fp8_swiglu(self.fc1, self.fc2):
            # One FP8 function from fc1's input to fc2's output: the gradient of gate and up goes straight into
            # fc1's FP8 operands, never written in bf16. The layer's pre-hook has brought both weights.
            x = self.fc1.prepare_input(x)
            y = fp8_swiglu_mlp(x, self.fc1.weight, self.fc2.weight, gradient_dtype(self.fc1.fp8_format))
            return self.fc2.reduce_output(y)
        h = self.fc1(x)
        if self.swiglu:
            return self.fc2(h, gate_up=True)  # the module call: its pre-hooks bring the weight
        return self.fc2(F.gelu(h, approximate="tanh"))
