"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 (and Qwen3-Next).

Per value head the layer keeps a state ``S`` [dk, dv] that every token first decays and then
corrects towards its own key/value pair (the gated delta rule)::

    S_t = a_t * S_{t-1}
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T        (a_t = exp(g_t), 0 < beta_t < 1)
    o_t = S_t^T q_t

with ``q``, ``k`` L2-normalised per head and ``q`` scaled by ``dk ** -0.5``. Around it: one input
projection (q, k, v, the output gate z, and the per-head logits b of beta and a of the decay), a
short causal depthwise convolution with SiLU over q, k and v, the decay
``g = -exp(A_log) * softplus(a + dt_bias)``, an RMSNorm of each head's output gated by ``silu(z)``,
and the output projection. Key heads may be fewer than value heads: key head ``i`` serves value
heads ``i * r ... i * r + r - 1`` (``r = value heads / key heads``).

The recurrence runs, by ``kernel``:

* ``chunk`` (the CPU/training path, :func:`chunk_gated_delta_rule`): 64 tokens at a time in
  matrix form, a loop over chunks only; under autograd it keeps only its inputs and runs the chunks
  again in backward (:func:`chunk_rule_keeping_inputs`: a compiled layer then keeps about a third of
  the bytes it kept with every intermediate);
* ``fla``: the fused Triton kernel of the ``fla-core`` package (``fla.ops.gated_delta_rule``), on CUDA
  when the package is installed (``auto`` picks it there, else ``chunk``); untested here;
* :func:`gated_delta_rule_reference`: one token at a time, for tests.

Tensor parallelism splits the heads: the input projection is column-parallel (each rank its key
heads and their value heads, with their convolution channels, ``A_log`` and ``dt_bias``), the output
projection row-parallel; the gated norm's weight (shared by all heads) is replicated and its
gradient summed over TP. Packed documents (a one-device
:class:`~meshtron.layers.documents.DocumentMask`) restart the convolution's window and the state
at each document's first token.

Generation (:class:`DecodeState`, one per layer) keeps the convolution's last ``K - 1`` inputs and the
rule's state [b, heads, dk, dv]: a prompt runs the chunked kernel from a zero state and keeps its final
state, each later token one step of the recurrence from it.

Context parallelism (the layer gets the model's
:class:`~meshtron.parallel.context_parallel.attention.ContextParallelInputs`; every ``--cp-comm-type``
runs the same exchange over the whole CP group): each rank runs the recurrence on its two chunks of
the load-balanced split from a zero state, the ranks all-gather each chunk's affine map of its start
state (a [dk, dk] transition and a [dk, dv] end state per head), and each rank composes the chunks
before its own and corrects its outputs; the convolution gets the previous chunk's last ``K - 1``
inputs the same way, and packed documents restart both as above. The details and costs are in
:mod:`meshtron.parallel.context_parallel.recurrence`.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshtron.layers.documents import DocumentMask
from meshtron.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.attention import ContextParallelInputs
from meshtron.parallel.context_parallel.recurrence import cp_causal_conv, cp_gated_delta_rule, global_segments
from meshtron.parallel.sharding import Piece, ShardSpec, new_param, whole

CHUNK = 64


