"""Context-parallel attention: a rank's queries against the keys of every CP rank.

Each CP rank holds two chunks of the sequence (chunk ``r`` and ``2 CP - 1 - r``,
:mod:`meshtron.parallel.context_parallel.split`) and computes attention for its own queries. The
keys and values of the other ranks reach it in one of two ways:

* ``p2p`` (ring attention, the default): the key/value block of each rank travels
  around the CP ring, one hop per step, with batched ``isend``/``irecv``. The next
  hop is posted before the current block is computed, so communication overlaps
  compute. After CP steps every rank has seen every block. Backward circulates the
  blocks again, and their key/value gradients travel with them and arrive home
  after the last step.
* ``allgather``: keys and values are all-gathered once (overlapped with the local
  diagonal blocks), every local query chunk attends to its causal prefix, and
  backward reduce-scatters the key/value gradients.
* ``a2a`` (DeepSpeed-Ulysses): one all-to-all each for q, k and v turns
  [local tokens, all heads] into [whole sequence, heads / CP]; the rows are put back
  in sequence order (undoing the load-balanced split), the same SDPA call as without
  CP attends (causal or the whole sequence's document mask), and one all-to-all
  returns the output. Key/value heads that do not split over CP are repeated.
* ``a2a+p2p`` (hierarchical, ``--hierarchical-context-parallel-sizes A B``): the
  all-to-all runs inside groups of A consecutive CP ranks; the group's tokens are
  then exactly the load-balanced share of a ring of B ranks (chunks of A x c tokens),
  and ring attention runs across the B groups on the exchanged heads.

Partial results of the blocks are merged exactly through their log-sum-exp, so the
output equals full causal attention up to floating-point rounding. Traffic is at
the key/value (query-group) size, so grouped-query attention sends ``groups/heads``
of what multi-head attention would. Values may have another head dim than keys
(multi-latent attention): keys and values travel packed side by side in one buffer. Document masks (``--reset-attention-mask``) work
with both: the document ids of every rank are all-gathered once per forward (one
integer per token) and each block gets its :class:`~meshtron.layers.documents.DocumentMask`: on CUDA the
block runs flex attention with that block mask (:class:`~meshtron.parallel.context_parallel.kernels.FlexKernel`,
no mask tensor), elsewhere (or with ``MESHTRON_DOCUMENT_ATTENTION=dense``) the mask is expanded for the kernel.

Attention with sinks (gpt-oss, ``sinks`` and ``window`` of :func:`context_parallel_attention`): the ring's and
the all-gather's blocks merge as above, each block masked by the sliding window at the split's sequence
positions (a :class:`~meshtron.layers.documents.DocumentMask` with a window; blocks it hides entirely are
skipped), and the sink joins each row's merged log-sum-exp once as a key of value zero; ``a2a`` slices the
sinks with the heads and calls the one-device sink kernel.

Which blocks a rank computes is decided by :func:`ring_plan` / :func:`allgather_plan`
(also used by the tests to check that the causal work is balanced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.cp_comm_types import (COMM_TYPES, a2a_degree, a2a_kv_replicas,  # noqa: F401 (re-exported)
                                    check_a2a_heads, check_comm_type, single_comm_type)
from meshtron.layers.documents import DocumentMask
from meshtron.layers.sdpa import core_attention
from meshtron.layers.sink_kernel import sink_attention
from meshtron.parallel.context_parallel.kernels import kernel_mask, select_kernel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.split import chunk_ids, chunk_owner, local_token_indices

_KV_TAG, _DKV_TAG = 11, 12  # distinct tags: gloo matches messages between two ranks by tag


# ----------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Block:
    """One attention call: local query rows against a range of keys, in units of chunks.

    ``source`` is the CP rank whose local keys ``k_rows`` indexes (chunks 0..2 of its
    local sequence); ``source`` None means global chunks of the all-gathered sequence.
    """

    source: Optional[int]
    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    causal: bool

    def pairs(self, chunk: int) -> int:
        """Query-key pairs computed (the causal diagonal counts its lower triangle)."""
        nq = (self.q_rows[1] - self.q_rows[0]) * chunk
        nk = (self.k_rows[1] - self.k_rows[0]) * chunk
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def ring_plan(cp: int, rank: int) -> list[Block]:
    """The block of each ring step (step i uses the keys of CP rank ``rank - i``).

    Own keys: causal over both local chunks. Keys of an earlier rank j < r: all local
    queries see its first chunk (j) and not its second (2CP-1-j, later than both of
    ours). Keys of a later rank j > r: only our second chunk sees them, all of them.
    Every step is c x 2c pairs (the diagonal c (2c + 1)), so all ranks do equal work.
    """
    blocks = []
    for step in range(cp):
        j = (rank - step) % cp
        if j == rank:
            blocks.append(Block(j, (0, 2), (0, 2), True))
        elif j < rank:
            blocks.append(Block(j, (0, 2), (0, 1), False))
        else:
            blocks.append(Block(j, (1, 2), (0, 2), False))
    return blocks


def allgather_plan(cp: int, rank: int) -> list[Block]:
    """Blocks of the all-gather variant: the two local causal diagonals (computed while the
    gather runs), then each local chunk against every earlier chunk of the sequence."""
    second = 2 * cp - 1 - rank
    blocks = [Block(rank, (0, 1), (0, 1), True), Block(rank, (1, 2), (1, 2), True)]
    if rank > 0:
        blocks.append(Block(None, (0, 1), (0, rank), False))
    blocks.append(Block(None, (1, 2), (0, second), False))
    return blocks


def plan_pairs(plan: list[Block], chunk: int) -> int:
    return sum(b.pairs(chunk) for b in plan)


# ----------------------------------------------------------------------------------------------- inputs
@dataclass
class ContextParallelInputs:
    """What a layer's context-parallel attention needs besides q, k, v; built once per model forward."""

    group: dist.ProcessGroup
    cp: int
    rank: int
    comm_type: str
    document_ids: Optional[torch.Tensor] = None  # [cp, batch, local seq]: every rank's local document ids
    # a2a and a2a+p2p: the group whose ranks exchange heads for sequence, its size and this rank's place in it
    a2a_group: Optional[dist.ProcessGroup] = None
    a2a_size: int = 1
    a2a_rank: int = 0
    ring: Optional["ContextParallelInputs"] = None  # a2a+p2p: the ring across a2a groups (after the exchange)

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank + 1) % self.cp)

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.cp)


