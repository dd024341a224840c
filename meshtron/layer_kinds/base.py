"""What every layer kind tells about itself, without torch.

A transformer layer is a token mixer (attention of some kind) and an MLP (dense or mixture of experts),
each behind a norm. Each kind has a *description*: an object of a subclass of :class:`MixerKind` or
:class:`MLPKind` that gives, from a :class:`~meshtron.config.ModelConfig` alone, the numbers the
planning, accounting and checkpoint code needs (parameters, FLOPs, saved activations, step-time work,
Hugging Face names), and builds the module (importing it only then, so that descriptions load without
torch). :mod:`meshtron.layer_kinds` keeps the registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from meshtron.config import ModelConfig


@dataclass(frozen=True)
class Counts:
    """Parameters of one part of one layer: ``total`` (every parameter), ``matmul`` (the weights a token passes
    through in matrix multiplications, for FLOPs) and ``inactive`` (those one token does not use: experts it is
    not routed to)."""

    total: int
    matmul: int
    inactive: int = 0


@dataclass(frozen=True)
class Matrix:
    """One 2-D weight of a layer part with its canonical shape: ``name`` relative to the part (``q.weight`` of
    ``attention.``), ``rows`` x ``cols`` as the model holds it (out x in), ``expert`` when it is one routed
    expert's (split over expert parallelism). What Muon orthogonalises and costs is read from these."""

    name: str
    rows: int
    cols: int
    expert: bool = False


@dataclass(frozen=True)
class RankParameters:
    """Parameters of one part of one layer held by one rank: ``dense`` (split over TP or replicated) and
    ``expert`` (split over EP and the expert TP size)."""

    dense: float
    expert: float = 0.0


@dataclass
class SavedBytes:
    """The per-token bytes a layer keeps for its backward, as the kinds add them up (:func:`meshtron.memory.
    layer_activation_bytes` fills the shared parts and asks each kind for its own). ``rep``: parts replicated
    over TP unless sequence parallelism splits them; ``part``: parts always split over TP (per-rank heads,
    MLP columns). A kind adds to them in place, so the sums keep their order."""

    rep: float
    part: float
    # The inputs of the count (read-only for the kinds).
    e: int  # bytes per activation element
    lin: int  # bytes per element of a saved linear input (1: FP8 copies)
    h: int
    tp: int
    heads: int  # query heads on this TP rank
    groups: int  # key/value groups on this TP rank (replicated when fewer than TP)
    stats: int  # bytes of one norm's statistics per row
    seq: int  # sequence per context-parallel rank
    recompute: Optional[str]
    selective: frozenset
    saves: int
    gathered: float  # a compiled column-parallel linear's gathered input beyond its shard (SP), per token
    rowwise_fp8: bool
    fp8: bool
    fp8_sp_path: bool
    fc2_keeps_product: bool
    local_experts: bool
    expert_tp: int
    cp_kv_replicas: int
    flash_attention: bool
    cp: int = 1  # context-parallel size (``seq`` is already this rank's share)


def add_attention_kernel_saves(m: ModelConfig, s: SavedBytes) -> None:
    """What the attention kernel keeps: flash attention its fp32 log-sum-exp (kept by selective recomputation
    too: an output of the kernel); without it the ``s x s`` scores (and with attention dropout its mask and
    output), which ``core_attn`` recomputation drops."""
    if s.flash_attention:
        s.part += 4 * s.heads
    elif "core_attn" not in s.selective:
        s.part += s.heads * s.seq * (s.e + ((1 + s.e) if m.attention_dropout > 0 else 0))


def mlp_saves(m: ModelConfig, s: SavedBytes, width: int, divisor: int, linear_fp8: bool) -> float:
    """An MLP of inner ``width`` split ``divisor`` ways: fc1's output (SwiGLU: gate and up) and the activation's
    output (fc2's input: SwiGLU's product is recomputed by fc2's backward, in FP8 with its casts, except on the
    sequence-parallel FP8 path)."""
    recomputed = "act" in s.selective or (m.swiglu and not s.fc2_keeps_product and s.saves >= 1
                                          and not (linear_fp8 and s.fp8_sp_path)) or (m.swiglu and s.rowwise_fp8)
    out = 0.0 if recomputed else width * (1 if linear_fp8 else s.e)
    return (s.e * (2 * width if m.swiglu else width) + out) / divisor


@dataclass(frozen=True)
class StepWork:
    """One part's forward work for one micro-batch on one rank, as the step-time model counts it: ``fwd_gemm``
    and ``wgrad`` in seconds (timed by the ``gemm`` function the model passes in), ``elementwise`` and
    ``recompute_elementwise`` in bytes moved, ``ep_bytes`` the bytes of one expert all-to-all."""

    fwd_gemm: float
    wgrad: float
    elementwise: float = 0.0
    recompute_elementwise: float = 0.0  # bytes moved again by a recomputing backward (SwiGLU's product)
    ep_bytes: float = 0.0
    fp8_cast_width: int = 0  # FP8 linears of this inner width, whose input and weight casts the layer counts