# ---------------------------------------------------------------------------------------------- the recurrence
def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                               segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (reference for tests), in fp32.

    ``q``, ``k`` [b, s, h, dk] (normalised and scaled already, as many heads as ``v``), ``v``
    [b, s, h, dv], ``g`` (log decay, <= 0) and ``beta`` [b, s, h]. ``segments`` [b, s]: packed
    documents, one id per contiguous run (:func:`document_segments`); the state restarts from zero
    where the id changes. Returns the output [b, s, h, dv] in ``v``'s dtype and the final state
    [b, h, dk, dv] (fp32).
    """
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = (torch.zeros(b, h, dk, dv, device=v.device) if initial_state is None else initial_state.float())
    outs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        if segments is not None and t > 0:
            state = state * (segments[:, t] == segments[:, t - 1]).float()[:, None, None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1).to(v.dtype), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk_size: int = CHUNK, initial_state: Optional[torch.Tensor] = None,
                           segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (same arguments and results as
    :func:`gated_delta_rule_reference`); computed in fp32.

    Within a chunk starting from state ``S0``, let ``G_t = exp(g_1 + ... + g_t)`` and let ``u_t`` be
    the value token t writes (``S_t = a_t S_{t-1} + k_t u_t^T``). Unrolling the recurrence,

        u_t = beta_t v_t - beta_t G_t k_t^T S0 - beta_t sum_{j<t} (G_t / G_j) (k_t . k_j) u_j,

    a unit lower-triangular system ``(I + A) U = diag(beta) V - diag(beta G) K S0`` (the WY/UT form:
    ``A_tj = beta_t (G_t/G_j) k_t . k_j`` for j < t). One triangular solve per chunk gives
    ``U0 = (I + A)^-1 diag(beta) V`` and ``W = (I + A)^-1 diag(beta G) K`` for all chunks at once, and
    then, chunk after chunk,

        U = U0 - W S0
        O = diag(G) Q S0 + (Q K^T * D) U          (D_tj = G_t / G_j for j <= t, else 0)
        S_end = G_C S0 + (diag(G_C / G) K)^T U.

    Decay ratios are formed as ``exp`` of differences of the cumulative log decay, masked before the
    exponential, so no quotient of two underflowing products is ever taken.

    With ``segments`` a document start is a decay of exactly 0 (the state restarts): ``G_t / G_j`` is
    0 unless j and t share a segment, ``G_t`` (what reaches t of the chunk's start state) is 0 unless t
    is in the segment that was running before the chunk, and the same for the chunk's end. These are
    masks on the same products, with finite logarithms throughout.
    """
    out_dtype = v.dtype
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    # [b, h, s, d] in fp32; padded tokens (k = v = 0, beta = 0, g = 0) leave the state as it is.
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))
    pad = (-s) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // C
    q, k, v = (t.reshape(b, h, n, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, C), beta.reshape(b, h, n, C)

    log_G = g.cumsum(-1)  # [b, h, n, C]
    visible = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    from_start = to_end = carried = None
    if segments is not None:
        # padded tokens join the last segment (they write nothing)
        seg = torch.cat([segments, segments[:, -1:].expand(b, pad)], dim=1).reshape(b, 1, n, C)
        before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)  # the segment running into each chunk
        visible = visible & (seg[..., :, None] == seg[..., None, :])
        from_start = seg == before  # [b, 1, n, C]: the chunk's start state reaches token t
        to_end = seg == seg[..., -1:]  # token t reaches the chunk's end state
        carried = (seg[..., -1] == before[..., 0])[..., None, None]  # the start state reaches the end
    D = (log_G[..., :, None] - log_G[..., None, :]).masked_fill(~visible, float("-inf")).exp()
    G = log_G.exp() if from_start is None else log_G.exp() * from_start
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * D).tril(-1)
    rhs = torch.cat([beta[..., None] * v, (beta * G)[..., None] * k], dim=-1)
    # Only A's strict lower triangle is read: the diagonal of I + A is 1.
    U0, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * D
    q_decayed = q * G[..., None]
    end_decay = (log_G[..., -1:] - log_G).exp()
    k_to_end = k * (end_decay if to_end is None else end_decay * to_end)[..., None]
    chunk_decay = log_G[..., -1].exp()[..., None, None]  # [b, h, n, 1, 1]
    if carried is not None:
        chunk_decay = chunk_decay * carried

    state = (torch.zeros(b, h, dk, dv, device=v.device) if initial_state is None else initial_state.float())
    outs = []
    for i in range(n):
        u = U0[:, :, i] - W[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ u)
        state = chunk_decay[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * C, dv)[:, :, :s]
    return out.transpose(1, 2).to(out_dtype), state


def fla_available() -> bool:
    """Whether ``fla-core``'s gated delta rule kernel can be imported."""
    return importlib.util.find_spec("fla") is not None


