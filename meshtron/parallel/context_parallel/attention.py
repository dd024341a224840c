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

Partial results of the blocks are merged exactly through their log-sum-exp, so the
output equals full causal attention up to floating-point rounding. Traffic is at
the key/value (query-group) size, so grouped-query attention sends ``groups/heads``
of what multi-head attention would. Values may have another head dim than keys
(multi-latent attention): keys and values travel packed side by side in one buffer. Document masks (``--reset-attention-mask``) work
with both: the document ids of every rank are all-gathered once per forward (one
integer per token) and each block gets its explicit mask.

Which blocks a rank computes is decided by :func:`ring_plan` / :func:`allgather_plan`
(also used by the tests to check that the causal work is balanced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.config import ConfigError
from meshtron.parallel.context_parallel.kernels import select_kernel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.split import chunk_owner, local_token_indices

COMM_TYPES = ("p2p", "allgather")
_KV_TAG, _DKV_TAG = 11, 12  # distinct tags: gloo matches messages between two ranks by tag


def check_comm_type(comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")


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

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank + 1) % self.cp)

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.cp)


def context_parallel_inputs(ctx: ParallelContext, comm_type: str,
                            document_ids: Optional[torch.Tensor] = None) -> ContextParallelInputs:
    """Inputs for :func:`context_parallel_attention` from this rank's local ``document_ids`` [b, local seq]."""
    check_comm_type(comm_type)
    if ctx.cp_group is None:
        raise ValueError("context-parallel attention needs a CP process group (--context-parallel-size > 1)")
    docs = None
    if document_ids is not None:
        local = document_ids.contiguous()
        docs = local.new_empty((ctx.cp * local.shape[0],) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(docs, local, group=ctx.cp_group)
        docs = docs.view((ctx.cp,) + tuple(local.shape))
    return ContextParallelInputs(ctx.cp_group, ctx.cp, ctx.cp_rank, comm_type, docs)


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
    """Document masks of the blocks (None everywhere without document ids)."""

    def __init__(self, inputs: ContextParallelInputs, seq_local: int, device: torch.device):
        self.docs = inputs.document_ids
        self.cp, self.rank, self.chunk = inputs.cp, inputs.rank, seq_local // 2
        if self.docs is not None:
            self.positions = [local_token_indices(seq_local, self.cp, j, device) for j in range(self.cp)]
            self.global_docs = _global_order(self.docs)

    def block(self, b: Block) -> Optional[torch.Tensor]:
        """Boolean [batch, 1, sq, sk]: same document and not in the future (by sequence index)."""
        if self.docs is None:
            return None
        q_rows = _rows(b.q_rows, self.chunk)
        q_pos, q_doc = self.positions[self.rank][q_rows], self.docs[self.rank][:, q_rows]
        k_rows = _rows(b.k_rows, self.chunk)
        if b.source is None:
            k_pos = torch.arange(k_rows.start, k_rows.stop, device=q_pos.device)
            k_doc = self.global_docs[:, k_rows]
        else:
            k_pos, k_doc = self.positions[b.source][k_rows], self.docs[b.source][:, k_rows]
        mask = (q_doc[:, :, None] == k_doc[:, None, :]) & (k_pos[None, None, :] <= q_pos[None, :, None])
        return mask[:, None]


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
    their document masks, the attention kernel, and the per-block kernel states that backward reuses."""

    def __init__(self, q: torch.Tensor, layout: _KVLayout, inputs: ContextParallelInputs, dropout_p: float,
                 scale: float):
        self.inputs, self.layout, self.dropout_p, self.scale = inputs, layout, dropout_p, scale
        self.c = q.shape[2] // 2
        self.masks = _Masks(inputs, q.shape[2], q.device)
        self.kernel = select_kernel(q, inputs.document_ids is not None, layout.dv)
        self.states: list = []

    def kv(self, source: torch.Tensor, block: Block):
        """Keys and values of ``block`` from a packed [b, s, width] source."""
        return self.layout.unpack(source[:, _rows(block.k_rows, self.c)])

    def forward(self, block: Block, q, kb, vb, out, lse) -> None:
        """Attend ``block``'s query rows to ``kb``/``vb`` and merge the result into ``out``/``lse``."""
        rows = _rows(block.q_rows, self.c)
        o_b, lse_b, state = self.kernel.forward(q[:, :, rows], kb, vb, block.causal, self.masks.block(block),
                                                self.dropout_p, self.scale)
        _merge(out, lse, rows, o_b, lse_b)
        self.states.append(state)

    def backward(self, step: int, block: Block, dout, q, kb, vb, out, lse, dq):
        """Add ``block``'s query gradient into ``dq``; return (key rows, dk, dv) of the block."""
        rows = _rows(block.q_rows, self.c)
        dq_b, dk_b, dv_b = self.kernel.backward(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                                lse[:, :, rows], block.causal, self.masks.block(block),
                                                self.dropout_p, self.scale, self.states[step])
        dq[:, :, rows] += dq_b
        return _rows(block.k_rows, self.c), dk_b, dv_b


def _start_forward(q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float):
    """(blocks, this rank's keys and values packed in one buffer, zeroed output and log-sum-exp accumulators):
    what both schedules' forwards begin with."""
    layout = _KVLayout.of(k, v)
    out, lse = _accumulators(q, v.shape[-1])
    return _Blocks(q, layout, inputs, dropout_p, scale), layout.pack(k, v), out, lse


def _save_forward(ctx, blocks: _Blocks, q, kv, out, lse) -> torch.Tensor:
    out = out.to(q.dtype)
    ctx.save_for_backward(q, kv, out, lse)
    ctx.blocks = blocks
    return out


def _add_kv_grad(target: torch.Tensor, layout: _KVLayout, k_rows: slice, dk_b: torch.Tensor,
                 dv_b: torch.Tensor) -> None:
    target[:, k_rows] += layout.pack(dk_b, dv_b)


def _unpack_grads(dkv: torch.Tensor, layout: _KVLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dk, dv = layout.unpack(dkv)
    return dk.to(dtype), dv.to(dtype)


# ----------------------------------------------------------------------------------------------- ring
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float):
        blocks, kv, out, lse = _start_forward(q, k, v, inputs, dropout_p, scale)
        cur = kv
        for step, block in enumerate(ring_plan(inputs.cp, inputs.rank)):
            nxt, works = None, []
            if step < inputs.cp - 1:  # post the next hop before computing this block
                nxt = torch.empty_like(cur)
                works = _exchange(inputs, [(cur, _KV_TAG)], [(nxt, _KV_TAG)])
            blocks.forward(block, q, *blocks.kv(cur, block), out, lse)
            _wait(works)
            cur = nxt
        return _save_forward(ctx, blocks, q, kv, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
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
            k_rows, dk_b, dv_b = blocks.backward(step, block, dout, q, *blocks.kv(cur, block), out, lse, dq)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            _add_kv_grad(dkv, blocks.layout, k_rows, dk_b, dv_b)
            _wait(works)
            if dkv_in is not None:
                dkv += dkv_in
            dkv_out, cur = dkv, nxt
        home = torch.empty_like(dkv_out)
        _wait(_exchange(inputs, [(dkv_out, _DKV_TAG)], [(home, _DKV_TAG)]))
        dk, dv = _unpack_grads(home, blocks.layout, kv.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None


# ----------------------------------------------------------------------------------------------- all-gather
def _gather_kv(kv: torch.Tensor, inputs: ContextParallelInputs):
    gathered = kv.new_empty((inputs.cp * kv.shape[0],) + tuple(kv.shape[1:]))
    work = dist.all_gather_into_tensor(gathered, kv, group=inputs.group, async_op=True)
    return gathered.view((inputs.cp,) + tuple(kv.shape)), work


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inputs: ContextParallelInputs, dropout_p: float, scale: float):
        blocks, kv, out, lse = _start_forward(q, k, v, inputs, dropout_p, scale)
        gathered, work = _gather_kv(kv, inputs)
        full = None
        for block in allgather_plan(inputs.cp, inputs.rank):
            if block.source is None and full is None:  # the local diagonals ran while the gather did
                work.wait()
                full = _global_order(gathered)
            blocks.forward(block, q, *blocks.kv(kv if block.source is not None else full, block), out, lse)
        return _save_forward(ctx, blocks, q, kv, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
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
            k_rows, dk_b, dv_b = blocks.backward(step, block, dout, q, *blocks.kv(kv if local else full, block),
                                                 out, lse, dq)
            _add_kv_grad(d_local if local else d_full, blocks.layout, k_rows, dk_b, dv_b)
        if d_full is not None:
            shards = _rank_order(d_full, inputs.cp)
            mine = torch.empty_like(shards[0])
            dist.reduce_scatter_tensor(mine, shards.flatten(0, 1), group=inputs.group)
            d_local += mine
        dk, dv = _unpack_grads(d_local, blocks.layout, kv.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None


# ----------------------------------------------------------------------------------------------- entry point
@torch.compiler.disable  # point-to-point communication inside: keep it out of compiled graphs
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: ContextParallelInputs,
                               dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    q [b, heads, s_local, d], k [b, groups, s_local, d] and v [b, groups, s_local, dv] in the
    local order of the load-balanced split (chunk r, then chunk 2CP-1-r); returns
    [b, heads, s_local, dv]. ``scale`` multiplies the scores (default 1/sqrt(d)).
    """
    if not isinstance(inputs, ContextParallelInputs):
        raise TypeError("context-parallel attention needs the ContextParallelInputs that GPTModel builds; "
                        f"got {type(inputs).__name__}")
    if q.shape[2] % 2:
        raise ValueError(f"the local sequence ({q.shape[2]} tokens) must be two chunks of equal length")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fn = _RingAttention if inputs.comm_type == "p2p" else _AllGatherAttention
    return fn.apply(q, k, v, inputs, dropout_p, scale)
