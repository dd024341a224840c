"""Muon's update (torch): Newton-Schulz orthogonalisation, the one-process optimizer and the distributed
optimizer's part; the rule is in :mod:`meshtron.optim.muon_rule`, the flags and costs in
:mod:`meshtron.optim.kinds.muon`."""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.optim.muon_rule import NS_COEFFICIENTS, NS_EPS, STATES, uses_muon
from meshtron.optim.segment_momentum import SegmentMomentum
from meshtron.parallel.sharding import ShardSpec, cut, spec_of, split_local

# ----------------------------------------------------------------------------------------- the update
def newton_schulz(matrix: torch.Tensor, steps: int, coefficients: str = "quintic",
                  precision: str = "highest") -> torch.Tensor:
    """The orthogonalisation of ``matrix`` (2-D) by ``steps`` Newton-Schulz iterations of fp32 values; on CUDA
    the matmuls run at ``precision`` (torch.set_float32_matmul_precision's names: high and medium allow TF32)."""
    if matrix.is_cuda and precision != torch.get_float32_matmul_precision():
        with _float32_matmul_precision(precision):
            return newton_schulz(matrix, steps, coefficients, precision)
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


@contextlib.contextmanager
def _float32_matmul_precision(precision: str):
    """torch's fp32 matmul precision set to ``precision`` inside, restored after (the step's own matmuls only)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


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
    return newton_schulz(matrix, cfg.muon_num_ns_steps, cfg.muon_coefficient_type,
                         cfg.muon_fp32_matmul_prec) * scale_factor(
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
class SegmentMuon(SegmentMomentum):
    """Muon stepping whole parameters owned by this rank (segments of the flat buffers), a partition of the
    distributed optimizer with SegmentAdamW's interface."""

    STATE = "momentum_buffer"

    def __init__(self, segments, params: Sequence[nn.Parameter], grad_data, param_data: torch.Tensor, cfg, ctx):
        super().__init__(segments, grad_data, param_data, cfg)
        for s in self.segments:
            if s.param_offset != 0 or s.length != params[s.param_index].numel():
                raise ValueError("Muon steps whole parameters: the layout must not cut one across ranks "
                                 "(meshtron.optim.buckets.place_buckets(whole=True))")
        self.shapes = [params[s.param_index].shape for s in self.segments]
        self.updates = MatrixUpdates([params[s.param_index] for s in self.segments], cfg, ctx)

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


def partitions(segments, params, grad_data, param_data, cfg, ctx, host):
    """The parts that step ``segments`` for the distributed optimizer: AdamW for the fallback tensors, Muon
    for the hidden matrices."""
    from meshtron.optim.segment_adam import SegmentAdamW

    muon = [s for s in segments if uses_muon(spec_of(params[s.param_index]).pieces)]
    adam = [s for s in segments if not uses_muon(spec_of(params[s.param_index]).pieces)]
    parts = [SegmentAdamW(adam, grad_data, param_data, cfg, host=host)]
    if host:
        if muon:
            raise ValueError("Muon's state is not offloaded to the host")
        return parts
    return parts + [SegmentMuon(muon, params, grad_data, param_data, cfg, ctx)]


