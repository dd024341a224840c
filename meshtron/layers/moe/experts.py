"""This rank's experts: one MLP per local expert, computed together.

Weights of the El local experts live in two parameters so that a grouped GEMM can
read them as [El, out, in] views without copies:

* ``fc1_weight`` [El * n * F/TP, H]: for each local expert e, its gate (SwiGLU) and up
  rows of this TP rank (canonical ``<prefix>.<e>.gate.weight`` / ``.up.weight``, [F, H]);
* ``fc2_weight`` [El * H, F/TP]: each local expert's down projection columns of this TP
  rank (canonical ``<prefix>.<e>.down.weight``, [H, F]).

With tensor parallelism (expert tensor parallel size = TP) each expert is split like
the dense MLP, column- then row-parallel; the output rows are partial sums over TP,
reduced by the MoE layer after the combine. All expert parameters carry
``ShardSpec.expert=True``: their gradients are reduced over the expert-data-parallel group.

On CUDA with bf16, ``torch._grouped_mm`` multiplies all experts' row groups in one
kernel per projection (groups padded to 8-row boundaries, as its kernels need 16-byte
aligned group starts); elsewhere (CPU, fp32) a loop over the local experts does the
same products one expert at a time.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.layers.fp8.grouped import GROUP_ALIGN as FP8_GROUP_ALIGN
from meshtron.layers.fp8.grouped import ExpertGroups, GroupedFP8Products, fp8_grouped_linear
from meshtron.layers.fused import compiled_on_cuda
from meshtron.layers.moe.slots import GatherToSlots, RowsAt, SumFromSlots
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import ShardSpec, new_param, scaled_std, shard, whole


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """Local experts ``first, ..., first + num_local - 1`` of ``prefix`` (e.g. ``layers.3.mlp.experts``).

    ``grouped``: use ``torch._grouped_mm`` (None: on CUDA with bf16 inputs when the shapes allow). With FP8 on
    (:meth:`set_fp8`) the experts always compute on the aligned buffer, in FP8, whatever ``grouped`` says.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, prefix: str, first: int, num_local: int,
                 ffn_hidden: int, grouped: Optional[bool] = None):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        H, Fe = cfg.hidden_size, ffn_hidden
        self.num_local, self.hidden = num_local, H
        self.swiglu = cfg.swiglu
        self._bias_share = 1.0 if r == 0 else 0.0
        self.grouped = grouped
        std, out_std = cfg.init_method_std, scaled_std(cfg.init_method_std, cfg.num_layers)
        names = ["gate", "up"] if cfg.swiglu else ["up"]
        experts = range(first, first + num_local)
        self.fc1_weight = new_param(ShardSpec(tuple(
            shard(f"{prefix}.{e}.{n}.weight", (Fe, H), 0, r, tp, std=std) for e in experts for n in names), 0,
            expert=True))
        self.fc2_weight = new_param(ShardSpec(tuple(
            shard(f"{prefix}.{e}.down.weight", (H, Fe), 1, r, tp, std=out_std) for e in experts), 0, expert=True))
        if cfg.disable_bias_linear:
            self.fc1_bias = self.fc2_bias = None
        else:
            self.fc1_bias = new_param(ShardSpec(tuple(
                shard(f"{prefix}.{e}.{n}.bias", (Fe,), 0, r, tp, "zeros") for e in experts for n in names), 0,
                expert=True))
            # Only TP rank 0 adds the output bias to its partial sum (the others add it times 0, so that
            # every copy gets a gradient); the gradients' TP sum keeps the copies equal.
            self.fc2_bias = new_param(ShardSpec(tuple(
                whole(f"{prefix}.{e}.down.bias", (H,), "zeros") for e in experts), 0, tp_replicated=True,
                grad_sync="tp", expert=True))
        self._grouped_shapes_ok = H % 8 == 0 and (Fe // tp) % 8 == 0  # 16-byte strides for bf16 kernels
        self.fp8_format: Optional[str] = None  # set by set_fp8
        self.fp8_recipe: Optional[str] = None

    def set_fp8(self, fmt: str, recipe: str = "tensorwise") -> None:
        """Run the expert GEMMs in FP8 with ``recipe`` (``fmt``: the run's --fp8-format; the experts' output
        gradients are e4m3 under either, see :mod:`meshtron.layers.fp8.grouped`)."""
        self.fp8_format, self.fp8_recipe = fmt, recipe

    def _layout(self) -> tuple[int, int]:
        """(rows per group boundary, fewest rows of a group) of the aligned buffer."""
        return (FP8_GROUP_ALIGN, FP8_GROUP_ALIGN) if self.fp8_recipe is not None else (GROUP_ALIGN, 0)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.fp8_recipe is not None:
            return True
        if self.grouped is not None:
            return self.grouped
        return (x.is_cuda and x.dtype == torch.bfloat16 and self._grouped_shapes_ok and grouped_mm_available())

    @torch.compiler.disable  # row counts change every step: no recompilation for each new shape
    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                host_counts: Optional[list[int]] = None, row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [M, H] rows grouped by local expert, ``tokens_per_expert`` [El] (device) -> [M, H].

        ``host_counts``: the same counts as a list when the caller already has them on the host.
        ``row_weights`` [M] (fp32): each row's combine weight, applied to the activation (SwiGLU experts
        without an output bias, :attr:`weights_in_activation`); None: unweighted outputs.
        """
        El, H = self.num_local, self.hidden
        if row_weights is not None and not self.weights_in_activation:
            raise ValueError("only SwiGLU experts without an output bias weigh their rows inside the activation")
        w1 = self.fc1_weight.view(El, -1, H)
        w2 = self.fc2_weight.view(El, H, -1)
        if self._use_grouped(x):
            return self._grouped_forward(x, w1, w2, tokens_per_expert, row_weights)
        sizes = host_counts if host_counts is not None else tokens_per_expert.tolist()
        weights = torch.split(row_weights, sizes) if row_weights is not None else [None] * len(sizes)
        outs = []
        for e, (rows, w) in enumerate(zip(torch.split(x, sizes), weights)):
            h = F.linear(rows, w1[e], self.fc1_bias.view(El, -1)[e] if self.fc1_bias is not None else None)
            a = self._activation(h)
            y = F.linear(a if w is None else a * w[:, None].to(a.dtype), w2[e])
            if self.fc2_bias is not None:
                y = y + self.fc2_bias.view(El, H)[e] * self._bias_share
            outs.append(y)
        return torch.cat(outs) if outs else x.new_zeros((0, H))

    def _grouped_forward(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         tokens_per_expert: torch.Tensor, row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        padded, offs, dest, expert_of_row = _aligned_groups(x, tokens_per_expert, *self._layout())
        if row_weights is not None:  # padding rows weigh 0
            row_weights = row_weights.new_zeros(padded.shape[0]).index_copy(0, dest, row_weights)
        y = self._grouped_mlp(padded, w1, w2, offs, expert_of_row, row_weights, self._real_rows(dest, padded))
        return RowsAt.apply(y, dest)

    def _real_rows(self, rows: torch.Tensor, padded: torch.Tensor) -> Optional[torch.Tensor]:
        """1 at the buffer's ``rows`` and 0 at its padding (fp32), where FP8 experts with an fc1 bias need it: the
        padding rows' activation of the bias would otherwise count in the scales of fc2's input."""
        if self.fp8_recipe is None or self.fc1_bias is None:
            return None
        return padded.new_zeros(padded.shape[0], dtype=torch.float32).index_fill_(0, rows, 1.0)

    def _grouped_mlp(self, padded: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                     expert_of_row: torch.Tensor, row_weights: Optional[torch.Tensor] = None,
                     real_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The experts on the aligned buffer ``padded``. ``row_weights`` (fp32, one per row): each row's routing
        weight, applied inside SwiGLU (None: 1, the combine weighs the outputs). ``real_rows`` (FP8 with an fc1
        bias): 1 on the rows that hold tokens, 0 on padding (:meth:`_real_rows`)."""
        if self.fp8_recipe is not None:
            return self._fp8_mlp(padded, w1, w2, ExpertGroups(offs, expert_of_row), row_weights, real_rows)
        h = torch._grouped_mm(padded, w1.transpose(1, 2), offs=offs)
        if self.fc1_bias is not None:
            h = add_expert_bias(h, self.fc1_bias.view(self.num_local, -1), expert_of_row)
        if self.swiglu:
            # SwiGLU fused with the down projection, which recomputes it in its backward: neither SiLU's output
            # nor the product stays for backward.
            if row_weights is None:
                row_weights = h.new_ones(h.shape[0], dtype=torch.float32)
            y = _WeightedSwiGLUDown.apply(h, row_weights, w2, _GroupedBf16Products(offs))
        else:
            y = torch._grouped_mm(self._activation(h), w2.transpose(1, 2), offs=offs)
        if self.fc2_bias is not None:
            y = add_expert_bias(y, self.fc2_bias.view(self.num_local, -1), expert_of_row, self._bias_share)
        return y

    def _fp8_mlp(self, padded: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, groups: ExpertGroups,
                 row_weights: Optional[torch.Tensor], real_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`_grouped_mlp` with both projections in FP8 (:mod:`meshtron.layers.fp8.grouped`); the activation
        between them in the activations' dtype, SwiGLU fused with the down projection as in bf16."""
        products = GroupedFP8Products(groups, self.fp8_recipe)
        h = fp8_grouped_linear(padded, w1, products)
        if self.fc1_bias is not None:
            h = add_expert_bias(h, self.fc1_bias.view(self.num_local, -1), groups.expert_of_row)
        if self.swiglu:
            if row_weights is None:
                row_weights = real_rows if real_rows is not None else h.new_ones(h.shape[0], dtype=torch.float32)
            y = _WeightedSwiGLUDown.apply(h, row_weights, w2, products)
        else:
            a = self._activation(h)
            if real_rows is not None:
                a = a * real_rows[:, None].to(a.dtype)
            y = fp8_grouped_linear(a, w2, products)
        if self.fc2_bias is not None:
            y = add_expert_bias(y, self.fc2_bias.view(self.num_local, -1), groups.expert_of_row, self._bias_share)
        return y

    def uses_grouped_gemm(self, x: torch.Tensor) -> bool:
        """Whether rows like ``x`` go through the grouped GEMM (else the loop over experts)."""
        return self._use_grouped(x)

    @torch.compiler.disable  # row counts change every step
    def forward_assignments(self, tokens: torch.Tensor, indices: torch.Tensor,
                            tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Every (token, choice) assignment's expert output, [T * k, H] in assignment order, for ``indices``
        [T, k] of local experts (``tokens_per_expert`` [El]: the router's count of each), all kept (no expert
        parallelism, no capacity): the tokens are gathered
        straight into the grouped GEMM's aligned buffer and the outputs straight out of it, one gather each
        way instead of a permutation, a padding copy and back (:func:`assignment_slots`)."""
        El, H = self.num_local, self.hidden
        slot, offs, expert_of_row, total = assignment_slots(indices, tokens_per_expert, *self._layout())
        padded = GatherToSlots.apply(tokens, slot, total, indices.shape[1])
        y = self._grouped_mlp(padded, self.fc1_weight.view(El, -1, H), self.fc2_weight.view(El, H, -1), offs,
                              expert_of_row, None, self._real_rows(slot, padded))
        return RowsAt.apply(y, slot)

    @property
    def weights_in_activation(self) -> bool:
        """Whether the experts can weigh their rows inside the activation (:meth:`forward_weighted`, and
        ``row_weights`` of :meth:`forward`): SwiGLU experts without an output bias (whose sum would otherwise
        need each row's routing weight too)."""
        return self.swiglu and self.fc2_bias is None

    @torch.compiler.disable  # the layer's compiled graph would break here anyway (the experts' own kernels)
    def forward_weighted(self, tokens: torch.Tensor, indices: torch.Tensor, tokens_per_expert: torch.Tensor,
                         probs: torch.Tensor) -> torch.Tensor:
        """``sum_j probs[t, j] * expert_{indices[t, j]}(tokens[t])`` -> [T, H], on the path of
        :meth:`forward_assignments` (every assignment kept, every expert here, the grouped GEMM).

        The routing weight scales each row's SwiGLU output before the down projection (the same sum, the
        projection being linear), so the combine is a plain sum over each token's slots that keeps nothing
        for backward, where the weighted combine kept every assignment's output row; and the down
        projection recomputes SwiGLU in its backward (:class:`_WeightedSwiGLUDown`). Per assignment the
        layer keeps fc1's input row and output and the fp32 weight (``e*(h + 2*fe) + 4`` bytes), not also
        the output row, SiLU's output and the product. The element-wise work runs as one fused kernel
        each way on CUDA (:func:`meshtron.layers.fused.compiled_on_cuda`: the buffer's size is fixed by the
        micro-batch, so it compiles once)."""
        El, H = self.num_local, self.hidden
        k = indices.shape[1]
        slot, offs, expert_of_row, total = assignment_slots(indices, tokens_per_expert, *self._layout())
        padded = GatherToSlots.apply(tokens, slot, total, k)
        row_probs = _row_weights(probs.float().reshape(-1), slot, total)  # padding rows weigh 0
        y = self._grouped_mlp(padded, self.fc1_weight.view(El, -1, H), self.fc2_weight.view(El, H, -1), offs,
                              expert_of_row, row_probs)
        return SumFromSlots.apply(y, slot, k)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")


def assignment_slots(indices: torch.Tensor, counts: torch.Tensor, align: Optional[int] = None, min_rows: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The row of the aligned grouped-GEMM buffer (:func:`aligned_layout`, with ``align`` and ``min_rows``) of each
    assignment ``t * k + j`` (token t's j-th expert ``indices[t, j]``; ``counts``: the assignments of each expert),
    in expert order and, within an expert, in assignment order; with the layout's group offsets, expert of each
    buffer row and buffer size."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs, dest, expert_of_row, total = aligned_layout(counts, flat.numel(), align, min_rows)
    slot = torch.empty_like(dest).index_copy_(0, order, dest)
    return slot, offs, expert_of_row, total


def _row_weights(flat_probs: torch.Tensor, slot: torch.Tensor, total: int) -> torch.Tensor:
    """Each buffer row's routing weight (fp32; padding rows 0), differentiable in ``flat_probs``."""
    return flat_probs.new_zeros(total).index_copy(0, slot, flat_probs)


def _weighted_swiglu(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * p`` per row of ``h`` = [gate, up], computed in fp32, in ``h``'s dtype."""
    gate, up = h.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up * p[:, None]).to(h.dtype)  # as the backward recomputes it


def _weighted_swiglu_backward(h: torch.Tensor, p: torch.Tensor, grad_a: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From fc1's output ``h``, the rows' weights ``p`` and the gradient of the weighted product ``grad_a``:
    the weighted product again (the down projection's weight gradient reads it), the gradient of ``h``
    and each row's weight gradient (fp32)."""
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    product = silu * up
    g = grad_a.float()
    grad_p = (g * product).sum(-1)
    g = g * p[:, None]
    grad_gate = g * up * sig * (1 + gate * (1 - sig))
    grad_h = torch.cat([grad_gate, g * silu], dim=-1).to(h.dtype)
    return (product * p[:, None]).to(h.dtype), grad_h, grad_p


# The buffer's row count is fixed by the micro-batch on the direct path, but changes every step through the
# dispatcher (expert parallelism, dropping): a second shape compiles once more with that dimension dynamic.
_weighted_swiglu_fused = compiled_on_cuda(_weighted_swiglu, dynamic=None)
_weighted_swiglu_backward_fused = compiled_on_cuda(_weighted_swiglu_backward, dynamic=None)


class _GroupedBf16Products:
    """The grouped GEMM's three products of a projection ``y_r = a_r W_e^T`` (``w`` [El, out, in]) over the groups
    ending at ``offs``, in the operands' dtype (the FP8 ones: :class:`meshtron.layers.fp8.grouped.GroupedFP8Products`)."""

    def __init__(self, offs: torch.Tensor):
        self.offs = offs

    def forward(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=self.offs)

    def input_grad(self, grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(grad, w, offs=self.offs)

    def weight_grad(self, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        # In the weight's own [El, H, F] layout: a transposed result would cost a strided copy of every
        # expert's down projection when the gradient is accumulated (1.3 ms per layer on an H200 at the
        # Qwen3-30B-A3B shape).
        return torch._grouped_mm(grad.t(), a, offs=self.offs)


class _WeightedSwiGLUDown(torch.autograd.Function):
    """``grouped_mm(silu(gate) * up * p, w2^T)`` per expert group, for fc1's output ``h`` = [gate, up] (rows
    of the aligned buffer) and each row's routing weight ``p`` (fp32). Backward recomputes the weighted
    product from ``h`` instead of keeping it (one fused pass that also yields the gradients of ``h`` and
    ``p``), then runs the grouped GEMM's two gradient products. ``products``: the grouped products, bf16
    (:class:`_GroupedBf16Products`) or FP8 (:class:`meshtron.layers.fp8.grouped.GroupedFP8Products`)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, p: torch.Tensor, w2: torch.Tensor, products) -> torch.Tensor:
        ctx.save_for_backward(h, p, w2)
        ctx.products = products
        return products.forward(_weighted_swiglu_fused(h, p), w2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, p, w2 = ctx.saved_tensors
        products = ctx.products
        grad_a = products.input_grad(grad, w2)
        a, grad_h, grad_p = _weighted_swiglu_backward_fused(h, p, grad_a)
        grad_w2 = products.weight_grad(grad, a).to(w2.dtype)
        return grad_h, grad_p, grad_w2, None


class _AddExpertBias(torch.autograd.Function):
    """rows + scale * bias[expert of row], whose bias gradient is summed in fp32.

    The autograd of ``index_select`` would sum thousands of bf16 row gradients into each
    expert's bias with bf16 atomics; the per-expert GEMM (F.linear) reduces in fp32.
    """

    @staticmethod
    def forward(ctx, rows, bias, expert_of_row, scale):
        ctx.save_for_backward(expert_of_row)
        ctx.scale, ctx.bias_shape, ctx.bias_dtype = scale, bias.shape, bias.dtype
        return rows + bias.index_select(0, expert_of_row) * scale

    @staticmethod
    def backward(ctx, grad):
        (expert_of_row,) = ctx.saved_tensors
        grad_bias = grad.new_zeros(ctx.bias_shape, dtype=torch.float32).index_add_(0, expert_of_row, grad.float())
        return grad, (grad_bias * ctx.scale).to(ctx.bias_dtype), None, None


def add_expert_bias(rows: torch.Tensor, bias: torch.Tensor, expert_of_row: torch.Tensor,
                    scale: float = 1.0) -> torch.Tensor:
    """``rows`` [M, N] plus ``scale`` x the bias row [El, N] of each row's expert (fp32 bias gradient)."""
    return _AddExpertBias.apply(rows, bias, expert_of_row, scale)


#: Rows per group boundary for the grouped GEMM: every group starts on a 16-byte boundary of the
#: row dimension in bf16 (the weight-gradient GEMM contracts over rows, read by TMA).
GROUP_ALIGN = 8


def aligned_layout(counts: torch.Tensor, rows: int, align: Optional[int] = None, min_rows: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where ``rows`` rows grouped by expert (``counts`` per group) go in a buffer whose groups each start
    at a multiple of ``align`` rows (default GROUP_ALIGN) and hold at least ``min_rows`` (a multiple of
    ``align``; FP8 experts give every group rows), without a host synchronisation.

    Returns (int32 group end offsets, destination of each row, local expert of each buffer row, buffer
    rows). The buffer has a static size (rows + max(align - 1, min_rows) x groups, rounded up); the last
    group absorbs the slack: zero rows whose outputs are never read.
    """
    align = GROUP_ALIGN if align is None else align
    num_groups = counts.numel()
    padded_counts = (counts + align - 1) // align * align
    if min_rows:
        padded_counts = padded_counts.clamp(min=min_rows)
    shift = (torch.cumsum(padded_counts, 0) - padded_counts) - (torch.cumsum(counts, 0) - counts)
    groups = torch.arange(num_groups, device=counts.device)
    dest = torch.arange(rows, device=counts.device) + shift[torch.repeat_interleave(groups, counts, output_size=rows)]
    total = -(-(rows + max(align - 1, min_rows) * num_groups) // align) * align
    offs = torch.cumsum(padded_counts, 0).to(torch.int32)
    offs[-1] = total
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    expert_of_row = torch.repeat_interleave(groups, sizes, output_size=total)
    return offs, dest, expert_of_row, total


def _aligned_groups(x: torch.Tensor, counts: torch.Tensor, align: Optional[int] = None, min_rows: int = 0):
    """Copy the row groups of ``x`` into the zero buffer of :func:`aligned_layout` (``align``, ``min_rows``).

    Returns (padded rows, int32 group end offsets, destination of each row of ``x``, local expert of
    each padded row)."""
    offs, dest, expert_of_row, total = aligned_layout(counts, x.shape[0], align, min_rows)
    padded = x.new_zeros((total, x.shape[1])).index_copy(0, dest, x)
    return padded, offs, dest, expert_of_row
