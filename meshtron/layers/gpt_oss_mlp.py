"""gpt-oss's feed-forward parts: the clamped SwiGLU, a dense MLP and MoE experts with it, the biased router.

gpt-oss's activation of ``gate`` and ``up`` (with ``alpha`` = 1.702, ``limit`` = 7)::

    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

Hugging Face stores each expert's gate and up columns interleaved (gate, up, gate, up, ...) in
``gate_up_proj`` [E, H, 2F]; meshtron keeps them as separate canonical tensors (``<e>.gate.weight``
and ``<e>.up.weight`` [F, H], as :class:`~meshtron.layers.moe.experts.GroupedExperts`), and its fused
fc1 output is ``[gate, up]`` in halves: :func:`deinterleave` converts.

The router is a linear layer with a bias; each token takes its top-k logits and the softmax over
those k as combine weights (meshtron's default softmax routing, :func:`~meshtron.layers.moe.router.select_experts`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshtron.config import ffn_size
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.layers.moe.aux_losses import load_balancing_loss
from meshtron.layers.moe.experts import GroupedExperts
from meshtron.layers.moe.layer import MoELayer
from meshtron.layers.moe.router import Routing, select_experts
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import Piece, ShardSpec, new_param, scaled_std, shard, whole

ALPHA = 1.702
LIMIT = 7.0


def clamped_swiglu(gate_up: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """gpt-oss's activation of ``gate_up`` = [gate, up] (halves of the last dimension)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(gate_up: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a tensor whose ``dim`` alternates gate and up entries (Hugging Face's gpt-oss layout)."""
    pairs = gate_up.movedim(dim, -1).unflatten(-1, (-1, 2))
    return pairs[..., 0].movedim(-1, dim), pairs[..., 1].movedim(-1, dim)


class ClampedSwiGLUMLP(nn.Module):
    """A dense MLP with gpt-oss's activation: fc1 ([gate, up], with biases) split by columns over TP, fc2
    (down, with bias) by rows. Canonical tensors ``gate``, ``up``, ``down`` ``.weight``/``.bias``, as
    :class:`~meshtron.layers.mlp.MLP`. Called on ``x`` [s, b, hidden]."""

    def __init__(self, ctx: ParallelContext, prefix: str, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 alpha: float = ALPHA, limit: float = LIMIT, sequence_parallel: bool = False,
                 init_std: float = 0.02, output_std: Optional[float] = None):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        H, Fh = hidden_size, ffn_hidden_size
        self.alpha, self.limit = alpha, limit
        out_std = init_std if output_std is None else output_std
        self.fc1 = ColumnParallelLinear(
            ctx, [shard(f"{prefix}.{n}.weight", (Fh, H), 0, r, tp, std=init_std) for n in ("gate", "up")],
            [shard(f"{prefix}.{n}.bias", (Fh,), 0, r, tp, "zeros") for n in ("gate", "up")] if bias else None,
            sequence_parallel)
        self.fc2 = RowParallelLinear(ctx, shard(f"{prefix}.down.weight", (H, Fh), 1, r, tp, std=out_std),
                                     Piece(f"{prefix}.down.bias", (H,), 0, 0, H, "zeros") if bias else None,
                                     sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(clamped_swiglu(self.fc1(x), self.alpha, self.limit))


class ClampedSwiGLUExperts(GroupedExperts):
    """gpt-oss's experts: :class:`~meshtron.layers.moe.experts.GroupedExperts` (same parameters, canonical
    names, biases, tensor parallelism, grouped GEMM on CUDA) with the clamped SwiGLU as activation."""

    def __init__(self, ctx: ParallelContext, prefix: str, hidden_size: int, ffn_hidden_size: int, first: int,
                 num_local: int, bias: bool = True, alpha: float = ALPHA, limit: float = LIMIT,
                 init_std: float = 0.02, output_std: Optional[float] = None, grouped: Optional[bool] = None):
        # GroupedExperts reads these fields of a model config; its output std is init_std / sqrt(2 * layers).
        out = init_std if output_std is None else output_std
        shape = SimpleNamespace(hidden_size=hidden_size, swiglu=True, init_method_std=init_std,
                                num_layers=(init_std / out) ** 2 / 2, disable_bias_linear=not bias)
        super().__init__(shape, ctx, prefix, first, num_local, ffn_hidden_size, grouped)
        # The generic activation path (not SiLU's fused kernels), through _activation below.
        self.swiglu = False
        self.alpha, self.limit = alpha, limit

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(h, self.alpha, self.limit)


class BiasedTopKRouter(nn.Module):
    """gpt-oss's router: logits = x W^T + b (W [E, H] and b [E] replicated over TP, in fp32), the top-k
    logits and the softmax over them. Canonical tensors ``<prefix>.weight`` and ``<prefix>.bias``.

    ``forward(tokens [T, H])`` gives meshtron's :class:`~meshtron.layers.moe.router.Routing` (no capacity;
    with ``aux_loss_coeff`` > 0, the load-balancing loss while training, its expert counts and token total
    summed over ``cp_group`` under context parallelism, as :class:`~meshtron.layers.moe.router.TopKRouter`'s)."""

    def __init__(self, prefix: str, hidden_size: int, num_experts: int, topk: int, init_std: float = 0.02,
                 aux_loss_coeff: float = 0.0, cp_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.num_experts, self.topk, self.aux_coeff, self.cp_group = num_experts, topk, aux_loss_coeff, cp_group
        self.weight = new_param(ShardSpec((whole(f"{prefix}.weight", (num_experts, hidden_size), std=init_std),),
                                          tp_replicated=True))
        self.bias = new_param(ShardSpec((whole(f"{prefix}.bias", (num_experts,), "zeros"),), tp_replicated=True))

    expert_bias = None  # no aux-loss-free balancing (meshtron.layers.moe.training reads it)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.float(), self.weight.float(), self.bias.float())

    def forward(self, tokens: torch.Tensor, batch: Optional[int] = None) -> Routing:
        """``batch`` (the MoE layer passes it, for sequence-level losses) is not needed."""
        logits = self.logits(tokens)
        probs, indices = select_experts(logits, self.topk)  # top-k logits, softmax over them
        tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        routing = Routing(probs, indices, None, tokens_per_expert)
        if self.aux_coeff > 0 and self.training and torch.is_grad_enabled():
            routing.aux_loss = load_balancing_loss(torch.softmax(logits, -1), tokens_per_expert, self.topk,
                                                   self.aux_coeff, self.cp_group)
        return routing


class ClampedSwiGLUMoE(MoELayer):
    """gpt-oss's MoE block (the ``oss_moe`` layer kind): :class:`~meshtron.layers.moe.layer.MoELayer`'s
    dispatch, expert parallelism and load statistics with :class:`BiasedTopKRouter` (aux loss at
    --moe-aux-loss-coeff with --moe-router-load-balancing-type aux_loss) and :class:`ClampedSwiGLUExperts`
    (--swiglu-clamp-limit, --swiglu-clamp-alpha, biases unless --disable-bias-linear)."""

    def __init__(self, cfg, ctx: ParallelContext, layer_index: int, sequence_parallel: bool,
                 grouped_gemm: Optional[bool] = None, prefix: Optional[str] = None):
        super().__init__(cfg, ctx, layer_index, sequence_parallel, grouped_gemm, prefix)
        prefix = prefix or f"layers.{layer_index}.mlp"
        coeff = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0
        # MoELayer's own router and experts (made on the meta device) give way to gpt-oss's.
        self.router = BiasedTopKRouter(f"{prefix}.router", cfg.hidden_size, cfg.num_experts, cfg.moe_router_topk,
                                       cfg.init_method_std, coeff, ctx.cp_group)
        self.experts = ClampedSwiGLUExperts(
            ctx, f"{prefix}.experts", cfg.hidden_size, cfg.moe_ffn_hidden_size or ffn_size(cfg),
            ctx.ep_rank * self.num_local, self.num_local, not cfg.disable_bias_linear, cfg.swiglu_clamp_alpha,
            cfg.swiglu_clamp_limit,
            cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers), grouped_gemm)
