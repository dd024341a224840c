"""How each local parameter relates to the model's canonical (unsharded) tensors.

Every parameter of a meshtron model carries a :class:`ShardSpec`: the list of
canonical tensors it is cut from (by global name, e.g.
``layers.3.attention.q.weight``), which slice of each, and how the slices are
concatenated. A fused QKV weight on tensor-parallel rank r is, for example,
``cat(q[rows of r], k[rows of r], v[rows of r])``.

This one description serves three jobs:

* initialisation independent of the parallel layout (DESIGN.md section 4): each
  canonical tensor is drawn from a generator seeded by (seed, name); a rank
  materialises only its slices;
* checkpoints and conversion, which store canonical tensors with offsets;
* tests, which gather canonical tensors/gradients and compare with one process.

Rows past the end of a canonical tensor (vocabulary padding) are zeros.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class Piece:
    """A slice ``[start, start+length)`` along ``dim`` of the canonical tensor ``name``."""

    name: str
    full_shape: tuple
    dim: int
    start: int
    length: int
    init: str = "normal"  # "normal", "ones" or "zeros"
    std: float = 0.02

    @property
    def shape(self) -> tuple:
        s = list(self.full_shape)
        s[self.dim] = self.length
        return tuple(s)

    @property
    def valid_length(self) -> int:
        """Length that lies inside the canonical tensor (the rest is padding)."""
        return max(0, min(self.length, self.full_shape[self.dim] - self.start))

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.length == self.full_shape[self.dim]


def whole(name: str, shape: tuple, init: str = "normal", std: float = 0.02) -> Piece:
    return Piece(name, tuple(shape), 0, 0, shape[0], init, std)


def shard(name: str, shape: tuple, dim: int, index: int, parts: int, init: str = "normal", std: float = 0.02,
          padded_size: Optional[int] = None) -> Piece:
    """Slice ``index`` of ``parts`` equal slices along ``dim`` (of ``padded_size`` if given)."""
    size = padded_size if padded_size is not None else shape[dim]
    assert size % parts == 0, f"{name}: {size} not divisible by {parts}"
    length = size // parts
    return Piece(name, tuple(shape), dim, index * length, length, init, std)


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter is assembled from canonical pieces.

    ``grad_sync`` names the group over which this parameter's gradient must be summed
    before the data-parallel reduction: "tp" for parameters replicated over TP whose
    inputs were split along the sequence (sequence parallelism), "kv" for key/value
    projections replicated over a subset of TP ranks (GQA with TP > query groups).
    ``tp_replicated`` says the parameter is identical on all TP ranks (counted once in norms).
    """

    pieces: tuple
    cat_dim: int = 0
    tp_replicated: bool = False
    grad_sync: Optional[str] = None
    expert: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def shape(self) -> tuple:
        shape = list(self.pieces[0].shape)
        shape[self.cat_dim] = sum(p.shape[self.cat_dim] for p in self.pieces)
        return tuple(shape)


SPEC_ATTR = "_meshtron_spec"


def new_param(spec: ShardSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "meta") -> nn.Parameter:
    """An uninitialised parameter of the spec's local shape, carrying the spec."""
    p = nn.Parameter(torch.empty(spec.shape, dtype=dtype, device=device))
    setattr(p, SPEC_ATTR, spec)
    return p


def spec_of(param: torch.Tensor) -> ShardSpec:
    return getattr(param, SPEC_ATTR)


