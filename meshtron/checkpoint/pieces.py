"""Checkpoint state dicts made of canonical tensors: global names, global shapes, offsets.

Every model parameter is cut from canonical tensors (see
:mod:`meshtron.parallel.sharding`). A checkpoint stores each canonical tensor once,
under its global name and full shape, as the regions the saving ranks held (a
:class:`SavedShard` each; DCP calls them chunks, a word meshtron keeps for model chunks
elsewhere); any other layout reads back the regions it needs. This module turns a rank's
parameters and optimizer state into such entries and wraps them for
torch.distributed.checkpoint (DCP).

Keys: ``model.<name>`` for the model's tensors (in the parameters' dtype) and
``optim.<state>.<name>`` for the optimizer's fp32 states: ``master`` and those its ``--optimizer``
entry names for the parameter (AdamW's ``exp_avg`` and ``exp_avg_sq``, Muon's ``momentum_buffer``;
:mod:`meshtron.optim.registry`), asked of the optimizer as ``state_names(index)``. Only rows inside the canonical tensor are stored (vocabulary
padding is not). Ranks that hold the same chunk (TP-replicated norms, DP
replicas, replicated GQA key/value heads, the tied output layer of the last
pipeline stage) offer identical (name, offset) entries, which DCP writes once.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from meshtron.checkpoint.errors import CheckpointError
from meshtron.parallel.sharding import SPEC_ATTR, Piece, ShardSpec, spec_buffers, split_local

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
#: AdamW's states: what an optimizer without ``state_names`` keeps.
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


def state_names_of(optimizer, index: int) -> tuple[str, ...]:
    """The states ``optimizer`` keeps for parameter ``index`` (its ``state_names``, else AdamW's)."""
    names = getattr(optimizer, "state_names", None)
    return tuple(names(index)) if names is not None else OPTIM_STATES


def model_key(name: str) -> str:
    return MODEL_PREFIX + name


def optim_key(state: str, name: str) -> str:
    return f"{OPTIM_PREFIX}{state}.{name}"


def canonical_name(key: str) -> str:
    """The canonical tensor name of a checkpoint key (``model.x`` or ``optim.exp_avg.x`` -> ``x``)."""
    if key.startswith(MODEL_PREFIX):
        return key[len(MODEL_PREFIX):]
    if key.startswith(OPTIM_PREFIX):
        return key[len(OPTIM_PREFIX):].split(".", 1)[1]
    return key


@dataclass(frozen=True)
class SavedShard:
    """One region of a canonical tensor held by this rank: ``data`` sits at ``offsets`` of ``global_shape``."""

    key: str
    global_shape: tuple
    offsets: tuple
    data: torch.Tensor


def _spec(param: torch.Tensor, where: str) -> ShardSpec:
    spec = getattr(param, SPEC_ATTR, None)
    if spec is None:
        raise CheckpointError(f"{where} has no sharding description (a ShardSpec); meshtron checkpoints store "
                              "canonical tensors and need every parameter to carry one")
    return spec


def piece_shard(key: str, piece: Piece, part: torch.Tensor) -> Optional[SavedShard]:
    """The stored region of one local piece: its rows inside the canonical tensor (None if all padding)."""
    valid = piece.valid_length
    if valid <= 0:
        return None
    offsets = [0] * len(piece.full_shape)
    offsets[piece.dim] = piece.start
    return SavedShard(key, tuple(piece.full_shape), tuple(offsets), part.narrow(piece.dim, 0, valid))


def _shards_of(tensor: torch.Tensor, spec: ShardSpec, key_of) -> Iterator[SavedShard]:
    for piece, part in zip(spec.pieces, split_local(tensor, spec)):
        chunk = piece_shard(key_of(piece.name), piece, part)
        if chunk is not None:
            yield chunk


def model_shards(models: Sequence[nn.Module], parameters: bool = True) -> list[SavedShard]:
    """This rank's chunks of every canonical model tensor (views of the parameters); ``parameters`` False:
    of the model's state buffers only (the weights then come from their shards, see :mod:`.owned`)."""
    out: list[SavedShard] = []
    for index, model in enumerate(models):
        for name, param in model.named_parameters() if parameters else ():
            spec = _spec(param, f"model chunk {index} parameter {name!r}")
            out.extend(_shards_of(param.detach(), spec, model_key))
        for name, buf in spec_buffers(model):  # e.g. the MoE router's expert bias
            out.extend(_shards_of(buf, _spec(buf, f"model chunk {index} buffer {name!r}"), model_key))
    return out


def state_shards(param: torch.Tensor, index: int, tensors: dict[str, torch.Tensor],
                 states: Iterable[str] = OPTIM_STATES) -> list[SavedShard]:
    """The chunks of one parameter's optimizer state (``tensors`` as ``state_tensors(index)`` returns them)."""
    spec = _spec(param, f"optimizer parameter {index}")
    states = tuple(states)
    missing = [s for s in states if s not in tensors]
    if missing:
        raise CheckpointError(f"optimizer parameter {index} has no {', '.join(missing)} state "
                              "(call optimizer.ensure_state() first)")
    out: list[SavedShard] = []
    for state in states:
        out.extend(_shards_of(tensors[state], spec, lambda n, s=state: optim_key(s, n)))
    return out


def optimizer_shards_by_param(optimizer, states: Optional[Iterable[str]] = None) -> Iterator[list[SavedShard]]:
    """This rank's chunks of the optimizer state, one list per parameter of ``optimizer.params``, in order.

    Calls ``optimizer.state_tensors(i)`` for every index in order: with a distributed
    optimizer that is a collective over the data-parallel group, and the tensors are
    gathered copies, which a caller may move to the host before asking for the next. ``states``: the
    states to save (default: those the optimizer keeps for each parameter).
    """
    for i, param in enumerate(optimizer.params):
        names = state_names_of(optimizer, i) if states is None else states
        yield state_shards(param, i, optimizer.state_tensors(i), names)


def optimizer_shards(optimizer, states: Optional[Iterable[str]] = None) -> list[SavedShard]:
    """All of :func:`optimizer_shards_by_param` in one list."""
    return [c for chunks in optimizer_shards_by_param(optimizer, states) for c in chunks]


def state_tensors_are_views(optimizer) -> bool:
    """Whether ``state_tensors`` returns the optimizer's own tensors (an optimizer over every parameter)
    rather than gathered copies (the distributed optimizer), which cost memory until released."""
    from meshtron.optim.distributed_optimizer import DistributedOptimizer

    return not isinstance(optimizer, DistributedOptimizer)


def group_shards(chunks: Iterable[SavedShard]) -> dict[str, list[SavedShard]]:
    """Chunks grouped by key, in first-seen order; a chunk repeated on this rank (same offsets) is kept once."""
    grouped: dict[str, list[SavedShard]] = {}
    for chunk in chunks:
        entries = grouped.setdefault(chunk.key, [])
        if any(e.offsets == chunk.offsets for e in entries):
            continue
        if entries and entries[0].global_shape != chunk.global_shape:
            raise CheckpointError(f"{chunk.key}: local pieces disagree on the full shape "
                                  f"({entries[0].global_shape} vs {chunk.global_shape})")
        entries.append(chunk)
    return grouped


class ChunkedTensor(torch.Tensor):
    """A canonical tensor as DCP sees it: global shape, and this rank's chunks with their offsets.

    Implements DCP's checkpointable-object hooks (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``), so that a rank can offer
    several uneven chunks of one tensor, which neither DTensor placements nor
    evenly split ShardedTensors express. It carries no data of its own and supports
    no tensor operations.
    """

    @staticmethod
    def __new__(cls, global_shape: Sequence[int], chunks: Sequence[tuple[tuple, torch.Tensor]]):
        first = chunks[0][1]
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=first.dtype,
                                                   device=first.device)

    def __init__(self, global_shape: Sequence[int], chunks: Sequence[tuple[tuple, torch.Tensor]]):
        self._global_shape = torch.Size(global_shape)
        self._chunks = [(torch.Size(off), data) for off, data in chunks]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} only describes checkpoint chunks; it supports no tensor "
                                  f"operations (got {func})")

    def _chunk_metadata(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=data.size()) for off, data in self._chunks]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, md.offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=md, properties=TensorProperties.create_from_tensor(data),
                                                      size=self._global_shape))
                for i, (md, (_, data)) in enumerate(zip(self._chunk_metadata(), self._chunks))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunk_metadata()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self._chunks) and self._chunks[hint][0] == index.offset:
            return self._chunks[hint][1]
        for off, data in self._chunks:
            if off == index.offset:
                return data
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset or ())}")

    def __repr__(self) -> str:  # the default repr would dispatch
        return f"ChunkedTensor(shape={tuple(self._global_shape)}, chunks={[tuple(o) for o, _ in self._chunks]})"


