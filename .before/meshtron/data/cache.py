"""Where derived data lives, and how several processes build it once.

Two mechanisms keep concurrent builders safe:

* files and directories are written under a temporary name and renamed into place, so a reader
  either sees a complete result or nothing;
* under ``torch.distributed``, :func:`build_once` lets global rank 0 build while the others wait
  on a barrier, then every rank reads (a rank that cannot see rank 0's files, e.g. on a node
  without a shared file system, builds its own copy, which is identical because builds are
  deterministic).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np


def user_cache_dir() -> Path:
    """meshtron's cache root: ``$MESHTRON_CACHE``, else ``$XDG_CACHE_HOME/meshtron``, else ``~/.cache/meshtron``."""
    if os.environ.get("MESHTRON_CACHE"):
        return Path(os.environ["MESHTRON_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "meshtron"
    return Path.home() / ".cache" / "meshtron"


def stable_hash(obj: Any, length: int = 16) -> str:
    """A short hex digest of a JSON-serialisable description (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]


def is_writable_dir(path: Path) -> bool:
    """Whether ``path`` exists or can be created, and files can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` (.npy) through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``final``; on success rename it to ``final``.

    If another process created ``final`` first, its copy is kept and ours is discarded (both are
    built deterministically from the same inputs, so they are interchangeable).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def dist_state() -> tuple[bool, int]:
    """(initialised, global rank) of torch.distributed, without requiring it to be initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, 0
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


def barrier() -> None:
    """A barrier over all ranks when torch.distributed is initialised; nothing otherwise."""
    initialised, _ = dist_state()
    if initialised:
        import torch.distributed as dist

        dist.barrier()


def build_once(is_built: Callable[[], bool], build: Callable[[], None]) -> bool:
    """Make sure a deterministic on-disk artifact exists, building it on global rank 0 only.

    Every rank must call this (it contains a barrier when torch.distributed is initialised).
    Returns True if this process built the artifact.
    """
    initialised, rank = dist_state()
    built_here = False
    failure: Optional[BaseException] = None
    if rank == 0 and not is_built():
        try:
            build()
            built_here = True
        except BaseException as exc:  # still reach the barrier so that the others do not hang
            if not initialised:
                raise
            failure = exc
    if initialised:
        barrier()
        if failure is not None:
            raise failure
        if rank != 0 and not is_built():
            # Not visible here (no shared file system between nodes): build a local copy.
            build()
            built_here = True
    return built_here


def file_fingerprint(path: Path) -> dict:
    """What identifies an input file cheaply: resolved path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
