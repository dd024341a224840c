"""The mixture-of-experts MLP block, and the hook that puts it into the transformer.

Data flow for an input [S/TP (sequence parallel) or S, B, H] on one rank:

1. tensor parallelism: with sequence parallelism the sequence shards are all-gathered,
   so every TP rank holds the T = S x B tokens of its micro-batch (without it they
   already do). Routing is computed on every TP rank identically (Megatron-LM's scheme
   for expert tensor parallel size = TP);
2. the router picks k experts per token (:mod:`.router`);
3. tokens travel to their experts (:mod:`.dispatcher`; all-to-all over the EP group,
   between ranks with the same TP rank) and each rank's experts, split column/row over
   TP like the dense MLP, compute partial sums (:mod:`.experts`);
4. outputs come back, are weighted and summed per token, shared experts (a dense
   TP MLP) are added, and one reduction over TP (reduce-scatter to sequence shards with
   sequence parallelism, all-reduce otherwise) completes the partial sums.

Gradients: the router's path is replicated over TP (its input gradient is complete on
every rank), while the experts' input gradients are partial sums, all-reduced over TP
(``copy_to_tp`` on the dispatched tokens and on the combine weights). The router
weight is therefore identical on all TP ranks without any extra synchronisation.

Router losses join the backward pass through :func:`.aux_losses.attach_aux_loss`
with ``aux_loss_scale`` (set by :func:`.training.set_aux_loss_scale`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.config import ConfigError, MeshtronConfig, ModelConfig, ffn_size
from meshtron.layer_kinds.pattern import is_moe_layer, layer_at
from meshtron.layers.fp8 import fp8_linear
from meshtron.layers.mlp import MLP
from meshtron.layers.moe.aux_losses import attach_aux_loss
from meshtron.layers.moe.buffers import Fp32BufferModule
from meshtron.layers.moe.dispatcher import TokenDispatcher, weighted_sum
from meshtron.layers.moe.experts import GroupedExperts
from meshtron.layers.moe.router import TopKRouter
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.layout import sequence_parallel_in_effect

MakeMLP = Callable[[ModelConfig, ParallelContext, int, bool], Optional[nn.Module]]


class MoELayer(Fp32BufferModule):
    """Router + this rank's experts (+ shared experts) replacing the MLP of layer ``layer_index``.

    Keeps load statistics in fp32 buffers while training (read and reset by
    :mod:`meshtron.layers.moe.training`): routed tokens per expert since the last metrics
    read (``load_tokens``) and since the last step (``step_tokens``, for the expert bias),
    and the sums of the router losses over forward calls (``aux_sum``, ``z_sum``, ``calls``).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_index: int, sequence_parallel: bool,
                 grouped_gemm: Optional[bool] = None, prefix: Optional[str] = None):
        super().__init__()
        prefix = prefix or f"layers.{layer_index}.mlp"  # another name for a multi-token prediction layer's MLP
        E = cfg.num_experts
        if E % ctx.ep:
            raise ConfigError(f"--num-experts ({E}) must be divisible by --expert-model-parallel-size ({ctx.ep})")
        Fe = cfg.moe_ffn_hidden_size or ffn_size(cfg)
        if Fe % ctx.tp:
            raise ConfigError(f"--moe-ffn-hidden-size ({Fe}) must be divisible by --tensor-model-parallel-size "
                              f"({ctx.tp})")
        self.layer_index = layer_index
        self.num_experts = E
        self.num_local = E // ctx.ep
        self.tp_group = ctx.tp_group
        self.sequence_parallel = sequence_parallel_in_effect(sequence_parallel, ctx.tp)
        self.aux_loss_scale = 1.0
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity
        self.router = TopKRouter(cfg, f"{prefix}.router", ctx.cp_group)
        self.experts = GroupedExperts(cfg, ctx, f"{prefix}.experts", ctx.ep_rank * self.num_local, self.num_local,
                                      Fe, grouped=grouped_gemm)
        self.dispatcher = TokenDispatcher(E, self.num_local, ctx.ep_group)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = (MLP(cfg, ctx, f"{prefix}.shared_experts", self.sequence_parallel, ffn_hidden=shared)
                               if shared else None)
        for name in ("load_tokens", "step_tokens"):
            self.register_buffer(name, torch.zeros(E), persistent=False)
        for name in ("aux_sum", "z_sum", "calls"):
            self.register_buffer(name, torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, b, h = x.shape
        if self.sequence_parallel:  # each rank's router gradient is complete: backward keeps its own shard
            x = comm.gather_from_sequence(x, self.tp_group, grad_is_partial=False)
        tokens = x.reshape(-1, h)
        routing = self.router(tokens, b)
        # Experts (and shared experts) see the tokens through copy_to_tp: their input gradients are
        # partial sums over TP, all-reduced in backward.
        expert_in = comm.copy_to_tp(tokens, self.tp_group)
        probs = comm.copy_to_tp(routing.probs, self.tp_group)
        if self.dispatcher.ep == 1 and routing.keep is None and self.experts.uses_grouped_gemm(expert_in):
            # Every assignment kept and every expert here: straight into and out of the grouped GEMM.
            if self.experts.weights_in_activation:
                y = self.experts.forward_weighted(expert_in, routing.indices, routing.tokens_per_expert, probs)
            else:
                T, k = routing.indices.shape
                rows = self.experts.forward_assignments(expert_in, routing.indices, routing.tokens_per_expert)
                y = weighted_sum(rows.view(T, k, h), probs)
        else:
            rows, per_expert, host_counts, state = self.dispatcher.dispatch(
                expert_in, routing.indices, routing.keep, routing.capacity if self.pad_to_capacity else None)
            # SwiGLU experts weigh their rows inside the activation (the combine then keeps no rows for backward).
            weigh = self.experts.weights_in_activation
            row_weights = self.dispatcher.dispatch_weights(probs, state) if weigh else None
            out_rows = self.experts(rows, per_expert, host_counts, row_weights)
            y = self.dispatcher.combine(out_rows, probs, state, weighted=not weigh)
        if self.shared_experts is not None:
            y = y + self._shared_partial(expert_in)
        y = y.view(-1, b, h)
        y = (comm.reduce_scatter_to_sequence(y, self.tp_group) if self.sequence_parallel
             else comm.reduce_from_tp(y, self.tp_group))
        if self.shared_experts is not None and self.shared_experts.fc2.bias is not None:
            y = y + self.shared_experts.fc2.bias
        if self.training and torch.is_grad_enabled():
            y = self._attach_losses(y, routing)
        return y

    def _shared_partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared experts' output before its TP reduction (done once, together with the routed experts')."""
        mlp = self.shared_experts
        hidden = mlp.fc1(tokens, prepared=True)
        if mlp.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh")
        if mlp.fc2.fp8_format is not None:  # the recipe of the dense linears, as fc1 (its module call) takes it
            return fp8_linear(hidden, mlp.fc2.weight, None, mlp.fc2.fp8_format, mlp.fc2.fp8_recipe)
        return F.linear(hidden, mlp.fc2.weight)

    def _attach_losses(self, y: torch.Tensor, routing) -> torch.Tensor:
        losses = [loss for loss in (routing.aux_loss, routing.z_loss) if loss is not None]
        with torch.no_grad():
            counts = routing.tokens_per_expert.to(self.load_tokens.dtype)
            self.load_tokens += counts
            if self.router.expert_bias is not None:
                self.step_tokens += counts
            if routing.aux_loss is not None:
                self.aux_sum += routing.aux_loss.detach()
            if routing.z_loss is not None:
                self.z_sum += routing.z_loss.detach()
            self.calls += 1
        if not losses:
            return y
        return attach_aux_loss(y, sum(losses), self.aux_loss_scale)


def make_moe_mlp(cfg: ModelConfig, ctx: ParallelContext, layer_index: int, sequence_parallel: bool,
                 prefix: Optional[str] = None) -> Optional[nn.Module]:
    """The ``make_mlp`` hook of :class:`meshtron.model.GPTModel`: the MoE layer of the layer's MLP kind where
    :func:`meshtron.layer_kinds.pattern.is_moe_layer` says so, else None (the dense MLP). ``prefix`` names its
    parameters (default ``layers.{layer_index}.mlp``)."""
    if not is_moe_layer(cfg, layer_index):
        return None
    return layer_at(cfg, layer_index).mlp.build(cfg, ctx, layer_index, prefix or f"layers.{layer_index}.mlp",
                                                sequence_parallel)


def moe_mlp_factory(cfg: MeshtronConfig) -> Optional[MakeMLP]:
    """The ``make_mlp`` hook for a run's configuration (None for a dense model).

    The expert layout this implementation supports (``--expert-tensor-parallel-size`` equal to
    TP, ``--moe-first-dense-layers >= 0``) is checked up front by :mod:`meshtron.validation`.
    """
    if not cfg.model.num_experts:
        return None
    return make_moe_mlp
