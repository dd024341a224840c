"""Which transformer layers each pipeline stage, and each virtual chunk of a stage, holds.

Layers are split over ``--pipeline-model-parallel-size`` stages, evenly unless
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
fix the first and last stage's share (the remaining layers then split evenly over
the stages in between). Megatron-LM's ``--account-for-embedding-in-pipeline-split`` /
``--account-for-loss-in-pipeline-split`` instead count the embedding / the output layer
and loss as one more layer: the slots (layers plus those) split evenly over the model
chunks, and the first / last chunk holds one layer fewer.

With ``V`` virtual stages (interleaved 1F1B, ``--virtual-pipeline-model-parallel-size``
or ``--num-layers-per-virtual-pipeline-stage``) the model is cut into ``PP x V`` model
chunks of consecutive layers, assigned round-robin like Megatron-LM: chunk ``v`` of
stage ``p`` is model chunk ``v * PP + p``. A chunk of stage ``p`` holds
``layers(p) / V`` layers. Example: 8 layers, PP=2, V=2 gives stage 0 the chunks
[0, 1] and [4, 5], stage 1 the chunks [2, 3] and [6, 7].

Megatron-LM's ``--pipeline-model-parallel-layout`` names every model chunk's contents instead, in model order and
separated by ``|``: ``E`` the embedding, ``t`` a transformer layer, ``m`` a multi-token prediction depth, ``L`` the
output layer and loss, ``(...)*n`` and ``x*n`` repeats, commas cosmetic (``"Et*3|(tt|)*2,m|L"``, as
megatron-core parses it); its number of chunks divided by the stages gives the virtual stages.

The embedding lives on chunk 0 of stage 0, the final norm, output layer and loss
on chunk V-1 of the last stage. ZBV (``--pipeline-schedule zbv``) places two chunks per stage in
a V instead: chunk 0 of stage ``p`` is model chunk ``p`` and chunk 1 is model chunk
``2 PP - 1 - p``, so stage 0 holds the first and the last layers, the embedding and the loss. Layer indices are global, so parameter names
(``layers.i``) do not depend on the layout.

Everything here takes plain integers and imports neither torch nor the configuration,
so that checking a configuration (:mod:`meshtron.validation`, which reads the flags
into these arguments) needs no model code.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from meshtron.errors import ConfigError

#: ``--pipeline-schedule`` values with W passes (weight gradients deferred from B into a WeightGradStore).
SPLIT_BACKWARD = ("zero-bubble-h1", "zbv")


def chunk_position(stages: int, stage: int, virtual: int, v_shape: bool = False) -> int:
    """The model chunk (its index in model order) that chunk ``virtual`` of pipeline stage ``stage`` holds:
    round-robin ``virtual * stages + stage`` (1F1B, interleaved), or in a V (ZBV, two chunks per stage)
    ``stage`` for chunk 0 and ``2 * stages - 1 - stage`` for chunk 1."""
    if v_shape:
        return stage if virtual == 0 else 2 * stages - 1 - stage
    return virtual * stages + stage


def loss_stage_of(schedule: Optional[str], stages: int) -> int:
    """The pipeline stage holding the final norm, output layer and loss: the last, or the first under ZBV
    (its V of chunks ends there)."""
    return 0 if schedule == "zbv" and stages > 1 else stages - 1

_FIRST = "--decoder-first-pipeline-num-layers"
_LAST = "--decoder-last-pipeline-num-layers"
_PP = "--pipeline-model-parallel-size"
_VPP = "--virtual-pipeline-model-parallel-size"
_PER_VIRTUAL = "--num-layers-per-virtual-pipeline-stage"
_EMBEDDING_SLOT = "--account-for-embedding-in-pipeline-split"
_LOSS_SLOT = "--account-for-loss-in-pipeline-split"
_LAYOUT = "--pipeline-model-parallel-layout"
#: the letters of a layout string, as megatron-core's PipelineParallelLayerLayout reads them
LAYOUT_LETTERS = {"E": "embedding", "t": "transformer layer", "m": "multi-token prediction depth",
                  "L": "output layer and loss"}


@dataclass(frozen=True)
class PipelineLayout:
    """The layers of every model chunk, indexed by model chunk ``k = virtual * stages + stage``."""

    num_layers: int
    stages: int
    virtual_stages: int
    chunk_layers: tuple[tuple[int, ...], ...]  # in model order
    v_shape: bool = False  # ZBV: chunk 0 of stage p is model chunk p, chunk 1 is model chunk 2 PP - 1 - p
    #: the model chunk of the multi-token prediction depths where it is not the last (megatron-core's "standalone"
    #: depths of a layout string; read from its checkpoints, not trained): None, with the loss
    mtp_chunk: Optional[int] = None

    def position(self, stage: int, virtual: int = 0) -> int:
        """The model chunk that chunk ``virtual`` of ``stage`` holds (its index in model order)."""
        return chunk_position(self.stages, stage, virtual, self.v_shape)

    def layers(self, stage: int, virtual: int = 0) -> list[int]:
        """Global indices of the layers held by chunk ``virtual`` of pipeline stage ``stage``."""
        return list(self.chunk_layers[self.position(stage, virtual)])

    def stage_layers(self, stage: int) -> list[list[int]]:
        """The layers of each of ``stage``'s chunks, in virtual-stage order."""
        return [self.layers(stage, v) for v in range(self.virtual_stages)]

    def has_embedding(self, stage: int, virtual: int = 0) -> bool:
        """Whether this chunk is the very first one (holds the embedding)."""
        return self.position(stage, virtual) == 0

    def has_loss(self, stage: int, virtual: int = 0) -> bool:
        """Whether this chunk is the very last one (holds the final norm, output layer and loss)."""
        return self.position(stage, virtual) == self.stages * self.virtual_stages - 1

    def has_mtp(self, stage: int, virtual: int = 0) -> bool:
        """Whether this chunk holds the multi-token prediction depths (of a model with them): the last one, or the
        layout string's chunk of its ``m``."""
        if self.mtp_chunk is None:
            return self.has_loss(stage, virtual)
        return self.position(stage, virtual) == self.mtp_chunk

    @property
    def loss_stage(self) -> int:
        """The pipeline stage with the loss: the last one, or the first in a V."""
        return loss_stage_of("zbv" if self.v_shape else None, self.stages)