def _fla_gated_delta_rule(q, k, v, g, beta, initial_state, segments):  # pragma: no cover - needs CUDA and fla-core
    """UNTESTED here (no CUDA, no fla-core): the fused kernel, on the same [b, s, h, d] layout.

    ``q`` is scaled already (``scale=1``) and normalised already (no normalisation in the kernel).
    Packed documents go to the kernel as one sequence of variable-length pieces (``cu_seqlens``, batch
    1); finding the pieces' starts synchronises with the host. The final state is then per piece.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    q, k, beta = q.to(v.dtype), k.to(v.dtype), beta.to(v.dtype)  # one dtype for the kernel's operands
    if segments is None:
        return fla_chunk(q, k, v, g.float(), beta, scale=1.0, initial_state=initial_state,
                         output_final_state=True, use_qk_l2norm_in_kernel=False)
    b, s = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    cu = torch.cat([starts.reshape(-1).nonzero()[:, 0], torch.tensor([b * s], device=q.device)]).to(torch.int32)
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g.float(), beta)]
    out, state = fla_chunk(*flat, scale=1.0, initial_state=None, output_final_state=True,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
    return out.reshape(b, s, *out.shape[2:]), state


def chunk_rule_keeping_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                              segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` keeping only its inputs for the backward, which runs the chunks' forward
    again first (as fla's kernel recomputes its states). Kept whole, autograd would hold about ten tensors of
    [chunk, chunk] or [chunk, dk + dv] per chunk and head, some 100 fp32 values per token and head more than the
    inputs; the second forward costs about a third of the rule's work, small beside the layer's projections."""
    return checkpoint(chunk_gated_delta_rule, q, k, v, g, beta, CHUNK, initial_state, segments, use_reentrant=False)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     kernel: str = "auto", initial_state: Optional[torch.Tensor] = None,
                     segments: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: ``chunk``, ``fla``, ``reference``, or ``auto`` (fla on CUDA when installed, else chunk)."""
    if kernel == "auto":
        kernel = "fla" if q.is_cuda and fla_available() else "chunk"
    if kernel == "chunk":
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
            return chunk_rule_keeping_inputs(q, k, v, g, beta, initial_state, segments)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, segments=segments)
    if kernel == "fla":
        return _fla_gated_delta_rule(q, k, v, g, beta, initial_state, segments)
    if kernel == "reference":
        return gated_delta_rule_reference(q, k, v, g, beta, initial_state, segments)
    raise ValueError(f"gated delta rule kernel must be auto, chunk, fla or reference, got {kernel!r}")


# ---------------------------------------------------------------------------------------------- pieces
def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (eps inside the root, as Qwen3.5's kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, segments: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """Each channel of ``x`` [b, s, c] convolved causally with its own kernel ``weight`` [c, K], then SiLU.

    With ``segments`` [b, s] (packed documents) a token's window holds only tokens of its own document:
    the K taps are summed as K shifted copies, each masked where it reaches into another document.
    """
    K = weight.shape[1]
    if segments is None:
        y = F.conv1d(x.transpose(1, 2), weight[:, None, :], padding=K - 1, groups=weight.shape[0])
        return F.silu(y[..., :x.shape[1]]).transpose(1, 2)
    y = x * weight[:, K - 1]
    for i in range(1, K):  # tap K-1-i reads the token i places back
        earlier = F.pad(x, (0, 0, i, 0))[:, :x.shape[1]]
        same = F.pad(segments, (i, 0), value=-1)[:, :x.shape[1]] == segments
        y = y + earlier * weight[:, K - 1 - i] * same[..., None]
    return F.silu(y)


def document_segments(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids of the contiguous runs of equal document ids (a document id met again later, after
    another document, starts a new run: a recurrence cannot go back to an earlier state)."""
    starts = torch.ones_like(document_ids, dtype=torch.int32)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).int()
    return starts.cumsum(1)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension (in fp32), times ``weight``, times ``silu(gate)``."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight
    return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's gated DeltaNet layer, called as ``layer(x)`` on ``x`` [s, b, hidden] -> [s, b, hidden].

    Canonical tensors (``prefix`` + Hugging Face's names): ``in_proj_qkv.weight`` [2 nk dk + nv dv, H]
    (rows q, k, v), ``in_proj_z.weight`` [nv dv, H], ``in_proj_b.weight`` / ``in_proj_a.weight``
    [nv, H], ``conv1d.weight`` [2 nk dk + nv dv, K] (Hugging Face's [., 1, K] without the middle
    dimension), ``A_log`` / ``dt_bias`` [nv], ``norm.weight`` [dv], ``out_proj.weight`` [H, nv dv].
    ``A_log`` starts at 0 (A = 1) and ``dt_bias`` at 1.
    """

    supports_context_parallel: ClassVar[bool] = True

    def __init__(self, ctx: ParallelContext, prefix: str, hidden_size: int, num_key_heads: int, num_value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel_size: int = 4, norm_eps: float = 1e-6,
                 sequence_parallel: bool = False, init_std: float = 0.02, output_std: Optional[float] = None,
                 kernel: str = "auto"):
        super().__init__()
        tp, r = ctx.tp, ctx.tp_rank
        if num_key_heads % tp or num_value_heads % num_key_heads:
            raise ValueError(f"gated DeltaNet: key heads ({num_key_heads}) must divide by TP ({tp}) and divide the "
                             f"value heads ({num_value_heads})")
        H, dk, dv, K = hidden_size, key_head_dim, value_head_dim, conv_kernel_size
        nk, nv = num_key_heads, num_value_heads
        self.nk, self.nv = nk // tp, nv // tp  # local heads
        self.dk, self.dv, self.eps, self.kernel = dk, dv, norm_eps, kernel
        out_std = init_std if output_std is None else output_std
        kd, vd = nk * dk, nv * dv
        k0, v0, h0 = r * self.nk * dk, r * self.nv * dv, r * self.nv  # this rank's first row of each kind

        def rows(name, shape, start, length, init="normal", std=init_std):
            return Piece(f"{prefix}.{name}", shape, 0, start, length, init, std)

        qkv = (2 * kd + vd, H)
        self.in_proj = ColumnParallelLinear(ctx, [
            rows("in_proj_qkv.weight", qkv, k0, self.nk * dk),
            rows("in_proj_qkv.weight", qkv, kd + k0, self.nk * dk),
            rows("in_proj_qkv.weight", qkv, 2 * kd + v0, self.nv * dv),
            rows("in_proj_z.weight", (vd, H), v0, self.nv * dv),
            rows("in_proj_b.weight", (nv, H), h0, self.nv),
            rows("in_proj_a.weight", (nv, H), h0, self.nv)], None, sequence_parallel)
        conv = (2 * kd + vd, K)
        conv_std = K ** -0.5
        self.conv_weight = new_param(ShardSpec((
            rows("conv1d.weight", conv, k0, self.nk * dk, std=conv_std),
            rows("conv1d.weight", conv, kd + k0, self.nk * dk, std=conv_std),
            rows("conv1d.weight", conv, 2 * kd + v0, self.nv * dv, std=conv_std)), 0))
        self.A_log = new_param(ShardSpec((rows("A_log", (nv,), h0, self.nv, "zeros"),), 0))
        self.dt_bias = new_param(ShardSpec((rows("dt_bias", (nv,), h0, self.nv, "ones"),), 0))
        # Shared by every head; each rank normalises its own heads, so the gradient is a partial sum over TP.
        self.norm_weight = new_param(ShardSpec((whole(f"{prefix}.norm.weight", (dv,), "ones"),), tp_replicated=True,
                                               grad_sync="tp" if tp > 1 else None))
        self.out_proj = RowParallelLinear(
            ctx, Piece(f"{prefix}.out_proj.weight", (H, vd), 1, v0, self.nv * dv, "normal", out_std), None,
            sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, mask=None, cache=None) -> torch.Tensor:
        """``x`` [s, b, hidden]; ``rope`` is ignored (no positions: the convolution and the recurrence are
        causal by construction); ``mask``: None (one sequence), a one-device
        :class:`~meshtron.layers.documents.DocumentMask` (packed documents) or under context parallelism
        the model's :class:`~meshtron.parallel.context_parallel.attention.ContextParallelInputs` (``x`` this
        rank's two chunks); ``cache``: None, or when generating the layer's :class:`DecodeState` (``mask``
        None), which the call continues from and updates."""
        if cache is not None:
            if mask is not None:
                raise NotImplementedError("gated DeltaNet: a decode state decodes one sequence on one device")
            return self._decode(x, cache)
        cp = mask if isinstance(mask, ContextParallelInputs) else None
        if not (mask is None or cp is not None or isinstance(mask, DocumentMask)) or (
                isinstance(mask, DocumentMask) and (mask.q_pos is not None or mask.k_pos is not None)):
            raise NotImplementedError("gated DeltaNet: no boolean masks")
        if cp is not None:
            segments = None if cp.document_ids is None else global_segments(cp.document_ids)
        else:
            segments = None if mask is None else document_segments(mask.q_docs)
        qkv, z, beta_logit, a = self._project(x)
        if cp is None:
            qkv = causal_depthwise_conv(qkv, self.conv_weight, segments)
        else:
            conv = lambda t, seg: causal_depthwise_conv(t, self.conv_weight, seg)  # noqa: E731
            qkv = cp_causal_conv(conv, qkv, self.conv_weight.shape[1] - 1, cp.group, cp.cp, cp.rank, segments)
        q, k, v, g, beta = self._rule_inputs(qkv, beta_logit, a)
        if cp is None:
            out, _ = gated_delta_rule(q, k, v, g, beta, self.kernel, segments=segments)
        else:
            out = cp_gated_delta_rule(self._recurrence, q, k, v, g, beta, cp.group, cp.cp, cp.rank, segments)
        return self._output(out, z)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projection of ``x`` [s, b, hidden] split into (qkv, z, beta logits, a), each [b, s, .]."""
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        h = self.in_proj(x).transpose(0, 1)  # [b, s, local features]
        return h.split([2 * nk * dk + nv * dv, nv * dv, nv, nv], dim=-1)

    def _rule_inputs(self, qkv: torch.Tensor, beta_logit: torch.Tensor, a: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """The gated delta rule's (q, k, v, g, beta) from the convolution's output [b, s, .] and the logits."""
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q = l2_normalise(q.reshape(b, s, nk, dk).float()) * dk ** -0.5
        k = l2_normalise(k.reshape(b, s, nk, dk).float())
        if nv != nk:  # each key head serves nv / nk consecutive value heads
            q, k = (t.repeat_interleave(nv // nk, dim=2) for t in (q, k))
        beta = beta_logit.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v.reshape(b, s, nv, dv), g, beta

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm of the rule's output [b, s, heads, dv] and the output projection -> [s, b, hidden]."""
        b, s, nv, dv = out.shape
        out = gated_rms_norm(out, z.reshape(b, s, nv, dv), self.norm_weight, self.eps)
        return self.out_proj(out.reshape(b, s, nv * dv).transpose(0, 1))

    def _decode(self, x: torch.Tensor, state: "DecodeState") -> torch.Tensor:
        """``x`` [s, b, hidden] continuing from ``state`` (empty: a prompt), which then holds the tokens' end."""
        qkv, z, beta_logit, a = self._project(x)
        qkv = state.convolve(qkv, self.conv_weight)
        q, k, v, g, beta = self._rule_inputs(qkv, beta_logit, a)
        # A prompt runs the chunked kernel (or fla's); one new token, one step of the recurrence.
        kernel = "reference" if q.shape[1] == 1 else self.kernel
        out, state.state = gated_delta_rule(q, k, v, g, beta, kernel, state.state)
        return self._output(out, z)

    def _recurrence(self, q, k, v, g, beta, initial_state, segments):
        """The one-device rule for one chunk under CP. fla's kernel returns one state per document when
        given documents, so a chunk holding documents runs the ``chunk`` kernel."""
        kernel = "chunk" if segments is not None and self.kernel in ("auto", "fla") else self.kernel
        return gated_delta_rule(q, k, v, g, beta, kernel, initial_state, segments)



class DecodeState:
    """The decode state of one gated DeltaNet layer: the convolution's last ``K - 1`` inputs ``conv``
    [b, K - 1, channels] and the gated delta rule's state ``state`` [b, heads, dk, dv] (fp32), both None
    before the prompt."""

    def __init__(self) -> None:
        self.conv: Optional[torch.Tensor] = None
        self.state: Optional[torch.Tensor] = None

    def convolve(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:func:`causal_depthwise_conv` of ``x`` [b, s, c] after the kept inputs (zeros before the
        prompt, as the convolution's own padding); keeps the last ``K - 1`` inputs."""
        K = weight.shape[1]
        past = x.new_zeros(x.shape[0], K - 1, x.shape[2]) if self.conv is None else self.conv
        full = torch.cat([past, x], dim=1)
        self.conv = full[:, full.shape[1] - (K - 1):]
        return causal_depthwise_conv(full, weight)[:, K - 1:]