def canonical_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a canonical tensor's name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def generate_canonical(piece: Piece, seed: int, device: torch.device) -> torch.Tensor:
    """The full canonical tensor of ``piece.name`` in fp32 (depends only on seed and name)."""
    if piece.init == "ones":
        return torch.ones(piece.full_shape, device=device)
    if piece.init == "zeros":
        return torch.zeros(piece.full_shape, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(canonical_seed(seed, piece.name))
    out = torch.empty(piece.full_shape, device=device)
    out.normal_(0.0, piece.std, generator=gen)
    return out


def cut(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """Take ``piece`` out of its full canonical tensor, zero-padding past the end."""
    valid = piece.valid_length
    part = full.narrow(piece.dim, piece.start, valid) if valid > 0 else full.narrow(piece.dim, 0, 0)
    if valid == piece.length:
        return part
    pad_shape = list(piece.shape)
    pad_shape[piece.dim] = piece.length - valid
    return torch.cat([part, full.new_zeros(pad_shape)], dim=piece.dim)


def split_local(tensor: torch.Tensor, spec: ShardSpec) -> list[torch.Tensor]:
    """Split a local parameter (or its gradient) into its pieces."""
    sizes = [p.shape[spec.cat_dim] for p in spec.pieces]
    return list(torch.split(tensor, sizes, dim=spec.cat_dim))


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """Materialise every parameter of a meta-device model on ``device`` from its canonical pieces.

    Parameters become ``dtype``; buffers keep their own dtype (e.g. the fp32 expert bias of a
    router) and, when they carry a ShardSpec, are filled from it like parameters (others are zeroed).
    """
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    buffers = {name: (getattr(b, SPEC_ATTR, None), b.dtype) for name, b in model.named_buffers()}
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if torch.device(device).type == "meta":  # a planned rank (meshtron.planning): shapes and dtypes, no values
        return
    model.to_empty(device=device)  # creates new Parameter and buffer objects: re-attach the specs
    for name, param in model.named_parameters():
        spec = specs[name]
        setattr(param, SPEC_ATTR, spec)
        param.data.copy_(_materialise(spec, seed, device).to(dtype))
    for name, buf in model.named_buffers():
        spec, buf_dtype = buffers[name]
        buf.data = (_materialise(spec, seed, device) if spec is not None
                    else torch.zeros(buf.shape, device=device)).to(buf_dtype)
        if spec is not None:
            setattr(buf, SPEC_ATTR, spec)


def _materialise(spec: ShardSpec, seed: int, device: torch.device) -> torch.Tensor:
    return torch.cat([cut(generate_canonical(p, seed, device), p) for p in spec.pieces], dim=spec.cat_dim)


def spec_buffers(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Buffers that are part of the model's state (they carry a ShardSpec): saved in checkpoints."""
    return ((name, b) for name, b in model.named_buffers() if getattr(b, SPEC_ATTR, None) is not None)


def canonical_shapes(models: Iterable[nn.Module]) -> dict[str, tuple]:
    """Every canonical tensor the parameters of ``models`` are cut from: name -> full (unpadded) shape.

    Each tensor is listed once, however many pieces, chunks or tied copies hold it: the facts of the
    architecture (parameter counts, checkpoint contents) read from the model as built.
    """
    shapes: dict[str, tuple] = {}
    for model in models:
        for param in model.parameters():
            for piece in spec_of(param).pieces:
                shapes.setdefault(piece.name, tuple(piece.full_shape))
    return shapes


def iter_pieces(model: nn.Module, which: str = "param") -> Iterable[tuple[Piece, torch.Tensor, ShardSpec]]:
    """Yield (piece, local slice, spec) for every piece of every parameter (``which`` = param or grad)."""
    for _, param in model.named_parameters():
        spec = spec_of(param)
        if which == "param":
            tensor = param.detach()
        else:
            tensor = getattr(param, "main_grad", None)
            if tensor is None:
                tensor = param.grad
            if tensor is None:
                continue
        for piece, part in zip(spec.pieces, split_local(tensor, spec)):
            yield piece, part, spec


def gather_canonical(models: Iterable[nn.Module], which: str = "param",
                     group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """Assemble full canonical tensors (or gradients) from every rank's pieces. For tests and tools.

    Every rank of ``group`` (default: the world) receives the whole dict. Replicated pieces
    must agree; the first one seen wins.
    """
    local = []
    for model in models:
        for piece, part, _ in iter_pieces(model, which):
            valid = piece.valid_length
            local.append((piece, part.narrow(piece.dim, 0, valid).detach().float().cpu().clone()))
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    else:
        gathered = [local]
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for rank_items in gathered:
        for piece, part in rank_items:
            if piece.name not in out:
                out[piece.name] = torch.full(piece.full_shape, float("nan"))
                filled[piece.name] = 0
            region = out[piece.name].narrow(piece.dim, piece.start, piece.valid_length)
            if torch.isnan(region).any():
                region.copy_(part)
    return out


def scaled_std(std: float, num_layers: int) -> float:
    """Std of output projections: scaled by 1/sqrt(2 * layers) (GPT-2 / Megatron)."""
    return std / math.sqrt(2.0 * num_layers)


ParamFilter = Callable[[torch.Tensor], bool]
