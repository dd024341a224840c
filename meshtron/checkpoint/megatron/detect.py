"""Is a directory a Megatron-LM checkpoint, and which iteration and format does it hold?

A Megatron-LM save directory holds ``latest_checkpointed_iteration.txt`` (an iteration number, or
``release``) and one directory per saved iteration, ``iter_NNNNNNN/`` (``release/``), holding either

* ``torch_dist``: ``.metadata`` and ``__R_I.distcp`` files of torch.distributed.checkpoint (with
  ``metadata.json``; the common state in ``common.pt`` up to core 0.18, inside the DCP files after), or
* the legacy format: ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank (plus
  ``distrib_optim.pt`` with the distributed optimizer).

meshtron's own checkpoints also write ``latest_checkpointed_iteration.txt``; they are told apart by
their manifest (``meshtron_checkpoint.json``), which a Megatron checkpoint never has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshtron.checkpoint.errors import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MESHTRON_MANIFEST = "meshtron_checkpoint.json"
DCP_INDEX = ".metadata"
LEGACY_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


@dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron-LM save directory."""

    directory: Path  #: the ``iter_NNNNNNN`` (or ``release``) directory
    iteration: int
    format: str  #: "torch_dist" or "legacy"

    def describe(self) -> str:
        return f"Megatron-LM checkpoint {self.directory} ({self.format}, iteration {self.iteration})"


def _format_of(d: Path) -> Optional[str]:
    if not d.is_dir() or (d / MESHTRON_MANIFEST).exists():
        return None
    if (d / DCP_INDEX).is_file() or any(d.glob("__*.distcp")):
        return "torch_dist"
    if any(RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()):
        return "legacy"
    return None


def looks_like_megatron(path: str | Path) -> bool:
    """Whether ``path`` is a Megatron-LM save directory or one of its iteration directories (cheap: names only)."""
    p = Path(path)
    if not p.is_dir() or (p / MESHTRON_MANIFEST).exists():
        return False
    if _format_of(p) is not None:
        return True
    if (p / "latest").exists():  # meshtron's own pointer: a meshtron save directory
        return False
    if (p / TRACKER_FILE).is_file():
        return True
    return any(_ITER_DIR.match(e.name) and _format_of(e) is not None for e in p.iterdir())


def _read_tracker(f: Path) -> tuple[Optional[int], bool]:
    """(iteration, release) from ``latest_checkpointed_iteration.txt``."""
    try:
        text = f.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"Megatron-LM checkpoint: cannot read {f}: {getattr(err, 'strerror', None) or err}") \
            from None
    if text == "release":
        return None, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"Megatron-LM checkpoint: {f} should hold an iteration number or 'release', not "
                              f"{text[:40]!r}") from None
    if iteration < 0:
        raise CheckpointError(f"Megatron-LM checkpoint: {f} holds {iteration}, not an iteration of 0 or more")
    return iteration, False


def find_megatron_checkpoint(path: str | Path) -> Optional[MegatronCheckpoint]:
    """The checkpoint ``path`` designates when it is a Megatron-LM save or iteration directory (None when it is
    not one); CheckpointError, naming it as a Megatron checkpoint and the file, when it is one but incomplete."""
    p = Path(path)
    if not looks_like_megatron(p):
        return None
    fmt = _format_of(p)
    if fmt is not None:  # one iteration directory
        m = _ITER_DIR.match(p.name)
        return MegatronCheckpoint(p, int(m.group(1)) if m else 0, fmt)
    tracker = p / TRACKER_FILE
    if tracker.is_file():
        iteration, release = _read_tracker(tracker)
        d = p / "release" if release else p / f"iter_{iteration:07d}"
        fmt = _format_of(d)
        if fmt is None:
            what = "missing" if not d.exists() else "neither torch_dist (.metadata) nor legacy (mp_rank_*/) files"
            raise CheckpointError(f"Megatron-LM checkpoint {p}: {tracker.name} names "
                                  f"{'release' if release else f'iteration {iteration}'}, but {d} is {what}")
        return MegatronCheckpoint(d, 0 if release else int(iteration), fmt)
    found = sorted((int(m.group(1)), e) for e in p.iterdir() if (m := _ITER_DIR.match(e.name)) and _format_of(e))
    iteration, d = found[-1]
    return MegatronCheckpoint(d, iteration, _format_of(d))