#: ``gemm(flops, fp8=False, experts=False) -> seconds``: how the step-time model times one GEMM (``experts``: a
#: grouped expert GEMM, at the profile's efficiency for those).
GemmTimer = Callable[..., float]


@dataclass(frozen=True)
class StepInputs:
    """What a kind needs to count its step-time work (:func:`meshtron.planning.layer_costs.layer_cost`)."""

    tokens: float  # tokens of one micro-batch on this CP rank
    tp: int
    ep: int
    expert_tp: int
    rep_div: int  # TP with sequence parallelism, else 1
    e: int
    fp8: bool
    bf16: bool
    saves: int
    fc2_recomputes: bool
    gemm: GemmTimer = field(repr=False, default=None)
    fp8_experts: bool = False  # the routed experts' GEMMs in FP8 too (--fp8-experts)


def _import(path: str) -> Any:
    """``"package.module:Name"`` -> the object (the layer modules import torch: only when a model is built)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class Kind:
    """A layer part's description. ``name`` is its word in ``--layer-pattern``; ``module`` its class as
    ``"package.module:Class"``; ``hf_names`` maps its Hugging Face tensor names (relative to the layer's HF
    part, e.g. ``self_attn.``) to meshtron's (relative to the layer's part, e.g. ``attention.``), where the
    kind has one of its own."""

    name: str = ""
    module: str = ""
    hf_names: dict[str, str] = {}
    #: A module whose ``attention_from_hf(tensors, cfg, rope_interleave)`` / ``attention_to_hf(...)`` change the
    #: values of its tensors on the way in and out of Hugging Face checkpoints ("": names only).
    hf_values: str = ""

    def module_class(self) -> type:
        """The module class (imported now)."""
        return _import(self.module)

    def hf_name(self, ours: str) -> Optional[str]:
        """The Hugging Face name (relative, as in :attr:`hf_names`) of its tensor ``ours``, None if none."""
        return next((hf for hf, name in self.hf_names.items() if name == ours), None)

    def hf_value_converter(self) -> Any:
        """The module of :attr:`hf_values` (imported now), or None."""
        return importlib.import_module(self.hf_values) if self.hf_values else None

    def check(self, m: ModelConfig) -> Optional[str]:
        """Why ``m`` cannot have a layer of this kind (a one-line message), or None."""
        return None

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        """Its 2-D weights with their canonical shapes (biases, norms and other vectors left out)."""
        raise NotImplementedError(f"layer kind {self.name!r} does not describe its matrices")


class MixerKind(Kind):
    """A token mixer: attention of some kind, or (later) a recurrent mixer with its own state."""

    #: Whether context parallelism can split its sequence.
    supports_context_parallel: bool = True
    #: The class of its decode state when generating, ``"package.module:Class"``, made with no arguments and
    #: passed to the mixer as ``cache`` (attention: a key/value cache; a recurrent mixer: its own state).
    decode_state: str = "meshtron.layers.attention:KVCache"

    def new_decode_state(self) -> Any:
        """An empty decode state for one layer (imported now)."""
        return _import(self.decode_state)()

    def build(self, cfg: ModelConfig, ctx: Any, prefix: str, sequence_parallel: bool) -> Any:
        """The module of one layer's mixer, its parameters named ``prefix.*``."""
        return self.module_class()(cfg, ctx, prefix, sequence_parallel)

    def parameters(self, m: ModelConfig) -> Counts:
        """Parameters of one layer's mixer (the layer's norms not included)."""
        raise NotImplementedError

    def rank_parameters(self, m: ModelConfig, tp: int) -> float:
        """Parameters of one layer's mixer on one tensor-parallel rank."""
        raise NotImplementedError

    def rope_dim(self, m: ModelConfig) -> int:
        """Width of the rotary tables it reads (0: none)."""
        return 0

    def head_dims(self, m: ModelConfig) -> tuple[int, int]:
        """(query/key, value) head dims of its attention, for the sequence-dependent FLOPs."""
        return 0, 0

    def sequence_flops_per_token(self, m: ModelConfig, seq: int) -> int:
        """Forward FLOPs per token that grow with the sequence (``seq`` tokens, causal attention counted whole,
        the PaLM convention): the scores and the weighted values."""
        d_qk, d_v = self.head_dims(m)
        return 2 * seq * m.num_attention_heads * (d_qk + d_v)

    def forward_flops_per_token(self, m: ModelConfig, seq: int) -> int:
        """Model FLOPs of its forward per token: two per matmul weight plus :meth:`sequence_flops_per_token`."""
        return 2 * self.parameters(m).matmul + self.sequence_flops_per_token(m, seq)

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        """Add what it keeps for its backward, per token, to ``s`` (its attention kernel's own log-sum-exp or
        scores are counted by the layer)."""
        raise NotImplementedError

    def fp8_weight_elements(self, m: ModelConfig, tp: int) -> float:
        """Elements of its tensor-parallel linears' weights on one TP rank (the FP8 weight copies of
        revision < 2 of :data:`meshtron.planning.layer_costs.LAYER_SAVES`)."""
        return self.rank_parameters(m, tp)

    def projection_widths(self, m: ModelConfig, tp: int) -> tuple[int, int]:
        """(query width, key + value width) on one TP rank: what RoPE, FP8 casts and the context-parallel
        exchanges move per token."""
        raise NotImplementedError

    def cp_exchange_heads(self, m: ModelConfig, tp: int) -> int:
        """Key/value heads per TP rank that all-to-all context parallelism exchanges."""
        raise NotImplementedError

    def cp_state_bytes(self, m: ModelConfig, tp: int, micro_batch: int) -> float:
        """Bytes that one sequence chunk of one TP rank adds to the all-gather of a mixer whose context
        parallelism exchanges recurrent states (``gdn``) instead of keys and values; 0 for attention, whose
        keys and values move by --cp-comm-type."""
        return 0.0

    def cp_kv_replicas(self, m: ModelConfig, tp: int, degree: int) -> int:
        """How many times all-to-all CP over ``degree`` ranks repeats each key/value head of a TP rank."""
        return 1

    def recurrence_work(self, m: ModelConfig, tp: int, micro_batch: int, seq: float, cp: int
                        ) -> Optional[tuple[float, float]]:
        """A recurrent mixer's sequential work on one TP rank for one micro-batch of ``seq`` tokens per sequence
        (this CP rank's share), forward, backward and any recomputation together: (steps of its sequential loop,
        the FLOPs of its small matmuls). None: no recurrence (attention's work is in its scores)."""
        return None

    def forward_gemms(self, m: ModelConfig, tokens: float, tp: int) -> list[float]:
        """Forward FLOPs of each of its GEMMs for ``tokens`` tokens on one TP rank."""
        raise NotImplementedError


