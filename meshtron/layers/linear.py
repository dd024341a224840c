"""Column- and row-parallel linear layers (Megatron's tensor parallelism).

ColumnParallelLinear splits the output features over TP ranks: the input is the
full activation (all-gathered from sequence shards with sequence parallelism),
the output stays sharded. RowParallelLinear splits the input features: each rank
computes a partial product that is summed over TP (all-reduce, or reduce-scatter
to sequence shards with sequence parallelism). A column layer followed by a row
layer needs one collective in each direction.

Weight-gradient deferral (zero-bubble pipeline schedules): a layer given a weight-gradient store
(``layer.wgrad_store``, set by :func:`meshtron.pipeline.zero_bubble.attach_weight_grad_store`) runs,
while the store is enabled, a matmul whose backward computes only the input gradient (and the bias
gradient) and hands the weight-gradient GEMM to the store as a closure over (input, output
gradient); the schedule runs it later, in a W pass. The weight then enters that matmul detached, so
the backward never touches the parameter's gradient; the store accumulates it through the usual
path (the parameter's gradient hooks, hence the fp32 gradient buffers). Tensor-parallel
communication in backward is unchanged, in the input-gradient pass. FP8 layers defer the same way
(their scaled matmuls take the same ``deferral``; see :mod:`meshtron.layers.fp8`).

In a compiled layer the deferring matmul runs outside the compiled graphs (:func:`_eager`):
its backward's hand-over is a Python side effect that a traced backward graph cannot keep, and the
tensors it keeps for the W pass must be tensors that autograd owns, not buffers of a compiled
backward, which the compiler reuses (and donates the saved activations of) once their last use in
the graph is past. So with the store enabled a compiled layer runs as compiled regions between its
linear layers; without it (1F1B, evaluation) the layer is one graph, as before.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.layers.fp8 import fp8_linear, gradient_dtype
from meshtron.layers.fp8.sequence_parallel import column_sequence_parallel_fp8, row_sequence_parallel_fp8
from meshtron.layers.recompute import recompute_all_but_matmuls
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import Piece, ShardSpec, new_param


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            fp8_format: Optional[str], fp8_recipe: str, wgrad_store=None) -> torch.Tensor:
    defers = _defers(wgrad_store, weight)
    if fp8_format is None:
        if defers:
            return _eager(_LinearDeferredWeightGrad.apply, x, weight.detach(), bias, (wgrad_store, weight))
        return F.linear(x, weight, bias)
    if defers:
        return _eager(fp8_linear, x, weight, bias, fp8_format, fp8_recipe, (wgrad_store, weight))
    return fp8_linear(x, weight, bias, fp8_format, fp8_recipe)


def _defers(wgrad_store, weight: torch.Tensor) -> bool:
    """Whether this forward's backward leaves its weight gradient to ``wgrad_store``."""
    return wgrad_store is not None and wgrad_store.enabled and weight.requires_grad and torch.is_grad_enabled()