def stage_layer_counts(num_layers: int, stages: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> list[int]:
    """Layers per pipeline stage: ``first``/``last`` fixed if given, the rest split evenly."""
    if stages < 1:
        raise ConfigError(f"{_PP} must be >= 1, got {stages}")
    for flag, value in ((_FIRST, first), (_LAST, last)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if stages == 1:
        if first is not None or last is not None:
            flag = _FIRST if first is not None else _LAST
            raise ConfigError(f"{flag} needs {_PP} > 1")
        return [num_layers]
    middle_stages = stages - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if first is None and last is None:
        if num_layers % stages:
            raise ConfigError(f"--num-layers ({num_layers}) must be divisible by {_PP} ({stages}), or set "
                              f"{_FIRST} / {_LAST} for an uneven split")
        return [num_layers // stages] * stages
    given = " and ".join(f"{flag} {v}" for flag, v in ((_FIRST, first), (_LAST, last)) if v is not None)
    if middle_stages == 0 and rest != 0:
        raise ConfigError(f"{given} must add up to --num-layers ({num_layers}) with {_PP} {stages}")
    if middle_stages > 0 and (rest <= 0 or rest % middle_stages):
        raise ConfigError(f"--num-layers ({num_layers}) minus {given} leaves {rest} layers for the other "
                          f"{middle_stages} of {_PP} {stages} stages: it must be a positive multiple of "
                          f"{middle_stages}")
    middle = [rest // middle_stages] * middle_stages if middle_stages else []
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def resolve_virtual_stages(num_layers: int, counts: list[int], virtual_size: Optional[int],
                           layers_per_virtual: Optional[int], uneven: bool) -> int:
    """Virtual stages per pipeline rank from either flag (they must agree when both are given)."""
    stages = len(counts)
    for flag, value in ((_VPP, virtual_size), (_PER_VIRTUAL, layers_per_virtual)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
        if value is not None and stages == 1:
            raise ConfigError(f"{flag} needs {_PP} > 1 (virtual stages interleave pipeline stages)")
    vpp = virtual_size
    if layers_per_virtual is not None:
        if uneven:
            raise ConfigError(f"{_PER_VIRTUAL} cannot be combined with {_FIRST} / {_LAST}: use {_VPP}")
        if counts[0] % layers_per_virtual:
            raise ConfigError(f"layers per pipeline stage ({counts[0]}, from --num-layers {num_layers} and {_PP} "
                              f"{stages}) must be divisible by {_PER_VIRTUAL} ({layers_per_virtual})")
        derived = counts[0] // layers_per_virtual
        if vpp is not None and vpp != derived:
            raise ConfigError(f"{_VPP} ({vpp}) contradicts {_PER_VIRTUAL} ({layers_per_virtual}), which gives "
                              f"{derived} virtual stages")
        vpp = derived
    vpp = vpp or 1
    for stage, n in enumerate(counts):
        if n % vpp:
            raise ConfigError(f"pipeline stage {stage} has {n} layers, not divisible by {vpp} virtual stages "
                              f"({_VPP} / {_PER_VIRTUAL})")
    return vpp


def partition_layers(num_layers: int, stages: int, *, first: Optional[int] = None, last: Optional[int] = None,
                     virtual_size: Optional[int] = None, layers_per_virtual: Optional[int] = None,
                     embedding_slot: bool = False, loss_slot: bool = False, v_shape: bool = False,
                     layout: Optional[str] = None, mtp_layers: int = 0,
                     standalone_mtp: bool = False) -> PipelineLayout:
    """The layout of ``num_layers`` layers over ``stages`` pipeline stages (see the module docstring).

    ``embedding_slot`` / ``loss_slot``: count the embedding / the output layer and loss as a layer.
    ``v_shape`` (``--pipeline-schedule zbv``): two chunks per stage placed in a V, each half of the stage's
    layers. ``layout``: a ``--pipeline-model-parallel-layout`` string (:func:`partition_from_layout`, which reads
    ``standalone_mtp``). Raises :class:`ConfigError` naming the flags when the split is impossible.
    """
    if num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
    if layout is not None:
        given = [f for f, on in ((_FIRST, first is not None), (_LAST, last is not None), (_PER_VIRTUAL,
                 layers_per_virtual is not None), (_EMBEDDING_SLOT, embedding_slot), (_LOSS_SLOT, loss_slot),
                 ("--pipeline-schedule zbv", v_shape)) if on]
        if given:
            raise ConfigError(f"{_LAYOUT} places every layer itself; drop {', '.join(given)}")
        return partition_from_layout(layout, num_layers, stages, virtual_size, mtp_layers, standalone_mtp)
    if v_shape:
        return _v_layout(num_layers, stages, first, last, virtual_size, layers_per_virtual, embedding_slot,
                         loss_slot)
    if embedding_slot or loss_slot:
        return _partition_with_slots(num_layers, stages, first, last, virtual_size, layers_per_virtual,
                                     embedding_slot, loss_slot)
    counts = stage_layer_counts(num_layers, stages, first, last)
    vpp = resolve_virtual_stages(num_layers, counts, virtual_size, layers_per_virtual,
                                 uneven=first is not None or last is not None)
    return _layout(num_layers, stages, vpp, [counts[k % stages] // vpp for k in range(stages * vpp)])


def parse_layout(text: str) -> list[str]:
    """The model chunks of a ``--pipeline-model-parallel-layout`` string, in model order, each as its letters
    (repeats unrolled, commas and spaces dropped): ``"Et*2|(tt|)*2,L"`` gives ``["Ett", "tt", "tt", "L"]``."""
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):  # groups first, then single letters
        flat = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), flat)
    chunks = flat.split("|")
    for i, chunk in enumerate(chunks):
        bad = sorted(set(chunk) - set(LAYOUT_LETTERS))
        if bad:
            known = ", ".join(f"{k} ({v})" for k, v in LAYOUT_LETTERS.items())
            raise ConfigError(f"{_LAYOUT} {text!r}: model chunk {i} ({chunk!r}) has {', '.join(map(repr, bad))}; "
                              f"the letters are {known}, with | between chunks and *n after a letter or (...) "
                              f"to repeat it")
    return chunks


def partition_from_layout(text: str, num_layers: int, stages: int, virtual_size: Optional[int] = None,
                          mtp_layers: int = 0, standalone_mtp: bool = False) -> PipelineLayout:
    """The layout that a ``--pipeline-model-parallel-layout`` string names (see the module docstring), checked as
    megatron-core checks it (the embedding first, the loss last, ``num_layers`` layers, the prediction depths after
    every layer, together, on the last chunk of their stage) and against what meshtron runs: the embedding on the
    first model chunk, the output layer with the prediction depths on the last. A chunk may hold no transformer
    layer (as in megatron-core: the embedding or the loss alone, or nothing, which passes its input on).

    ``standalone_mtp``: accept megatron-core's "standalone" depths on a chunk of their own before the loss's (to
    read a checkpoint saved so; :attr:`PipelineLayout.mtp_chunk`); meshtron trains them beside the loss, and
    otherwise refuses such a string with the one that does."""
    chunks = parse_layout(text)
    if stages < 1 or len(chunks) % stages:
        raise ConfigError(f"{_LAYOUT} names {len(chunks)} model chunks, not a multiple of {_PP} ({stages})")
    vpp = len(chunks) // stages
    if virtual_size is not None and virtual_size != vpp:
        raise ConfigError(f"{_LAYOUT} names {len(chunks)} model chunks, {vpp} per pipeline stage, but {_VPP} is "
                          f"{virtual_size}; drop {_VPP} (the layout gives it)")
    flat = "".join(chunks)
    where = f"{_LAYOUT} {text!r}"
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(f"{where} must name the embedding (E) and the loss (L) once each")
    if not chunks[0].startswith("E") or not chunks[-1].endswith("L"):
        raise ConfigError(f"{where} must begin with the embedding (E) in the first model chunk and end with the "
                          f"loss (L) in the last")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{where} names {flat.count('t')} transformer layers (t), but --num-layers is "
                          f"{num_layers}")
    if flat.count("m") != mtp_layers:
        raise ConfigError(f"{where} names {flat.count('m')} multi-token prediction depths (m), but "
                          f"--mtp-num-layers is {mtp_layers}")
    mtp_chunk = _mtp_chunk(text, chunks, stages, standalone_mtp) if "m" in flat else None
    sizes = [c.count("t") for c in chunks]
    return dataclasses.replace(_layout(num_layers, stages, vpp, sizes), mtp_chunk=mtp_chunk)


def _mtp_chunk(text: str, chunks: list[str], stages: int, standalone: bool) -> Optional[int]:
    """The model chunk of a layout string's prediction depths where it is not the last (None: the last), checked
    as megatron-core checks them: after every transformer layer, all in one chunk, the last chunk of its stage."""
    where = f"{_LAYOUT} {text!r}"
    flat = "".join(chunks)
    if "t" in flat[flat.index("m"):]:
        raise ConfigError(f"{where}: the multi-token prediction depths (m) come after every transformer layer (t)")
    holding = [k for k, c in enumerate(chunks) if "m" in c]
    if len(holding) > 1:
        raise ConfigError(f"{where}: the multi-token prediction depths (m) must all be in one model chunk, not in "
                          f"chunks {', '.join(map(str, holding))}")
    k = holding[0]
    if k == len(chunks) - 1:
        return None
    if k // stages != len(chunks) // stages - 1:
        raise ConfigError(f"{where}: the multi-token prediction depths (m) must be in the last model chunk of their "
                          f"pipeline stage (model chunk {k} is virtual stage {k // stages} of stage {k % stages})")
    if not standalone:
        # the same string with its m's moved before the L; spelled out chunk by chunk where that edit would not
        # parse to the intended chunks (an m inside a repeated group)
        intended = [c.replace("m", "") for c in chunks]
        intended[-1] = "m" * flat.count("m") + intended[-1]
        moved = re.sub(r"m(\*\d+)?", "", text)
        cut = moved.rindex("L")
        moved = moved[:cut] + "m" * flat.count("m") + moved[cut:]
        try:
            if parse_layout(moved) != intended:
                moved = "|".join(intended)
        except ConfigError:
            moved = "|".join(intended)
        raise ConfigError(f"{where} places the multi-token prediction depths (m) on a model chunk of their own, "
                          f"before the loss's (megatron-core's standalone depths); meshtron computes them beside "
                          f"the loss, in the last model chunk: {_LAYOUT} {moved!r} keeps every other chunk as it is "
                          f"(a Megatron-LM checkpoint saved with the first loads into it)")
    return k


def _v_layout(num_layers: int, stages: int, first: Optional[int], last: Optional[int], virtual_size: Optional[int],
              layers_per_virtual: Optional[int], embedding_slot: bool, loss_slot: bool) -> PipelineLayout:
    """ZBV's V: stage p's two chunks are model chunks p and 2 PP - 1 - p, each half of the stage's layers."""
    if stages < 2:
        raise ConfigError(f"--pipeline-schedule zbv needs {_PP} >= 2")
    if embedding_slot or loss_slot:
        raise ConfigError(f"--pipeline-schedule zbv puts the embedding and the loss on the first stage; drop "
                          f"{_EMBEDDING_SLOT} / {_LOSS_SLOT}")
    if virtual_size not in (None, 2):
        raise ConfigError(f"--pipeline-schedule zbv runs two model chunks per pipeline rank, but {_VPP} is "
                          f"{virtual_size}")
    counts = stage_layer_counts(num_layers, stages, first, last)
    vpp = resolve_virtual_stages(num_layers, counts, virtual_size or 2, layers_per_virtual,
                                 uneven=first is not None or last is not None)
    if vpp != 2:
        raise ConfigError(f"--pipeline-schedule zbv runs two model chunks per pipeline rank, but {_VPP} / "
                          f"{_PER_VIRTUAL} give {vpp}")
    sizes = [counts[p if p < stages else 2 * stages - 1 - p] // 2 for p in range(2 * stages)]
    layout = _layout(num_layers, stages, 2, sizes)
    return PipelineLayout(layout.num_layers, stages, 2, layout.chunk_layers, v_shape=True)


def _layout(num_layers: int, stages: int, vpp: int, chunk_sizes: list[int]) -> PipelineLayout:
    """Consecutive layers for the model chunks of the given sizes, in model order (v-major, then stage)."""
    chunks: list[tuple[int, ...]] = []
    start = 0
    for size in chunk_sizes:
        chunks.append(tuple(range(start, start + size)))
        start += size
    return PipelineLayout(num_layers, stages, vpp, tuple(chunks))


def _partition_with_slots(num_layers: int, stages: int, first: Optional[int], last: Optional[int],
                          virtual_size: Optional[int], layers_per_virtual: Optional[int],
                          embedding_slot: bool, loss_slot: bool) -> PipelineLayout:
    """Megatron-LM's accounting split: the embedding and/or the loss take one layer's slot."""
    flags = " and ".join(f for f, on in ((_EMBEDDING_SLOT, embedding_slot), (_LOSS_SLOT, loss_slot)) if on)
    if first is not None or last is not None:
        raise ConfigError(f"{flags} cannot be combined with {_FIRST} / {_LAST}: choose one way to split")
    if stages == 1:
        raise ConfigError(f"{flags} needs {_PP} > 1")
    slots = num_layers + embedding_slot + loss_slot
    if slots % stages:
        raise ConfigError(f"--num-layers ({num_layers}) plus the {slots - num_layers} layer slot(s) of {flags} "
                          f"= {slots} must be divisible by {_PP} ({stages})")
    vpp = resolve_virtual_stages(slots, [slots // stages] * stages, virtual_size, layers_per_virtual, uneven=False)
    sizes = [slots // (stages * vpp)] * (stages * vpp)
    sizes[0] -= embedding_slot
    sizes[-1] -= loss_slot
    # (each chunk has at least one slot, so the first and last may hold the embedding or the loss alone)
    return _layout(num_layers, stages, vpp, sizes)


def check_micro_batches(num_micro_batches: int, stages: int, virtual_stages: int) -> None:
    """The interleaved schedule runs micro-batches in groups of ``stages``: their number must be a multiple."""
    if num_micro_batches < 1:
        raise ConfigError(f"an iteration needs at least one micro-batch per data-parallel rank, got "
                          f"{num_micro_batches}")
    if virtual_stages > 1 and num_micro_batches % stages:
        raise ConfigError(
            f"the interleaved pipeline schedule ({virtual_stages} virtual stages) needs the number of micro-batches "
            f"per iteration (--global-batch-size / (--micro-batch-size x data-parallel size) = {num_micro_batches}) "
            f"to be a multiple of {_PP} ({stages}); change --global-batch-size or --micro-batch-size, or drop "
            f"{_VPP} / {_PER_VIRTUAL}")