def context_parallel_inputs(ctx: ParallelContext, comm_type: str,
                            document_ids: Optional[torch.Tensor] = None,
                            a2a_size: Optional[int] = None) -> ContextParallelInputs:
    """Inputs for :func:`context_parallel_attention` from this rank's local ``document_ids`` [b, local seq].

    ``a2a_size``: the ranks of one all-to-all group under ``a2a+p2p`` (A of
    ``--hierarchical-context-parallel-sizes A B``; its groups come from :func:`cp_subgroups`, made when the
    model was built)."""
    check_comm_type(comm_type)
    if ctx.cp_group is None:
        raise ValueError("context-parallel attention needs a CP process group (--context-parallel-size > 1)")
    docs = None
    if document_ids is not None:
        local = document_ids.contiguous()
        docs = local.new_empty((ctx.cp * local.shape[0],) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(docs, local, group=ctx.cp_group)
        docs = docs.view((ctx.cp,) + tuple(local.shape))
    a = ctx.cp if comm_type == "a2a" else (a2a_size or ctx.cp) if comm_type == "a2a+p2p" else 1
    if comm_type == "a2a+p2p" and a == 1:
        comm_type = "p2p"  # groups of one rank: the ring alone
    if comm_type == "a2a+p2p" and a == ctx.cp:
        comm_type = "a2a"  # one group: all-to-all alone
    inputs = ContextParallelInputs(ctx.cp_group, ctx.cp, ctx.cp_rank, comm_type, docs)
    if comm_type == "a2a":
        inputs.a2a_group, inputs.a2a_size, inputs.a2a_rank = ctx.cp_group, ctx.cp, ctx.cp_rank
    elif comm_type == "a2a+p2p":
        a2a_group, ring_group = cp_subgroups(ctx, a)
        b = ctx.cp // a
        inputs.a2a_group, inputs.a2a_size, inputs.a2a_rank = a2a_group, a, ctx.cp_rank % a
        ring_docs = None
        if docs is not None:  # every ring rank's tokens after the exchange, as the ring of B ranks holds them
            ring_docs = _rank_order(_global_order(docs).unsqueeze(-1), b).squeeze(-1)
        inputs.ring = ContextParallelInputs(ring_group, b, ctx.cp_rank // a, "p2p", ring_docs)
    return inputs


def cp_subgroups(ctx: ParallelContext, a2a_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(all-to-all group, ring group) of this rank for hierarchical CP with all-to-all groups of ``a2a_size``
    consecutive CP ranks: CP rank ``r`` is member ``r % A`` of all-to-all group ``r // A`` and member ``r // A``
    of ring ``r % A``. Created once (cached on the context); every rank must call this in the same order, so
    the model calls it when it is built."""
    cache = ctx.later_groups.cp
    if a2a_size not in cache:
        from meshtron.parallel.context import _groups_varying, _new_groups, rank_grid

        grid = rank_grid(ctx.tp, ctx.cp, ctx.dp, ctx.pp)
        cp_groups = _groups_varying(grid, (2,))
        a2a = [g[i:i + a2a_size] for g in cp_groups for i in range(0, ctx.cp, a2a_size)]
        ring = [g[i::a2a_size] for g in cp_groups for i in range(a2a_size)]
        cache[a2a_size] = (_new_groups(a2a, ctx.rank, None, ctx.timeout), _new_groups(ring, ctx.rank, None, ctx.timeout))
    return cache[a2a_size]


# ----------------------------------------------------------------------------------------------- helpers
def _rows(span: tuple[int, int], chunk: int) -> slice:
    return slice(span[0] * chunk, span[1] * chunk)


@dataclass(frozen=True)
class _KVLayout:
    """Keys [b, g, s, dk] and values [b, g, s, dv] side by side in one contiguous [b, s, g dk + g dv]
    buffer (one message per hop; dk and dv may differ)."""

    groups: int
    dk: int
    dv: int

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> "_KVLayout":
        return _KVLayout(k.shape[1], k.shape[-1], v.shape[-1])

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = k.shape
        return torch.cat([k.transpose(1, 2).reshape(b, s, -1), v.transpose(1, 2).reshape(b, s, -1)], dim=-1)

    def unpack(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [b, g, s, dk] and [b, g, s, dv] of a packed [b, s, width] buffer (or a row range of one)."""
        k, v = torch.split(kv, [self.groups * self.dk, self.groups * self.dv], dim=-1)
        return (k.unflatten(-1, (self.groups, self.dk)).transpose(1, 2),
                v.unflatten(-1, (self.groups, self.dv)).transpose(1, 2))


def _global_order(gathered: torch.Tensor) -> torch.Tensor:
    """[cp, b, 2c, ...] as gathered by rank -> [b, S, ...] in sequence order (rows of width, or token values)."""
    cp, c = gathered.shape[0], gathered.shape[2] // 2
    parts = []
    for chunk in range(2 * cp):
        owner, half = chunk_owner(chunk, cp)
        parts.append(gathered[owner, :, half * c:(half + 1) * c])
    return torch.cat(parts, dim=1)


def _rank_order(full: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of :func:`_global_order`: [b, S, width] -> [cp, b, 2c, width] (contiguous)."""
    c = full.shape[1] // (2 * cp)
    return torch.stack([torch.cat([full[:, j * c:(j + 1) * c], full[:, (2 * cp - 1 - j) * c:(2 * cp - j) * c]],
                                  dim=1) for j in range(cp)])


class _Masks:
    """Masks of the blocks beyond causality: documents and a sliding window (None everywhere without either)."""

    def __init__(self, inputs: ContextParallelInputs, seq_local: int, device: torch.device,
                 window: Optional[int] = None, batch: int = 1):
        self.docs, self.window, self.batch = inputs.document_ids, window, batch
        self.cp, self.rank, self.chunk = inputs.cp, inputs.rank, seq_local // 2
        self.masked = self.docs is not None or window is not None
        if self.masked:
            self.positions = [local_token_indices(seq_local, self.cp, j, device) for j in range(self.cp)]
            self.global_docs = None if self.docs is None else _global_order(self.docs)

    def _positions(self, b: Block) -> tuple[slice, torch.Tensor, slice, torch.Tensor]:
        q_rows, k_rows = _rows(b.q_rows, self.chunk), _rows(b.k_rows, self.chunk)
        q_pos = self.positions[self.rank][q_rows]
        if b.source is None:
            k_pos = torch.arange(k_rows.start, k_rows.stop, device=q_pos.device)
        else:
            k_pos = self.positions[b.source][k_rows]
        return q_rows, q_pos, k_rows, k_pos

    def empty(self, b: Block) -> bool:
        """Whether the window hides every key of ``b`` from every query of it (the block is skipped)."""
        if self.window is None:
            return False
        c = self.chunk  # from the chunks' numbers (no device tensor is read)
        q_first = min(chunk_ids(self.cp, self.rank)[i] for i in range(*b.q_rows)) * c
        if b.source is None:  # global chunks
            k_last = b.k_rows[1] * c - 1
        else:
            k_last = (max(chunk_ids(self.cp, b.source)[i] for i in range(*b.k_rows)) + 1) * c - 1
        return q_first - k_last >= self.window

    def block(self, b: Block) -> Optional[DocumentMask]:
        """Same document, not in the future and within the window (by sequence index), as a
        :class:`DocumentMask` (the kernel takes its flex block mask, or its boolean [batch, 1, sq, sk]:
        :func:`kernel_mask`); without documents every token is of one document."""
        if not self.masked:
            return None
        q_rows, q_pos, k_rows, k_pos = self._positions(b)
        if self.docs is None:
            q_doc = torch.zeros(self.batch, q_pos.numel(), dtype=torch.int32, device=q_pos.device)
            k_doc = torch.zeros(self.batch, k_pos.numel(), dtype=torch.int32, device=q_pos.device)
        else:
            q_doc = self.docs[self.rank][:, q_rows]
            k_doc = self.global_docs[:, k_rows] if b.source is None else self.docs[b.source][:, k_rows]
        return DocumentMask(q_doc, k_doc, q_pos, k_pos, window=self.window)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Fold a block's (output, lse) into the running fp32 ones for ``rows``, in place."""
    o_old, l_old = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l_old, lse_blk)
    o_old.mul_(torch.exp(l_old - new).unsqueeze(-1))
    o_old.add_(o_blk.float() * torch.exp(lse_blk - new).unsqueeze(-1))
    l_old.copy_(new)


def _accumulators(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running fp32 output [b, h, s, dv] (value head dim) and log-sum-exp [b, h, s]."""
    b, h, s, _ = q.shape
    out = torch.zeros(b, s, h, dv, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _exchange(inputs: ContextParallelInputs, sends: list[tuple[torch.Tensor, int]],
              recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Post sends to the next CP rank and receives from the previous one as one batch."""
    if not sends and not recvs:
        return []
    nxt, prev = inputs.next_rank, inputs.prev_rank
    ops = [dist.P2POp(dist.isend, t, nxt, inputs.group, tag) for t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, prev, inputs.group, tag) for t, tag in recvs]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _Blocks:
    """One rank's block computations, shared by both communication types: its two query chunks,
    their document and window masks, the attention kernel, and the per-block kernel states that backward
    reuses. A block the window hides entirely is skipped (no visible pair: nothing to merge, no gradient)."""

    def __init__(self, q: torch.Tensor, layout: _KVLayout, inputs: ContextParallelInputs, dropout_p: float,
                 scale: float, window: Optional[int] = None):
        self.inputs, self.layout, self.dropout_p, self.scale = inputs, layout, dropout_p, scale
        self.c = q.shape[2] // 2
        self.masks = _Masks(inputs, q.shape[2], q.device, window, q.shape[0])
        self.kernel = select_kernel(q, self.masks.masked, layout.dv, dropout_p)
        self.states: list = []

    def kv(self, source: torch.Tensor, block: Block):
        """Keys and values of ``block`` from a packed [b, s, width] source."""
        return self.layout.unpack(source[:, _rows(block.k_rows, self.c)])

    def forward(self, block: Block, q, kb, vb, out, lse) -> None:
        """Attend ``block``'s query rows to ``kb``/``vb`` and merge the result into ``out``/``lse``."""
        if self.masks.empty(block):
            self.states.append(None)
            return
        rows = _rows(block.q_rows, self.c)
        o_b, lse_b, state = self.kernel.forward(q[:, :, rows], kb, vb, block.causal,
                                                kernel_mask(self.kernel, self.masks.block(block)), self.dropout_p,
                                                self.scale)
        _merge(out, lse, rows, o_b, lse_b)
        self.states.append(state)

    def backward(self, step: int, block: Block, dout, q, kb, vb, out, lse, dq):
        """Add ``block``'s query gradient into ``dq``; return (key rows, dk, dv) of the block (None when
        the block was skipped)."""
        if self.masks.empty(block):
            return None
        rows = _rows(block.q_rows, self.c)
        dq_b, dk_b, dv_b = self.kernel.backward(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                                lse[:, :, rows], block.causal,
                                                kernel_mask(self.kernel, self.masks.block(block)), self.dropout_p, self.scale, self.states[step])
        dq[:, :, rows] += dq_b
        return _rows(block.k_rows, self.c), dk_b, dv_b


def _start_forward(q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float,
                   window: Optional[int] = None):
    """(blocks, this rank's keys and values packed in one buffer, zeroed output and log-sum-exp accumulators):
    what both schedules' forwards begin with."""
    layout = _KVLayout.of(k, v)
    out, lse = _accumulators(q, v.shape[-1])
    return _Blocks(q, layout, inputs, dropout_p, scale, window), layout.pack(k, v), out, lse


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Merge each head's sink logit into the rows once, as one more key whose value is zero: the output
    scales by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``, in place; returns ``lse'``.

    The blocks' backward then takes ``lse'`` as the row's log-sum-exp, so their gradients are those of the
    softmax with the sink in its denominator (see :func:`_sink_grad`)."""
    if sinks is None:
        return lse
    total = torch.logaddexp(lse, sinks.float()[None, :, None])
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    return total


def _sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sink logits: the sink key has probability ``p = exp(sink - lse')`` and a zero value, so
    its score's gradient is ``-p rowsum(dout * out)``, summed over the batch and this rank's queries."""
    delta = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)


def _save_forward(ctx, blocks: _Blocks, q, kv, out, lse, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    lse = _fold_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    ctx.save_for_backward(q, kv, out, lse, *(() if sinks is None else (sinks,)))
    ctx.blocks = blocks
    return out


def _saved(ctx):
    """(q, kv, out, lse, sinks or None) saved by :func:`_save_forward`."""
    q, kv, out, lse, *sinks = ctx.saved_tensors
    return q, kv, out, lse, (sinks[0] if sinks else None)


def _add_kv_grad(target: torch.Tensor, layout: _KVLayout, grads) -> None:
    """Add a block's (key rows, dk, dv) into a packed gradient (nothing for a skipped block: None)."""
    if grads is not None:
        k_rows, dk_b, dv_b = grads
        target[:, k_rows] += layout.pack(dk_b, dv_b)


def _unpack_grads(dkv: torch.Tensor, layout: _KVLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dk, dv = layout.unpack(dkv)
    return dk.to(dtype), dv.to(dtype)


# ----------------------------------------------------------------------------------------------- ring
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float,
                sinks: Optional[torch.Tensor] = None, window: Optional[int] = None):
        blocks, kv, out, lse = _start_forward(q, k, v, inputs, dropout_p, scale, window)
        cur = kv
        for step, block in enumerate(ring_plan(inputs.cp, inputs.rank)):
            nxt, works = None, []
            if step < inputs.cp - 1:  # post the next hop before computing this block
                nxt = torch.empty_like(cur)
                works = _exchange(inputs, [(cur, _KV_TAG)], [(nxt, _KV_TAG)])
            blocks.forward(block, q, *blocks.kv(cur, block), out, lse)
            _wait(works)
            cur = nxt
        return _save_forward(ctx, blocks, q, kv, out, lse, sinks)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, sinks = _saved(ctx)
        blocks: _Blocks = ctx.blocks
        inputs = blocks.inputs
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur, dkv_out = kv, None
        for step, block in enumerate(ring_plan(inputs.cp, inputs.rank)):
            sends, recvs, nxt, dkv_in = [], [], None, None
            if step < inputs.cp - 1:
                nxt = torch.empty_like(cur)
                sends.append((cur, _KV_TAG))
                recvs.append((nxt, _KV_TAG))
            if step > 0:  # the previous block's gradient follows its keys to the next rank
                dkv_in = torch.empty_like(dkv_out)
                sends.append((dkv_out, _DKV_TAG))
                recvs.append((dkv_in, _DKV_TAG))
            works = _exchange(inputs, sends, recvs)
            grads = blocks.backward(step, block, dout, q, *blocks.kv(cur, block), out, lse, dq)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            _add_kv_grad(dkv, blocks.layout, grads)
            _wait(works)
            if dkv_in is not None:
                dkv += dkv_in
            dkv_out, cur = dkv, nxt
        home = torch.empty_like(dkv_out)
        _wait(_exchange(inputs, [(dkv_out, _DKV_TAG)], [(home, _DKV_TAG)]))
        dk, dv = _unpack_grads(home, blocks.layout, kv.dtype)
        dsinks = None if sinks is None else _sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk, dv, None, None, None, dsinks, None


# ----------------------------------------------------------------------------------------------- all-gather
def _gather_kv(kv: torch.Tensor, inputs: ContextParallelInputs):
    gathered = kv.new_empty((inputs.cp * kv.shape[0],) + tuple(kv.shape[1:]))
    work = dist.all_gather_into_tensor(gathered, kv, group=inputs.group, async_op=True)
    return gathered.view((inputs.cp,) + tuple(kv.shape)), work


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float,
                sinks: Optional[torch.Tensor] = None, window: Optional[int] = None):
        blocks, kv, out, lse = _start_forward(q, k, v, inputs, dropout_p, scale, window)
        gathered, work = _gather_kv(kv, inputs)
        full = None
        for block in allgather_plan(inputs.cp, inputs.rank):
            if block.source is None and full is None:  # the local diagonals ran while the gather did
                work.wait()
                full = _global_order(gathered)
            blocks.forward(block, q, *blocks.kv(kv if block.source is not None else full, block), out, lse)
        return _save_forward(ctx, blocks, q, kv, out, lse, sinks)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, sinks = _saved(ctx)
        blocks: _Blocks = ctx.blocks
        inputs = blocks.inputs
        gathered, work = _gather_kv(kv, inputs)  # gathered again rather than kept: CP x less memory
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        d_local = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        full = d_full = None
        for step, block in enumerate(allgather_plan(inputs.cp, inputs.rank)):
            if block.source is None and full is None:
                work.wait()
                full = _global_order(gathered)
                d_full = torch.zeros(full.shape, dtype=torch.float32, device=full.device)
            local = block.source is not None
            grads = blocks.backward(step, block, dout, q, *blocks.kv(kv if local else full, block), out, lse, dq)
            _add_kv_grad(d_local if local else d_full, blocks.layout, grads)
        if d_full is not None:
            shards = _rank_order(d_full, inputs.cp)
            mine = torch.empty_like(shards[0])
            dist.reduce_scatter_tensor(mine, shards.flatten(0, 1), group=inputs.group)
            d_local += mine
        dk, dv = _unpack_grads(d_local, blocks.layout, kv.dtype)
        dsinks = None if sinks is None else _sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk, dv, None, None, None, dsinks, None


# ----------------------------------------------------------------------------------------------- all-to-all
class _AllToAll(torch.autograd.Function):
    """``x`` [n, ...]: slice j goes to member j of ``group``; returns [n, ...] with slice i from member i.
    The exchange is its own inverse, so backward exchanges the gradient the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _a2a_rows(inputs: ContextParallelInputs, seq_local: int, device: torch.device) -> torch.Tensor:
    """Row order after the exchange: index ``i`` of the attention's sequence is row ``rows[i]`` of the exchanged
    tokens (the members' local tokens one after another). ``a2a``: the global sequence order; ``a2a+p2p``: the
    load-balanced local order of the ring of B ranks (chunks of A x c tokens)."""
    a, cp = inputs.a2a_size, inputs.cp
    first = inputs.rank - inputs.a2a_rank  # CP rank of the group's first member
    held = torch.cat([local_token_indices(seq_local, cp, first + m, device) for m in range(a)])
    if inputs.ring is None:
        wanted = torch.arange(cp * seq_local, device=device)
    else:
        wanted = local_token_indices(a * seq_local, inputs.ring.cp, inputs.ring.rank, device)
    where = torch.full((cp * seq_local,), -1, dtype=torch.long, device=device)
    where[held] = torch.arange(held.numel(), device=device)
    return where[wanted]


def _seq_to_heads(x: torch.Tensor, inputs: ContextParallelInputs, rows: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] (all heads, local tokens) -> [b, n / A, A s, d] (this member's heads, the group's tokens)."""
    b, n, s, d = x.shape
    a = inputs.a2a_size
    x = x.view(b, a, n // a, s, d).permute(1, 0, 2, 3, 4)  # [A, b, n/A, s, d]: slice j to member j
    y = _AllToAll.apply(x, inputs.a2a_group)               # [A, b, n/A, s, d]: slice i from member i
    y = y.permute(1, 2, 0, 3, 4).reshape(b, n // a, a * s, d)
    return y.index_select(2, rows)


def _heads_to_seq(y: torch.Tensor, inputs: ContextParallelInputs, back: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: [b, n / A, A s, d] -> [b, n, s, d] (``back`` inverts its ``rows``)."""
    b, nl, full, d = y.shape
    a = inputs.a2a_size
    x = y.index_select(2, back).view(b, nl, a, full // a, d).permute(2, 0, 1, 3, 4)  # slice i back to member i
    x = _AllToAll.apply(x, inputs.a2a_group)
    return x.permute(1, 0, 2, 3, 4).reshape(b, a * nl, full // a, d)


def _a2a_attention(q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float,
                   sinks: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Ulysses: exchange heads for sequence inside the all-to-all group, attend, exchange back.

    ``a2a``: the full sequence of this rank's share of the heads, attended by the same SDPA call as without CP
    (causal, or the document mask of the whole sequence; with sinks, the same sink attention as without CP).
    ``a2a+p2p``: the A x c-token chunks of the ring across groups, attended by ring attention over the B groups.
    Sinks follow their heads: this member keeps those of its share."""
    heads, groups = q.shape[1], k.shape[1]
    check_a2a_heads(heads, groups, inputs.a2a_size, comm_type=inputs.comm_type)
    reps = a2a_kv_replicas(heads, groups, inputs.a2a_size)
    if reps > 1:  # key/value heads repeated until they split evenly (query head i keeps its group i * groups / heads)
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    rows = _a2a_rows(inputs, q.shape[2], q.device)
    back = torch.empty_like(rows)
    back[rows] = torch.arange(rows.numel(), device=rows.device)
    qh, kh, vh = (_seq_to_heads(t, inputs, rows) for t in (q, k, v))
    if sinks is not None:
        share = heads // inputs.a2a_size
        sinks = sinks[inputs.a2a_rank * share:(inputs.a2a_rank + 1) * share]
    if inputs.ring is None:
        mask = None
        if inputs.document_ids is not None:  # flex attention's block mask on CUDA, as without CP
            mask = DocumentMask.causal(_global_order(inputs.document_ids))
        if sinks is None:
            out = core_attention(qh, kh, vh, mask, dropout_p, scale)
        else:
            out = sink_attention(qh, kh, vh, sinks, window, mask, scale)
    else:
        out = _RingAttention.apply(qh, kh, vh, inputs.ring, dropout_p, scale, sinks, window)
    return _heads_to_seq(out, inputs, back)


# ----------------------------------------------------------------------------------------------- entry point
@torch.compiler.disable  # point-to-point communication inside: keep it out of compiled graphs
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: ContextParallelInputs,
                               dropout_p: float = 0.0, scale: Optional[float] = None,
                               sinks: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    q [b, heads, s_local, d], k [b, groups, s_local, d] and v [b, groups, s_local, dv] in the
    local order of the load-balanced split (chunk r, then chunk 2CP-1-r); returns
    [b, heads, s_local, dv]. ``scale`` multiplies the scores (default 1/sqrt(d)).

    ``sinks`` [heads]: attention with sinks (:mod:`meshtron.layers.sink_attention`): each head's logit joins
    the softmax's denominator, once per query, after the blocks are merged. ``window``: a query sees the
    ``window`` latest positions only, its own included (sequence positions of the load-balanced split);
    only with ``sinks``.
    """
    if window is not None and sinks is None:
        raise ValueError("context-parallel attention takes a sliding window only with sinks (sink attention)")
    if not isinstance(inputs, ContextParallelInputs):
        raise TypeError("context-parallel attention needs the ContextParallelInputs that GPTModel builds; "
                        f"got {type(inputs).__name__}")
    if q.shape[2] % 2:
        raise ValueError(f"the local sequence ({q.shape[2]} tokens) must be two chunks of equal length")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if inputs.comm_type in ("a2a", "a2a+p2p"):
        return _a2a_attention(q, k, v, inputs, dropout_p, scale, sinks, window)
    fn = _RingAttention if inputs.comm_type == "p2p" else _AllGatherAttention
    return fn.apply(q, k, v, inputs, dropout_p, scale, sinks, window)
