"""Context parallelism for a linear recurrence (the gated delta rule of :mod:`meshtron.layers.gated_deltanet`).

Each CP rank holds two chunks of the sequence (chunk ``r`` and ``2 CP - 1 - r``,
:mod:`meshtron.parallel.context_parallel.split`). The recurrence's state ``S`` [dk, dv] (per batch row and
head) is affine in the state a stretch of tokens starts from: over one chunk

    S_end(S0) = T S0 + B        o_t(S0) = o_t(0) + P_t S0

with ``T`` [dk, dk] the chunk's transition, ``B`` the end state from ``S0 = 0``, ``o_t(0)`` the outputs from
``S0 = 0`` and ``P_t`` [dk] the query read through the decays and corrections before token t. All four come
from one run of the one-device chunk kernel on values widened by dk zero columns from the state
``[0 | I]``: value columns evolve independently, so the first dv columns are the zero-start run and the last
dk columns the identity's image (:func:`affine_run`). Each rank then

1. runs its two chunks from zero (``T``, ``B``, ``o(0)``, ``P``; the kernel's work grows by ``(dv + dk) / dv``);
2. all-gathers every chunk's ``[T | B]`` over the CP group (dk x (dk + dv) per head and chunk, with autograd:
   the backward reduce-scatters, summing every rank's gradient of each chunk's pair);
3. composes the chunks before each of its own in sequence order, ``S_in(c) = T_{c-1} S_in(c-1) + B_{c-1}``
   from ``S_in(0) = 0`` (:func:`chunk_start_states`; 2 CP small matmuls per head, repeated on every rank);
4. corrects its outputs, ``o = o(0) + P S_in`` (one [s, dk] x [dk, dv] product per head: no second run).

The causal depthwise convolution before the recurrence needs the ``K - 1`` inputs before each chunk, the
last of the chunk before it in sequence order: every rank's chunk tails are all-gathered the same way
(:func:`conv_halos`; zeros before the sequence's start).

Packed documents (``--reset-attention-mask``): ``ContextParallelInputs.document_ids`` already holds every
rank's document ids, so each rank numbers the documents' contiguous runs over the whole sequence
(:func:`global_segments`); the convolution and the chunk kernel see the runs of their chunk (and halo), and a
chunk whose first token starts a run gets a zero start state (``keep`` of :func:`chunk_start_states`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from meshtron.parallel.comm import gather_from_sequence
from meshtron.parallel.context_parallel.split import chunk_ids, chunk_owner, restore_sequence_order

#: ``(q, k, v, g, beta, initial_state, segments) -> (out, final state)``: a one-device gated delta rule.
Recurrence = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def gather_chunks(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Every rank's ``x`` [2, ...] (its two chunks' values), all-gathered with autograd and returned in
    sequence order [2 CP, ...] (entry ``c``: global chunk ``c``)."""
    gathered = gather_from_sequence(x.contiguous(), group)  # [CP * 2, ...]: rank-major
    order = [2 * rank + half for rank, half in (chunk_owner(c, cp) for c in range(2 * cp))]
    return gathered[torch.tensor(order, device=x.device)]