def to_state_dict(chunks: Iterable[SavedShard]) -> dict[str, ChunkedTensor]:
    """A flat DCP state dict {key: ChunkedTensor} of this rank's chunks."""
    return {key: ChunkedTensor(entries[0].global_shape, [(e.offsets, e.data) for e in entries])
            for key, entries in group_shards(chunks).items()}


# ---------------------------------------------------------------------------------------------
# Chunks straight from flat shards (ZeRO-3 weights, the distributed optimizer's state).
# ---------------------------------------------------------------------------------------------

def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Rectangular boxes (offsets, sizes) that cover the elements [lo, hi) of a row-major tensor of ``shape``.

    A contiguous range of a flattened tensor is at most a partial first row, whole rows and a partial
    last row (recursively in the inner dimensions): at most ``2 * ndim - 1`` boxes, in order.
    """
    shape = tuple(int(s) for s in shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    boxes: list[tuple[tuple, tuple]] = []

    def in_row(row: int, a: int, b: int) -> None:
        boxes.extend(((row,) + off, (1,) + size) for off, size in flat_boxes(shape[1:], a, b))

    if r0 == r1:
        in_row(r0, c0, c1)
        return boxes
    if c0:
        in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if c1:
        in_row(r1, 0, c1)
    return boxes


def _contiguous_strides(shape: Sequence[int]) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def flat_range_shards(spec: ShardSpec, local_shape: Sequence[int], lo: int, hi: int, flat: torch.Tensor,
                      key_of) -> list[SavedShard]:
    """The stored regions of elements [lo, hi) of a local parameter (or a state shaped like it), whose
    values are ``flat`` (1-D, ``hi - lo`` elements): views of ``flat``, each at its canonical offsets.

    This is what a rank holds of a ZeRO-3 weight or of a distributed optimizer's state: no gather, no copy.
    Each box of the range is cut by the parameter's pieces (fused tensors) and their vocabulary padding.
    """
    if flat.numel() != hi - lo:
        raise ValueError(f"{hi - lo} elements expected, got {flat.numel()}")
    local_shape = tuple(int(s) for s in local_shape)
    strides = _contiguous_strides(local_shape)
    base = flat.storage_offset()
    cat = spec.cat_dim
    out: list[SavedShard] = []
    for offsets, sizes in flat_boxes(local_shape, lo, hi):
        begin = 0  # the piece's first index along the concatenation dimension
        for piece in spec.pieces:
            extent = piece.shape[cat] if local_shape else 1
            a = max(offsets[cat], begin) if local_shape else 0
            b = min(offsets[cat] + sizes[cat], begin + extent) if local_shape else 1
            begin_piece = begin
            begin += extent
            if b <= a:
                continue
            off, size = list(offsets), list(sizes)
            if local_shape:
                off[cat], size[cat] = a, b - a
            # Clip to the rows inside the canonical tensor (vocabulary padding is not stored).
            within = [o - (begin_piece if d == cat else 0) for d, o in enumerate(off)]
            valid = piece.valid_length
            if local_shape:
                d = piece.dim
                stop = min(within[d] + size[d], valid)
                if stop <= within[d]:
                    continue
                size[d] = stop - within[d]
            elif valid <= 0:
                continue
            start = sum(o * s for o, s in zip(off, strides)) - lo
            data = flat.as_strided(tuple(size), strides, base + start)
            canonical = list(within)
            if local_shape:
                canonical[piece.dim] += piece.start
            out.append(SavedShard(key_of(piece.name), tuple(piece.full_shape), tuple(canonical), data))
    return out
