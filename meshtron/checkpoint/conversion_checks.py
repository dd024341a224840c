"""Checks shared by the conversions into and out of meshtron checkpoints (Hugging Face and Megatron-LM).

They sit below both :mod:`meshtron.checkpoint.convert` and :mod:`meshtron.checkpoint.megatron.convert`, so that
the ``meshtron convert`` dispatcher can call the Megatron conversion without the two importing each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.metadata import compare_tensors
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of


def require_empty(out: Path, flag: str = "--output") -> None:
    """Refuse an output directory that exists and is not empty (a conversion never writes over files)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{flag} {out} already exists and is not an empty directory")


def first_missing(path: Path) -> Optional[Path]:
    """The outermost of ``path`` and its parents that does not exist yet (None when ``path`` exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing = p
    return missing


def check_complete(cfg, shapes: dict[str, tuple],
                   what: str = "the Hugging Face weights do not match their config.json") -> None:
    """Every tensor the model needs is present with the configured shape (CheckpointError ``what`` otherwise)."""
    from meshtron.build import build_stage
    from meshtron.parallel.sharding import spec_buffers

    model = build_stage(cfg, ParallelContext(), cfg.model.vocab_size)  # on the meta device: no memory
    state = [p for _, p in model.named_parameters()] + [b for _, b in spec_buffers(model)]  # + expert biases
    required = {piece.name: tuple(piece.full_shape) for p in state for piece in spec_of(p).pieces}
    diffs = compare_tensors(shapes, required)
    if diffs:
        raise CheckpointError(what, diffs)