def global_segments(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] ids of the contiguous document runs of the whole sequence, from every rank's document ids
    ``document_ids`` [CP, b, local seq] (as ``ContextParallelInputs`` holds them)."""
    docs = restore_sequence_order(list(document_ids), dim=1)
    starts = torch.ones_like(docs, dtype=torch.int32)
    starts[:, 1:] = (docs[:, 1:] != docs[:, :-1]).int()
    return starts.cumsum(1)


def conv_halos(x: torch.Tensor, width: int, group, cp: int, rank: int) -> torch.Tensor:
    """[2, b, width, c]: for each of this rank's chunks of ``x`` [b, 2 chunk, c], the ``width`` tokens before
    it in sequence order (zeros before the sequence's first chunk)."""
    b, s, c = x.shape
    n = s // 2
    if width > n:
        raise ValueError(f"gated DeltaNet under CP: a chunk of {n} tokens is shorter than the convolution's "
                         f"window ({width} earlier tokens)")
    tails = x.view(b, 2, n, c)[:, :, n - width:].transpose(0, 1)  # [2, b, width, c]
    every = gather_chunks(tails, group, cp)
    return torch.stack([every[i - 1] if i > 0 else torch.zeros_like(tails[0]) for i in chunk_ids(cp, rank)])


def affine_run(recurrence: Recurrence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, segments: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o(0) [b, s, h, dv], P [b, s, h, dk], T [b, h, dk, dk], B [b, h, dk, dv]) of one stretch of tokens, all
    fp32, from one run of ``recurrence`` on values ``[v | 0]`` from the state ``[0 | I]`` (module docstring)."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    wide = torch.cat([v.float(), v.new_zeros(b, s, h, dk, dtype=torch.float32)], dim=-1)
    eye = torch.eye(dk, device=v.device).expand(b, h, dk, dk)
    start = torch.cat([torch.zeros(b, h, dk, dv, device=v.device), eye], dim=-1)
    out, end = recurrence(q, k, wide, g, beta, start, segments)
    return out[..., :dv], out[..., dv:], end[..., dv:], end[..., :dv]


def chunk_start_states(pairs: torch.Tensor, dv: int, last: int, keep: Optional[torch.Tensor] = None
                       ) -> list[torch.Tensor]:
    """The true start state [b, h, dk, dv] of global chunks ``0 .. last``, from every chunk's ``[T | B]``
    ``pairs`` [2 CP, b, h, dk, dk + dv] in sequence order. ``keep`` [2 CP, b]: 0 where a chunk's first token
    starts a new document (its start state is zero), else 1."""
    dk = pairs.shape[-2]
    states = [pairs.new_zeros(pairs.shape[1:-1] + (dv,))]
    for c in range(1, last + 1):
        T, B = pairs[c - 1].split([dk, dv], dim=-1)
        state = T @ states[-1] + B
        if keep is not None:
            state = state * keep[c][:, None, None, None]
        states.append(state)
    return states


def cp_gated_delta_rule(recurrence: Recurrence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, group, cp: int, rank: int, segments: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """The gated delta rule over this rank's two chunks (``q``, ``k`` [b, 2n, h, dk], ``v`` [b, 2n, h, dv],
    ``g``, ``beta`` [b, 2n, h]) as if run over the whole sequence; ``segments`` [b, S]: the whole sequence's
    document runs (:func:`global_segments`). Returns the output [b, 2n, h, dv] in ``v``'s dtype."""
    b, s, h, dk = k.shape
    dv, n = v.shape[-1], s // 2
    mine = chunk_ids(cp, rank)
    runs = []
    for half, c in enumerate(mine):
        part = [t[:, half * n:(half + 1) * n] for t in (q, k, v, g, beta)]
        seg = None if segments is None else segments[:, c * n:(c + 1) * n]
        runs.append(affine_run(recurrence, *part, seg))
    pairs = torch.stack([torch.cat([T, B], dim=-1) for _, _, T, B in runs])  # [2, b, h, dk, dk + dv]
    every = gather_chunks(pairs, group, cp)
    keep = None
    if segments is not None:  # chunk c continues the document running at the end of chunk c - 1
        firsts = segments[:, ::n].T  # [2 CP, b]
        keep = torch.ones_like(firsts, dtype=torch.float32)
        keep[1:] = (firsts[1:] == segments[:, n - 1::n][:, :-1].T).float()
    states = chunk_start_states(every, dv, max(mine), keep)
    outs = [o0 + torch.einsum("bshk,bhkv->bshv", P, states[c]) for (o0, P, _, _), c in zip(runs, mine)]
    return torch.cat(outs, dim=1).to(v.dtype)


def cp_causal_conv(conv: Callable[..., torch.Tensor], x: torch.Tensor, width: int, group, cp: int, rank: int,
                   segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``conv(x, segments)`` (a causal convolution seeing ``width`` earlier tokens) over this rank's two chunks
    of ``x`` [b, 2n, c] as over the whole sequence: each chunk is prefixed with its halo (:func:`conv_halos`)
    and the halo's outputs dropped. ``segments`` [b, S]: the whole sequence's document runs."""
    n = x.shape[1] // 2
    halos = conv_halos(x, width, group, cp, rank)
    outs = []
    for half, c in enumerate(chunk_ids(cp, rank)):
        seg = None
        if segments is not None:  # the halo's runs; -1 (no document) before the sequence's start
            seg = F.pad(segments, (width, 0), value=-1)[:, c * n:(c + 1) * n + width]
        outs.append(conv(torch.cat([halos[half], x[:, half * n:(half + 1) * n]], dim=1), seg)[:, width:])
    return torch.cat(outs, dim=1)
