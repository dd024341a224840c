"""Token permutation to expert order, expert-parallel all-to-all dispatch, and the combine back.

Each of the T tokens has k assignments (token t, choice j) -> expert ``indices[t, j]``.
Assignments are sorted by expert with one stable argsort (dropped ones sort last and
are cut off), so that every expert's tokens are contiguous. Without expert parallelism
that is the experts' input. With EP, rank r holds experts ``[r*El, (r+1)*El)``, so the
sorted assignments are already grouped by destination rank:

1. the per-expert counts are exchanged with one ``all_to_all_single`` (every rank learns
   how many rows it receives from each rank for each of its local experts);
2. the rows travel with ``all_to_all_single`` and those split sizes (an autograd
   function whose backward is the reverse all-to-all);
3. received rows, ordered [source rank][local expert], are regrouped by local expert
   with a second stable argsort.

The combine runs the same steps backwards, then each assignment's output is weighted
by its combine weight and summed per token (a dropped assignment adds zero). Only
the split sizes of the all-to-all cross to the host (one device-to-host copy per layer
and micro-batch, as in Megatron-LM); without EP and without capacity dropping no
host synchronisation happens on the grouped-GEMM path.

With a capacity C (``--moe-expert-capacity-factor``) and
``--moe-pad-expert-input-to-capacity``, every expert receives exactly C rows from every
rank: kept assignments fill their expert's slots in dispatch order, the rest of the slots
are zero rows. All sizes are then known from the shapes, so the all-to-alls have equal
splits and nothing crosses to the host; the experts compute on the zero rows too, whose
outputs are never read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.layers.moe.slots import GatherToSlots, RowsAt, SumFromSlots

Group = Optional[dist.ProcessGroup]


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    """Rows of ``x`` split by ``input_splits`` go to the ranks of ``group``; returns the received rows."""
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all with split sizes; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def differentiable_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                              group: Group) -> torch.Tensor:
    return _AllToAll.apply(x, output_splits, input_splits, group)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# The autograd of ``index_select`` scatters its gradient back with an atomic ``index_add_``: in bf16, with every
# token's row read k times, that one kernel took 14% of a fine-grained MoE step on an H200 (128 experts, top-8).
# Both directions of the two functions below are gathers (and a sum over the k copies of a token), so they run
# at memory bandwidth, accumulate each token's k gradients in fp32 and are deterministic.


class _ExpandTokens(torch.autograd.Function):
    """``x[order // k]`` for a permutation ``order`` of the T*k assignments: each token's row k times, in
    expert order. Backward: the gradient rows back in assignment order, summed over each token's k copies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        per_assignment = grad.index_select(0, inverse)
        grad_x = per_assignment.view(-1, ctx.k, grad.shape[-1]).sum(1, dtype=torch.float32).to(grad.dtype)
        return grad_x, None, None, None


class _PermuteRows(torch.autograd.Function):
    """``y[perm]`` for a permutation ``perm`` (with ``inverse`` its inverse); backward: ``grad[inverse]``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return y.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def weighted_sum(rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``sum_j probs[t, j] * rows[t, j]`` -> [T, H] for ``rows`` [T, k, H]: one batched matmul, whose
    backward is two more, instead of an element-wise product over [T, k, H] and a reduction (each a
    full pass over the k copies, forward and backward)."""
    return torch.bmm(probs.to(rows.dtype).unsqueeze(1), rows).squeeze(1)


def expand_tokens(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's row once per assignment, in the assignments' ``order`` (a permutation of T*k)."""
    return _ExpandTokens.apply(x, order, inverse, k)


def permute_rows(y: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``y[perm]`` with a gather for its gradient as well (``inverse``: the inverse permutation)."""
    return _PermuteRows.apply(y, perm, inverse)


@dataclass
class DispatchState:
    """What the combine needs to undo a dispatch.

    ``order``: the kept assignments (flat index t*k + j) in expert order; ``complete``: whether
    every assignment was kept (then ``order`` is a permutation). With EP: the split sizes and
    the regrouping permutation of the received rows (None when there is one local expert).
    """

    num_tokens: int
    order: torch.Tensor
    complete: bool
    inverse: Optional[torch.Tensor] = None  # of ``order`` when it is a permutation (complete)
    send_splits: Optional[list[int]] = None
    recv_splits: Optional[list[int]] = None
    regroup: Optional[torch.Tensor] = None
    slot_of_assignment: Optional[torch.Tensor] = None  # padded dispatch: each assignment's row (E*C: dropped)
    capacity: Optional[int] = None


class TokenDispatcher:
    """Moves token rows to the (local or remote) experts they are routed to and back.

    ``num_experts`` in total, ``num_local`` on this rank, ``ep_group`` the expert-parallel
    group (None without EP); rank r of it holds experts ``[r*num_local, (r+1)*num_local)``.
    """

    def __init__(self, num_experts: int, num_local: int, ep_group: Group):
        self.num_experts = num_experts
        self.num_local = num_local
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        assert num_experts == num_local * self.ep, (num_experts, num_local, self.ep)

    @torch.compiler.disable  # data-dependent sizes and collectives: runs eagerly inside a compiled layer
    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, keep: Optional[torch.Tensor],
                 pad_to_capacity: Optional[int] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[int]], DispatchState]:
        """Returns (rows grouped by local expert, rows per local expert [El] on the device,
        the same as a host list when it had to be known on the host (else None), state).

        ``pad_to_capacity``: the capacity C of every expert; each then gets exactly C rows per rank.
        """
        if pad_to_capacity is not None:
            return self._dispatch_padded(x, indices, keep, pad_to_capacity)
        T, k = indices.shape
        flat_e = indices.reshape(-1)
        if keep is not None:
            flat_e = torch.where(keep.reshape(-1), flat_e, torch.full_like(flat_e, self.num_experts))
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.num_experts + 1)[: self.num_experts]

        if self.ep == 1:
            host = None
            if keep is not None:  # the kept rows' count decides the shape: one host copy
                host = counts.tolist()
                order = order[: sum(host)]
                return x.index_select(0, order // k), counts, host, DispatchState(T, order, False)
            inverse = inverse_permutation(order)
            return expand_tokens(x, order, inverse, k), counts, host, DispatchState(T, order, True, inverse=inverse)

        El, ep = self.num_local, self.ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # El counts to and from each rank
        host_counts = torch.stack([counts, recv_counts]).cpu()  # the one device-to-host copy
        send_splits = host_counts[0].view(ep, El).sum(1).tolist()
        recv_splits = host_counts[1].view(ep, El).sum(1).tolist()
        kept = sum(send_splits)
        complete = keep is None
        inverse = None
        if complete:
            inverse = inverse_permutation(order)
            expanded = expand_tokens(x, order, inverse, k)
        else:
            order = order[:kept]
            expanded = x.index_select(0, order // k)
        rows = differentiable_all_to_all(expanded, recv_splits, send_splits, self.ep_group)
        per_local = recv_counts.view(ep, El).sum(0)
        host_per_local = host_counts[1].view(ep, El).sum(0).tolist()
        regroup = None
        if El > 1:  # received as [source rank][local expert]: regroup by local expert
            expert_of_row = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(ep), recv_counts,
                                                    output_size=sum(recv_splits))
            regroup = torch.argsort(expert_of_row, stable=True)
            rows = permute_rows(rows, regroup, inverse_permutation(regroup))
        state = DispatchState(T, order, complete, inverse, send_splits, recv_splits, regroup)
        return rows, per_local, host_per_local, state

    def _dispatch_padded(self, x: torch.Tensor, indices: torch.Tensor, keep: Optional[torch.Tensor],
                         capacity: int) -> tuple[torch.Tensor, torch.Tensor, list[int], DispatchState]:
        T, k = indices.shape
        E, El, ep, C = self.num_experts, self.num_local, self.ep, capacity
        flat_e = indices.reshape(-1)
        if keep is not None:
            flat_e = torch.where(keep.reshape(-1), flat_e, torch.full_like(flat_e, E))
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E + 1)
        sorted_e = flat_e[order]
        position = torch.arange(T * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
        # Row of each sorted assignment in the [E * C] send buffer; dropped ones (and, should an expert
        # get more than C, the overflow) go to one spare row E * C that is cut off.
        sorted_slot = torch.where((sorted_e < E) & (position < C), sorted_e * C + position,
                                  torch.full_like(position, E * C))
        slot_of_assignment = torch.empty_like(sorted_slot).index_copy_(0, order, sorted_slot)
        rows = GatherToSlots.apply(x, slot_of_assignment, E * C + 1, k)[:-1]  # gathers both ways (slots.py)
        if ep > 1:  # rank r's experts are rows [r*El*C, (r+1)*El*C): equal splits
            splits = [El * C] * ep
            rows = differentiable_all_to_all(rows, splits, splits, self.ep_group)
            # received as [source rank][local expert][slot]: group by local expert
            rows = rows.view(ep, El, C, -1).transpose(0, 1).reshape(El * ep * C, -1)
        per_local = [ep * C] * El
        state = DispatchState(T, order, keep is None, slot_of_assignment=slot_of_assignment, capacity=C)
        return rows, torch.full((El,), ep * C, device=x.device), per_local, state

    @torch.compiler.disable
    def dispatch_weights(self, probs: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """The combine weights ``probs`` [T, k] moved like the rows of the :meth:`dispatch` that made ``state``:
        one fp32 weight per dispatched row (zero for padding), differentiable back to ``probs``. For experts that
        weigh their rows themselves (then :meth:`combine` with ``weighted=False``)."""
        flat = probs.float().reshape(-1)
        if state.slot_of_assignment is not None:  # padded to capacity: the send buffer's slots, then as the rows
            E, El, ep, C = self.num_experts, self.num_local, self.ep, state.capacity
            weights = flat.new_zeros(E * C + 1).index_copy(0, state.slot_of_assignment, flat)[:-1]
            if ep > 1:
                splits = [El * C] * ep
                weights = differentiable_all_to_all(weights, splits, splits, self.ep_group)
                weights = weights.view(ep, El, C).transpose(0, 1).reshape(-1)
            return weights
        if state.complete:
            weights = permute_rows(flat, state.order, state.inverse)
        else:
            weights = flat.index_select(0, state.order)
        if self.ep > 1:
            weights = differentiable_all_to_all(weights, state.recv_splits, state.send_splits, self.ep_group)
            if state.regroup is not None:
                weights = permute_rows(weights, state.regroup, inverse_permutation(state.regroup))
        return weights

    def _combine_padded(self, y: torch.Tensor, probs: torch.Tensor, state: DispatchState,
                        weighted: bool = True) -> torch.Tensor:
        El, ep, C = self.num_local, self.ep, state.capacity
        if ep > 1:
            y = y.view(El, ep, C, -1).transpose(0, 1).reshape(ep * El * C, -1)
            splits = [El * C] * ep
            y = differentiable_all_to_all(y, splits, splits, self.ep_group)
        y = torch.cat([y, y.new_zeros((1, y.shape[-1]))])  # the spare row: dropped assignments read zeros
        T, k = probs.shape
        if not weighted:
            return SumFromSlots.apply(y, state.slot_of_assignment, k)
        return weighted_sum(RowsAt.apply(y, state.slot_of_assignment).view(T, k, -1), probs)

    @torch.compiler.disable
    def combine(self, y: torch.Tensor, probs: torch.Tensor, state: DispatchState, weighted: bool = True
                ) -> torch.Tensor:
        """Expert outputs ``y`` (rows as dispatched) back to tokens: ``sum_j probs[t, j] * y[t, j]`` -> [T, H].

        ``weighted=False``: the experts already weighed their rows (:meth:`dispatch_weights`): a plain sum over
        each token's k rows, which keeps nothing for backward (the weighted sum keeps every row)."""
        if state.slot_of_assignment is not None:
            return self._combine_padded(y, probs, state, weighted)
        if self.ep > 1:
            if state.regroup is not None:
                y = permute_rows(y, inverse_permutation(state.regroup), state.regroup)
            y = differentiable_all_to_all(y, state.send_splits, state.recv_splits, self.ep_group)
        T, k = probs.shape
        if state.complete:
            per_assignment = permute_rows(y, state.inverse, state.order)
        else:  # dropped assignments stay zero
            per_assignment = y.new_zeros((T * k, y.shape[-1])).index_copy(0, state.order, y)
        return _sum_per_token(per_assignment.view(T, k, -1), probs, weighted)


def _sum_per_token(rows: torch.Tensor, probs: torch.Tensor, weighted: bool) -> torch.Tensor:
    """Each token's sum over its k rows [T, k, H], weighted by ``probs`` [T, k] or plain (summed in fp32)."""
    if weighted:
        return weighted_sum(rows, probs)
    return rows.sum(1, dtype=torch.float32).to(rows.dtype)
