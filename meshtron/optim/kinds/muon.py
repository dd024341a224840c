"""``--optimizer muon``: momentum orthogonalised by a Newton-Schulz iteration, for the hidden matrices.

For every canonical weight matrix ``W`` (m x n) of the transformer layers (attention q, k, v, o, MLP gate,
up, down, experts' matrices, MLA projections) with reduced gradient ``G``, at learning rate ``lr``::

    M <- mu M + (1 - mu) G                       (--muon-momentum mu, the state "momentum_buffer")
    U <- (1 - mu) G + mu M  with --muon-nesterov, else M
    O <- NS(U)                                   (--muon-num-ns-steps quintic iterations, below)
    W <- W (1 - lr wd) - lr s O                  (decoupled weight decay --weight-decay wd)

``NS`` normalises ``U`` by its Frobenius norm (+1e-7), works on the wide orientation (``X`` with m <= n) and
iterates ``A = X X^T``, ``X <- a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, which
drives every singular value toward 1. The scale ``s`` is ``--muon-extra-scale-factor`` times
``sqrt(max(m, n))`` (``--muon-scale-mode spectral``), ``sqrt(m / n)`` (``unit_rms_norm``) or
``sqrt(max(1, m / n))`` (``shape_scaling``); spectral with 0.2 gives updates of AdamW's RMS (Moonlight's rule).

Everything else falls back to AdamW (with the AdamW flags and the same learning rate): the word and
position embeddings, the output layer, MoE routers, and every tensor that is not a matrix (norms,
biases). The rule reads the parameter's canonical pieces only, so it is the same in every layout.

Each canonical matrix is orthogonalised on its own: a fused local parameter (q, k and v; gate and up)
is split into its pieces first. A matrix split by tensor parallelism is all-gathered over the TP group
and every TP rank orthogonalises it whole and keeps its own rows or columns (``--muon-tp-mode
duplicated``, equal to one process; ``blockwise`` orthogonalises each TP shard on its own instead).
With a sharded optimizer (``--use-distributed-optimizer``, ZeRO-2/3) the layout gives every parameter
one owner among the data-parallel ranks (layout need :data:`~meshtron.optim.registry.WHOLE`), which
alone updates it; the weights' all-gather brings it to the others.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.optim.registry import WHOLE, OptimizerKind, StepWork
from meshtron.parallel.sharding import ShardSpec, cut, spec_of, split_local

#: Newton-Schulz coefficients by --muon-coefficient-type.
NS_COEFFICIENTS = {"quintic": (3.4445, -4.7750, 2.0315)}
NS_EPS = 1e-7
#: The states of a parameter Muon updates (the others keep AdamW's).
STATES = ("master", "momentum_buffer")


# ----------------------------------------------------------------------------------------- the rule
def _adamw_tensor(name: str) -> bool:
    parts = name.split(".")
    return parts[0] in ("embedding", "output") or "router" in parts


def uses_muon(pieces: Sequence) -> bool:
    """Whether a parameter cut from ``pieces`` is updated by Muon: every piece a hidden matrix (2-D, not an
    embedding, output layer or router)."""
    return bool(pieces) and all(len(p.full_shape) == 2 and not _adamw_tensor(p.name) for p in pieces)


def _states(pieces) -> tuple[str, ...]:
    from meshtron.optim.optimizer import STATES as ADAMW_STATES

    return STATES if uses_muon(pieces) else ADAMW_STATES


def _state_bytes(cfg, pieces) -> int:
    from meshtron.optim.kinds.adamw import moment_bytes

    return 4 if uses_muon(pieces) else moment_bytes(cfg)


# ----------------------------------------------------------------------------------------- the update
def newton_schulz(matrix: torch.Tensor, steps: int, coefficients: str = "quintic") -> torch.Tensor:
    """The orthogonalisation of ``matrix`` (2-D) by ``steps`` Newton-Schulz iterations, in fp32."""
    a, b, c = NS_COEFFICIENTS[coefficients]
    x = matrix.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.mT if tall else x


def scale_factor(rows: int, cols: int, mode: str, extra: float = 1.0) -> float:
    """The update scale of a ``rows`` x ``cols`` matrix (--muon-scale-mode, --muon-extra-scale-factor)."""
    if mode == "spectral":
        s = math.sqrt(max(rows, cols))
    elif mode == "unit_rms_norm":
        s = math.sqrt(rows / cols)
    elif mode == "shape_scaling":
        s = math.sqrt(max(1.0, rows / cols))
    else:
        raise ValueError(f"unknown --muon-scale-mode {mode!r}")
    return s * extra


def orthogonal_update(matrix: torch.Tensor, cfg) -> torch.Tensor:
    """``s NS(matrix)`` for one whole matrix."""
    return newton_schulz(matrix, cfg.muon_num_ns_steps, cfg.muon_coefficient_type) * scale_factor(
        matrix.size(0), matrix.size(1), cfg.muon_scale_mode, cfg.muon_extra_scale_factor)


class MatrixUpdates:
    """Orthogonalised updates of local parameters, each canonical matrix taken whole.

    ``params``: the parameters this rank updates, in the order it updates them; its tensor-parallel peers
    update the same parameters (their own shards) in the same order, since their layouts are the same, so
    the all-gathers pair up. Which slices the peers hold is exchanged once, here.
    """

    def __init__(self, params: Sequence[nn.Parameter], cfg, ctx=None):
        self.cfg = cfg
        self.specs = [spec_of(p) for p in params]
        group = getattr(ctx, "tp_group", None) if ctx is not None else None
        duplicated = cfg.muon_tp_mode == "duplicated" and group is not None and ctx.tp > 1
        self.group = group if duplicated else None
        split = [any(not piece.is_whole for piece in spec.pieces) for spec in self.specs]
        self.peers: list[Optional[list[ShardSpec]]] = [None] * len(self.specs)
        if self.group is not None and any(split):
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, [spec.pieces if s else None for spec, s in zip(self.specs, split)],
                                   group=self.group)
            for k, s in enumerate(split):
                if s:
                    self.peers[k] = [ShardSpec(tuple(e[k]), cat_dim=self.specs[k].cat_dim) for e in everyone]

    def update(self, k: int, local: torch.Tensor) -> torch.Tensor:
        """The orthogonalised, scaled update of parameter ``k`` from its local momentum ``local`` (fp32,
        parameter-shaped): a collective over the TP group where the parameter's matrices are split."""
        spec = self.specs[k]
        peers = self.peers[k]
        if peers is None:  # whole matrices (or --muon-tp-mode blockwise: each local piece on its own)
            outs = [orthogonal_update(part, self.cfg) for part in split_local(local, spec)]
            return torch.cat(outs, dim=spec.cat_dim) if len(outs) > 1 else outs[0]
        flat = local.contiguous().reshape(-1)
        gathered = [torch.empty_like(flat) for _ in peers]
        dist.all_gather(gathered, flat, group=self.group)
        full: dict[str, torch.Tensor] = {}
        for peer, data in zip(peers, gathered):
            for piece, part in zip(peer.pieces, split_local(data.view(peer.shape), peer)):
                whole = full.setdefault(piece.name, local.new_zeros(piece.full_shape))
                valid = piece.valid_length
                whole.narrow(piece.dim, piece.start, valid).copy_(part.narrow(piece.dim, 0, valid))
        outs = [cut(orthogonal_update(full[piece.name], self.cfg), piece) for piece in spec.pieces]
        return torch.cat(outs, dim=spec.cat_dim) if len(outs) > 1 else outs[0]