class MLPKind(Kind):
    """The MLP part of a layer: dense (gated or not) or a mixture of experts."""

    #: Whether it routes tokens to experts (its parameters then split over expert parallelism).
    has_experts: bool = False

    def build(self, cfg: ModelConfig, ctx: Any, index: int, prefix: str, sequence_parallel: bool) -> Any:
        """The module of layer ``index``'s MLP, its parameters named ``prefix.*``."""
        raise NotImplementedError

    def parameters(self, m: ModelConfig) -> Counts:
        """Parameters of one layer's MLP (the layer's norms not included)."""
        raise NotImplementedError

    def rank_parameters(self, m: ModelConfig, tp: int, ep: int, expert_tp: int) -> RankParameters:
        """Parameters of one layer's MLP on one rank of a TP x EP (expert TP) split."""
        raise NotImplementedError

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        """Add what it keeps for its backward, per token, to ``s`` (the second norm's output included)."""
        raise NotImplementedError

    def backward_working_bytes(self, m: ModelConfig, e: int, tp: int, expert_tp: int) -> float:
        """Per-token bytes its backward allocates at its peak beyond what it saved (the received gradient not
        included)."""
        raise NotImplementedError

    def fp8_weight_elements(self, m: ModelConfig, tp: int, fc2_recast: bool) -> float:
        """Elements of its FP8 linears' weights on one TP rank (``fc2_recast``: SwiGLU's fc2 keeps no copy)."""
        raise NotImplementedError

    def step_work(self, m: ModelConfig, x: StepInputs) -> StepWork:
        """Its GEMM seconds and elementwise bytes for one micro-batch on one rank (the step-time model's)."""
        raise NotImplementedError


def mlp_rank_parameters(m: ModelConfig, width: int, tp: int) -> float:
    """One (dense or expert) MLP of inner ``width`` on one rank of a ``tp``-way split: fc1 (two halves with
    SwiGLU) and fc2 split, fc2's bias replicated."""
    fan_in = 2 * width if m.swiglu else width
    weights = (m.hidden_size * fan_in + width * m.hidden_size) / tp
    biases = 0 if m.disable_bias_linear else fan_in / tp + m.hidden_size
    return weights + biases


def mlp_matrices(m: ModelConfig, width: int, prefix: str = "", expert: bool = False) -> list[Matrix]:
    """The matrices of one (dense, expert or shared) MLP of inner ``width``, named under ``prefix``: gate and up
    (up alone without SwiGLU), then down."""
    fc1 = ["gate", "up"] if m.swiglu else ["up"]
    H = m.hidden_size
    return ([Matrix(f"{prefix}{name}.weight", width, H, expert) for name in fc1]
            + [Matrix(f"{prefix}down.weight", H, width, expert)])


def mlp_weights(m: ModelConfig, width: int) -> int:
    """Matmul weights of one MLP of inner ``width``."""
    return m.hidden_size * (2 * width if m.swiglu else width) + width * m.hidden_size


def norm_parameters(m: ModelConfig) -> int:
    """Parameters of one norm over the hidden size (RMSNorm: a scale; LayerNorm: scale and shift)."""
    return m.hidden_size if m.normalization == "RMSNorm" else 2 * m.hidden_size