@torch.compiler.disable
def _eager(call: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``call(*args)`` (a deferring matmul), always eager: a graph break in a compiled layer (see the
    module docstring), so its backward runs as written and keeps autograd's tensors for the W pass."""
    return call(*args)


def weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dL/dW of ``y = x W^T``: the output gradient's rows times the input's rows, over every token."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _hand_over_weight_grad(deferral: tuple, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """Give the weight-gradient GEMM to the store, to run in this micro-batch's W pass."""
    store, weight = deferral
    store.defer(weight, lambda: weight_grad(grad_out, x))


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """``x W^T + b`` whose backward computes the input and bias gradients and defers the weight's.

    ``weight`` is the parameter detached (the backward must not produce its gradient); ``deferral``
    is (store, parameter), a non-tensor argument, so autograd keeps no edge to the parameter.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, deferral):
        ctx.save_for_backward(x, weight)
        ctx.deferral, ctx.has_bias = deferral, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_input = grad_out @ weight if ctx.needs_input_grad[0] else None
        _hand_over_weight_grad(ctx.deferral, grad_out, x)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0) if ctx.has_bias else None
        return grad_input, None, grad_bias, None


class _ColumnParallelMatmul(torch.autograd.Function):
    """x -> (all-gather over sequence shards) -> x W^T + b, with the backward communication overlapped.

    Backward computes the input gradient first and starts its all-reduce (or, with sequence
    parallelism, reduce-scatter) asynchronously, then computes the weight gradient while the
    collective runs. With sequence parallelism only the local shard of the input is saved and
    re-gathered in backward (overlapped with the input-gradient matmul), as Megatron does.

    ``deferral``: None, or (weight-gradient store, parameter) with ``weight`` the parameter detached:
    the input is still gathered and the input gradient reduced here, and the weight-gradient GEMM
    goes to the store (see the module docstring).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, deferral=None):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.deferral = deferral
        total = comm.all_gather_dim0(x, group) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        # Functional collectives: issued here, waited for where their results are used.
        total = comm.all_gather_dim0_async(x, group) if sp else x
        grad_out = grad_out.contiguous()
        grad_input = grad_out @ weight
        total = comm.wait(total)
        reduced = (comm.reduce_scatter_dim0_async(grad_input, group) if sp
                   else comm.all_reduce_async(grad_input, group))
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.deferral is None:
            grad_weight = flat_grad.t() @ total.reshape(-1, total.shape[-1])
        else:  # the GEMM runs in the W pass; the gathered input is kept for it
            grad_weight = None
            _hand_over_weight_grad(ctx.deferral, grad_out, total)
        grad_bias = flat_grad.sum(dim=0) if ctx.has_bias else None
        return comm.wait(reduced), grad_weight, grad_bias, None, None, None


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows (output features) split over TP.

    ``weight_pieces``/``bias_pieces`` describe this rank's rows as slices of canonical
    tensors (several pieces for fused projections such as QKV or gate+up).
    """

    def __init__(self, ctx: ParallelContext, weight_pieces: Sequence[Piece], bias_pieces: Optional[Sequence[Piece]],
                 sequence_parallel: bool, gather_input: bool = True, grad_sync: Optional[str] = None,
                 tp_replicated: bool = False, group=None):
        super().__init__()
        self.group = ctx.tp_group if group is None else group
        self.sequence_parallel = sequence_parallel
        self.gather_input = gather_input
        self.fp8_format: Optional[str] = None  # set by enable_fp8
        self.fp8_recipe = "tensorwise"
        self.overlap_backward_comm = True  # set by set_tp_comm_overlap (--no-tp-comm-overlap)
        self.wgrad_store = None  # a zero-bubble schedule's weight-gradient store (see the module docstring)
        self.weight = new_param(ShardSpec(tuple(weight_pieces), 0, tp_replicated=tp_replicated, grad_sync=grad_sync))
        self.bias = (new_param(ShardSpec(tuple(bias_pieces), 0, tp_replicated=tp_replicated, grad_sync=grad_sync))
                     if bias_pieces else None)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Enter the tensor-parallel region: all-gather sequence shards, or mark for the backward all-reduce."""
        if not self.gather_input:
            return x
        if self.sequence_parallel:
            return comm.gather_from_sequence(x, self.group, grad_is_partial=True)
        return comm.copy_to_tp(x, self.group)

    def forward(self, x: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        gathers_here = not prepared and self.gather_input and comm.group_size(self.group) > 1
        defers = _defers(self.wgrad_store, self.weight)
        if gathers_here and _sequence_parallel_fp8(self):
            if defers:
                return _eager(column_sequence_parallel_fp8, x, self.weight, self.bias, self.group,
                              gradient_dtype(self.fp8_format), (self.wgrad_store, self.weight))
            return column_sequence_parallel_fp8(x, self.weight, self.bias, self.group,
                                                gradient_dtype(self.fp8_format))
        if gathers_here and self.overlap_backward_comm and self.fp8_format is None:
            if defers:
                return _eager(_ColumnParallelMatmul.apply, x, self.weight.detach(), self.bias, self.group,
                              self.sequence_parallel, (self.wgrad_store, self.weight))
            return _ColumnParallelMatmul.apply(x, self.weight, self.bias, self.group, self.sequence_parallel)
        if not prepared:
            x = self.prepare_input(x)
        return _linear(x, self.weight, self.bias, self.fp8_format, self.fp8_recipe, self.wgrad_store)


class RowParallelLinear(nn.Module):
    """y = sum over TP of x_r W_r^T (+ b), W's columns (input features) split over TP."""

    def __init__(self, ctx: ParallelContext, weight_piece: Piece, bias_piece: Optional[Piece], sequence_parallel: bool):
        super().__init__()
        self.group = ctx.tp_group
        self.sequence_parallel = sequence_parallel
        self.fp8_format: Optional[str] = None  # set by enable_fp8
        self.fp8_recipe = "tensorwise"
        self.wgrad_store = None  # a zero-bubble schedule's weight-gradient store (see the module docstring)
        self.weight = new_param(ShardSpec((weight_piece,), 0))
        # The bias is added after the reduction, so every TP rank holds all of it.
        self.bias = (new_param(ShardSpec((bias_piece,), 0, tp_replicated=True,
                                         grad_sync="tp" if sequence_parallel else None))
                     if bias_piece is not None else None)

    def forward(self, x: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
        """``x @ weight.T`` summed over TP. With ``gate_up`` (SwiGLU's fc2), ``x`` is fc1's output
        [gate, up] and the input of the matmul is ``silu(gate) * up`` (see :meth:`_swiglu_matmul`).

        The SwiGLU variant goes through the module call too (``fc2(h, gate_up=True)``), so that the
        forward pre-hooks that bring the weight (overlapped parameter all-gather, ZeRO-3) run first.
        """
        if gate_up:
            y = self._swiglu_matmul(x)
            if y is not None:
                return y
            x = swiglu(x)
        if comm.group_size(self.group) > 1 and _sequence_parallel_fp8(self):
            deferral = (self.wgrad_store, self.weight) if _defers(self.wgrad_store, self.weight) else None
            if deferral is not None:
                y = _eager(row_sequence_parallel_fp8, x, self.weight, self.group, gradient_dtype(self.fp8_format),
                           deferral)
            else:
                y = row_sequence_parallel_fp8(x, self.weight, self.group, gradient_dtype(self.fp8_format))
            return y if self.bias is None else y + self.bias
        return self.reduce_output(_linear(x, self.weight, None, self.fp8_format, self.fp8_recipe, self.wgrad_store))

    def _swiglu_matmul(self, gate_up: torch.Tensor) -> Optional[torch.Tensor]:
        """``forward(silu(gate) * up)`` for fc1's output ``gate_up`` = [gate, up] without keeping the
        product, or None where the product must be formed and kept (the plain forward then runs).

        Without a weight-gradient store the product is not kept for backward: the matmul's backward
        recomputes it from ``gate_up``, which SiLU's and the product's own gradients need anyway (one
        pointwise pass; the ``f``-wide product is ``2f`` bytes per token in bf16 that the layer no
        longer keeps). FP8 (tensorwise, outside the sequence-parallel FP8 path) recomputes the product
        and its FP8 casts, and the weight's, in backward (:func:`_swiglu_fp8_recomputed`): neither the
        product's one-byte copy nor the weight's stays between forward and backward. Deferring layers,
        rowwise or blockwise FP8, sequence-parallel FP8 and eager FP8 keep the product (their matmuls save their own copies).
        A SwiGLU MLP in FP8 tensorwise without biases does not come here: it runs as one function
        (:func:`fuses_fp8_swiglu`, :mod:`meshtron.layers.fp8.swiglu`), eagerly too.
        """
        if _defers(self.wgrad_store, self.weight):
            return None
        if self.fp8_format is not None:
            sp_fp8 = comm.group_size(self.group) > 1 and _sequence_parallel_fp8(self)
            # Eagerly the checkpoint would replay the scaled matmul as well (its output is not cached
            # inside the FP8 linear's autograd function): eager FP8 keeps the product's one-byte copy.
            if sp_fp8 or self.fp8_recipe != "tensorwise" or not torch.compiler.is_compiling():
                return None
            return self.reduce_output(_swiglu_fp8_recomputed(gate_up, self.weight, self.fp8_format))
        if torch.compiler.is_compiling():
            # The compiler would merge _SwiGLUMatmul's recomputation with the forward's product and keep
            # it: the recomputation is forced instead.
            return self.reduce_output(recompute_all_but_matmuls(_swiglu_linear, gate_up, self.weight))
        return self.reduce_output(_SwiGLUMatmul.apply(gate_up, self.weight))

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the partial products over TP (reduce-scatter to sequence shards under SP), add the bias."""
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence(y, self.group)
        else:
            y = comm.reduce_from_tp(y, self.group)
        if self.bias is not None:
            y = y + self.bias
        return y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product ``silu(gate) * up`` of ``gate_up`` = [gate, up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_fp8_recomputed(gate_up: torch.Tensor, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fp8_linear(swiglu(gate_up), weight)`` whose backward recomputes the product and the FP8 casts
    of it and of the weight (the same values: same inputs, same absolute maxima) instead of keeping
    them; only the scaled matmul's output is never recomputed."""
    return recompute_all_but_matmuls(_swiglu_fp8_linear, gate_up, weight, fmt)


def _swiglu_fp8_linear(gate_up: torch.Tensor, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    return fp8_linear(swiglu(gate_up), weight, None, fmt, "tensorwise")


def _swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(swiglu(gate_up), weight)


class _SwiGLUMatmul(torch.autograd.Function):
    """``swiglu(gate_up) W^T`` that saves ``gate_up`` and recomputes the product in backward.

    The gradients are autograd's own formulas for the same graph (SiLU's backward, the product's,
    the two matmuls), so they equal those of ``F.linear(swiglu(gate_up), W)``.
    """

    @staticmethod
    def forward(ctx, gate_up, weight):
        ctx.save_for_backward(gate_up, weight)
        return _swiglu_linear(gate_up, weight)

    @staticmethod
    def backward(ctx, grad_out):
        gate_up, weight = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        silu = F.silu(gate)
        grad_product = grad_out @ weight
        grad_weight = weight_grad(grad_out, silu * up) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
        return torch.cat([grad_gate, grad_product * silu], dim=-1), grad_weight


def fuses_fp8_swiglu(fc1: ColumnParallelLinear, fc2: RowParallelLinear) -> bool:
    """Whether a SwiGLU block's two linears run as one FP8 function (:mod:`meshtron.layers.fp8.swiglu`): both
    FP8 tensorwise in the same format, no biases, not on the sequence-parallel FP8 path (which casts before
    its collectives), no zero-bubble weight-gradient deferral."""
    return (fc1.fp8_format is not None and fc1.fp8_format == fc2.fp8_format
            and fc1.fp8_recipe == fc2.fp8_recipe == "tensorwise" and fc1.bias is None and fc2.bias is None
            and not (fc1.sequence_parallel and comm.group_size(fc1.group) > 1)
            and not _defers(fc1.wgrad_store, fc1.weight) and not _defers(fc2.wgrad_store, fc2.weight))


def _sequence_parallel_fp8(layer: nn.Module) -> bool:
    """Whether ``layer`` takes the FP8 path that casts before its sequence-parallel collective
    (tensorwise scaling; see meshtron.layers.fp8.sequence_parallel)."""
    return layer.sequence_parallel and layer.fp8_format is not None and layer.fp8_recipe == "tensorwise"


def set_tp_comm_overlap(model: nn.Module, enabled: bool) -> None:
    """Choose, for every column-parallel layer of ``model``, whether its backward collective overlaps
    the weight-gradient matmul (on) or runs through the plain communication functions (off)."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.overlap_backward_comm = enabled


def enable_fp8(model: nn.Module, fmt: str, recipe: str = "tensorwise", experts: bool = False) -> int:
    """Switch every tensor-parallel linear of the transformer layers to FP8, and with ``experts`` the MoE layers'
    routed experts too; returns how many linears (the experts' modules not counted).

    The output layer (fused with the loss) and the MoE router stay in higher precision. The experts
    (:class:`meshtron.layers.moe.experts.GroupedExperts`) are found by their ``set_fp8`` method, so that this module
    need not import the MoE package (which imports it). It lives here, beside the linears it switches, so that the
    FP8 kernels below need not know the layer classes.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8_format, module.fp8_recipe = fmt, recipe
            count += 1
        elif experts and callable(getattr(module, "set_fp8", None)):
            module.set_fp8(fmt, recipe)
    return count