def _momentum_step(momentum: torch.Tensor, grad: torch.Tensor, cfg) -> torch.Tensor:
    """Advance ``momentum`` in place with ``grad``; the tensor to orthogonalise."""
    mu = cfg.muon_momentum
    momentum.lerp_(grad, 1.0 - mu)
    return grad.lerp(momentum, mu) if cfg.muon_nesterov else momentum


# ----------------------------------------------------------------------------------------- one rank, every parameter
class MixedPrecisionMuon:
    """Muon over every parameter of this rank (AdamW for the fallback ones), with fp32 masters and
    gradients from ``param.main_grad`` (the TrainingOptimizer interface)."""

    def __init__(self, params: Sequence[nn.Parameter], cfg, ctx=None):
        from meshtron.optim.optimizer import MixedPrecisionAdamW

        self.params = list(params)
        self.cfg = cfg
        muon = [uses_muon(spec_of(p).pieces) for p in self.params]
        self._muon_pos = {i: k for k, i in enumerate(i for i, m in enumerate(muon) if m)}
        self._adam_pos = {i: k for k, i in enumerate(i for i, m in enumerate(muon) if not m)}
        self.muon_params = [p for p, m in zip(self.params, muon) if m]
        adam_params = [p for p, m in zip(self.params, muon) if not m]
        self.adam = MixedPrecisionAdamW(adam_params, cfg) if adam_params else None
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.muon_params]
        self.momentum: list[Optional[torch.Tensor]] = [None] * len(self.muon_params)
        self.updates = MatrixUpdates(self.muon_params, cfg, ctx)
        self._step = 0

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None) -> None:
        if self.adam is not None:
            self.adam.step(lr, grad_coef)
        self.ensure_state()
        decay = 1.0 - lr * self.cfg.weight_decay
        for k, (p, master) in enumerate(zip(self.muon_params, self.masters)):
            grad = p.main_grad.float()
            if grad_coef is not None:
                grad = grad * grad_coef
            update = self.updates.update(k, _momentum_step(self.momentum[k], grad, self.cfg))
            master.mul_(decay).add_(update, alpha=-lr)
            if master is not p:
                p.data.copy_(master)
        self._step += 1

    def state_names(self, index: int) -> tuple[str, ...]:
        return STATES if index in self._muon_pos else self.adam.state_names(self._adam_pos[index])

    def state_tensors(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._muon_pos:
            return self.adam.state_tensors(self._adam_pos[index])
        k = self._muon_pos[index]
        out = {"master": self.masters[k].data}
        if self.momentum[k] is not None:
            out["momentum_buffer"] = self.momentum[k]
        return out

    @torch.no_grad()
    def load_state_tensors(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        if index not in self._muon_pos:
            self.adam.load_state_tensors(self._adam_pos[index], tensors)
            return
        self.ensure_state()
        k = self._muon_pos[index]
        if "master" in tensors:
            self.masters[k].data.copy_(tensors["master"])
            if self.masters[k] is not self.muon_params[k]:
                self.muon_params[k].data.copy_(self.masters[k].data)
        if "momentum_buffer" in tensors:
            self.momentum[k].copy_(tensors["momentum_buffer"])

    def ensure_state(self) -> None:
        if self.adam is not None:
            self.adam.ensure_state()
        for k, master in enumerate(self.masters):
            if self.momentum[k] is None:
                self.momentum[k] = torch.zeros_like(master.data, dtype=torch.float32)

    @property
    def step_count(self) -> int:
        return self._step

    def set_step_count(self, step: int) -> None:
        self._step = step
        if self.adam is not None:
            self.adam.set_step_count(step)

    def finish_param_gather(self) -> None:
        """Nothing to wait for: the parameters are the weights."""

    def weights_written(self) -> None:
        """Nothing to copy: the masters follow the weights through load_state_tensors."""


# ----------------------------------------------------------------------------------------- distributed optimizer part
class SegmentMuon:
    """Muon stepping whole parameters owned by this rank (segments of the flat buffers), a partition of the
    distributed optimizer with SegmentAdamW's interface."""

    def __init__(self, segments, params: Sequence[nn.Parameter], grad_data, param_data: torch.Tensor, cfg, ctx):
        from meshtron.optim.grad_buffer import grad_region

        self.segments = [s for s in segments if s.length > 0]
        for s in self.segments:
            if s.param_offset != 0 or s.length != params[s.param_index].numel():
                raise ValueError("Muon steps whole parameters: the layout must not cut one across ranks "
                                 "(meshtron.optim.buckets.place_buckets(whole=True))")
        self.shapes = [params[s.param_index].shape for s in self.segments]
        self.grad_views = [grad_region(grad_data, s.buffer_offset, s.buffer_offset + s.length) for s in self.segments]
        self.param_data = param_data
        self.cfg = cfg
        self.aliased = param_data.dtype == torch.float32
        views = [param_data[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments]
        self.master_flat: Optional[torch.Tensor] = None
        if self.aliased:
            self.masters = views
        else:
            numel = sum(s.length for s in self.segments)
            self.master_flat = torch.empty(numel, dtype=torch.float32, device=param_data.device)
            self.masters, offset = [], 0
            for v, s in zip(views, self.segments):
                self.masters.append(self.master_flat[offset:offset + s.length])
                self.masters[-1].copy_(v)
                offset += s.length
        self.momentum: list[Optional[torch.Tensor]] = [None] * len(self.segments)
        self.updates = MatrixUpdates([params[s.param_index] for s in self.segments], cfg, ctx)

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        if self.segments:
            torch._foreach_mul_(self.grad_views, coef)

    def fetch_grads(self) -> None:
        """Device partitions only (Muon's state is not offloaded)."""

    @torch.no_grad()
    def step(self, lr: float, grad_coef: Optional[torch.Tensor] = None, step_number: int = 0) -> None:
        self.ensure_state(step_number)
        decay = 1.0 - lr * self.cfg.weight_decay
        for k, (grad, master, shape) in enumerate(zip(self.grad_views, self.masters, self.shapes)):
            grad = grad.float()
            if grad_coef is not None:
                grad = grad * grad_coef
            update = self.updates.update(k, _momentum_step(self.momentum[k], grad, self.cfg).view(shape))
            master.mul_(decay).add_(update.reshape(-1), alpha=-lr)

    @torch.no_grad()
    def store_params(self) -> None:
        if self.segments and not self.aliased:
            torch._foreach_copy_([self.param_data[s.buffer_offset:s.buffer_offset + s.length] for s in self.segments],
                                 self.masters)

    def finish_store(self) -> None:
        """Nothing in flight."""

    def ensure_state(self, step: int) -> None:
        for k, master in enumerate(self.masters):
            if self.momentum[k] is None:
                self.momentum[k] = torch.zeros_like(master, dtype=torch.float32)

    def state_of(self, position: int) -> dict[str, torch.Tensor]:
        out = {"master": self.masters[position]}
        if self.momentum[position] is not None:
            out["momentum_buffer"] = self.momentum[position]
        return out

    @torch.no_grad()
    def load_segment(self, position: int, key: str, values: torch.Tensor) -> None:
        self.state_of(position)[key].copy_(values)
        if key == "master" and not self.aliased:
            s = self.segments[position]
            self.param_data[s.buffer_offset:s.buffer_offset + s.length].copy_(self.masters[position])

    def set_step(self, step: int) -> None:
        """Muon has no step counter (no bias correction)."""

    def state_bytes(self) -> int:
        total = 0 if self.master_flat is None else self.master_flat.numel() * 4
        return total + sum(m.numel() * 4 for m in self.momentum if m is not None)


def _partitions(segments, params, grad_data, param_data, cfg, ctx, host):
    from meshtron.optim.segment_adam import SegmentAdamW

    muon = [s for s in segments if uses_muon(spec_of(params[s.param_index]).pieces)]
    adam = [s for s in segments if not uses_muon(spec_of(params[s.param_index]).pieces)]
    parts = [SegmentAdamW(adam, grad_data, param_data, cfg, host=host)]
    if host:
        if muon:
            raise ValueError("Muon's state is not offloaded to the host")
        return parts
    return parts + [SegmentMuon(muon, params, grad_data, param_data, cfg, ctx)]


# ----------------------------------------------------------------------------------------- checks and costs
def _check(cfg) -> None:
    from meshtron.errors import ConfigError

    o = cfg.optim
    if o.optimizer_cpu_offload:
        raise ConfigError("--optimizer muon with --optimizer-cpu-offload is not implemented: Muon's step runs on "
                          "the device")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {o.muon_momentum}")
    if o.muon_num_ns_steps < 1:
        raise ConfigError(f"--muon-num-ns-steps must be at least 1, got {o.muon_num_ns_steps}")
    if not (math.isfinite(o.muon_extra_scale_factor) and o.muon_extra_scale_factor > 0):
        raise ConfigError(f"--muon-extra-scale-factor must be positive, got {o.muon_extra_scale_factor}")


def layer_matrices(m) -> list[tuple[int, int, bool]]:
    """(rows, cols, expert) of one transformer layer's canonical matrices that Muon updates (dense
    attention and MLP; with experts, every expert's), from the model config."""
    from meshtron.config import ffn_size, head_dim, num_kv_heads

    H, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, num_kv_heads(m) * d
    out = [(q, H, False), (kv, H, False), (kv, H, False), (H, q, False)]
    mlp = lambda f, expert: ([(f, H, expert)] * (2 if m.swiglu else 1)) + [(H, f, expert)]  # noqa: E731
    if m.num_experts:
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        for _ in range(m.num_experts):
            out += mlp(fe, True)
        if m.moe_shared_expert_intermediate_size:
            out += mlp(m.moe_shared_expert_intermediate_size, False)
    else:
        out += mlp(ffn_size(m), False)
    return out


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` quintic iterations on a rows x cols matrix (X X^T, A A, B X)."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4.0 * small * small * large + 2.0 * small ** 3)


def _step_work(cfg, tp: int, dp: int, pp: int, ep: int = 1) -> StepWork:
    """One rank's Newton-Schulz FLOPs and TP gathers per step: the stage's matrices (layers / PP) split over
    their owners (DP x CP ranks; experts over EP too), each orthogonalised whole on every rank of its TP group
    (duplicated: TP does not divide the work) after an all-gather of fp32 momentum of (TP - 1) / TP of it."""
    m, o = cfg.model, cfg.optim
    layers = m.num_layers / max(1, pp)
    flops = gathered = count = 0.0
    for rows, cols, expert in layer_matrices(m):
        owners = dp * (ep if expert else 1)
        flops += ns_flops(rows, cols, o.muon_num_ns_steps) * layers / owners
        if tp > 1 and o.muon_tp_mode == "duplicated":
            gathered += 4.0 * rows * cols * layers / owners
            count += layers / owners
    if tp > 1 and o.muon_tp_mode == "blockwise":
        flops /= tp
    return StepWork(matmul_flops=flops, gather_bytes=gathered, gathers=int(math.ceil(count)))


KIND = OptimizerKind(name="muon", layout=WHOLE, state_names=_states, state_bytes=_state_bytes,
                     build=lambda params, cfg, ctx: MixedPrecisionMuon(params, cfg, ctx), partitions=_partitions,
                     check=_check, step_work=_step_work,
                     description="Muon for hidden matrices, AdamW for the rest; state: master, momentum_buffer")
