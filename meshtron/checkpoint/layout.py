"""Where checkpoints live on disk, and how they become visible atomically.

::

    <save_dir>/
      .meshtron_save.lock                  the running job's exclusive lock (meshtron.checkpoint.save_lock)
      latest                               the iteration of the newest complete checkpoint
      latest_checkpointed_iteration.txt    the same, under Megatron-LM's name
      iter_0000100/                        one complete checkpoint
      iter_0000200.tmp/                    a checkpoint being written (or left by a killed save)

A save writes into ``iter_N.tmp``; once every rank's files are complete and
verified, rank 0 renames it to ``iter_N`` and then replaces the pointer files
(temporary file, fsync, ``os.replace``, fsync of the directory). A process
killed at any point leaves the previous pointer, and the checkpoint it names,
intact.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from meshtron.checkpoint.errors import CheckpointError

LATEST_FILE = "latest"
MEGATRON_LATEST_FILE = "latest_checkpointed_iteration.txt"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / iteration_dir_name(iteration)


def tmp_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / (iteration_dir_name(iteration) + TMP_SUFFIX)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (renames, new files) durable. A no-op where directories cannot be opened."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (files written by code that does not sync them)."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_file_durable(path: str | os.PathLike, data: bytes) -> None:
    """Write a new file and fsync it (inside a checkpoint directory that is not visible yet)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_latest(save_dir: str | os.PathLike) -> Optional[int]:
    """The iteration the pointer names, or None when the directory holds no checkpoint yet."""
    d = Path(save_dir)
    for name in (LATEST_FILE, MEGATRON_LATEST_FILE):
        f = d / name
        if f.is_file():
            text = f.read_text(encoding="utf-8").strip()
            try:
                iteration = int(text)
            except ValueError:
                raise CheckpointError(f"{f} should hold an iteration number, not {text[:40]!r}") from None
            if iteration < 0:  # no save writes one: the marker is corrupt, not a directory name to look for
                raise CheckpointError(f"{f} holds {text[:40]!r}, which is not a valid latest-checkpoint marker "
                                      "(an iteration number of 0 or more is expected): the file is corrupt; "
                                      "write the iteration of a complete iter_N directory into it, or remove it")
            return iteration
    return None


def write_latest(save_dir: str | os.PathLike, iteration: int) -> None:
    data = f"{iteration}\n".encode()
    write_file_atomic(Path(save_dir) / LATEST_FILE, data)
    write_file_atomic(Path(save_dir) / MEGATRON_LATEST_FILE, data)


def list_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations of the complete (renamed) checkpoint directories, oldest first."""
    d = Path(save_dir)
    if not d.is_dir():
        return []
    found = []
    for entry in d.iterdir():
        m = _ITER_RE.match(entry.name)
        if m and entry.is_dir():
            found.append(int(m.group(1)))
    return sorted(found)


def prepare_tmp_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """A fresh, empty ``iter_N.tmp`` (removing what a killed save may have left there)."""
    tmp = tmp_dir(save_dir, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def old_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Where a re-save of iteration N parks the previous ``iter_N`` for the instant of the swap."""
    return Path(save_dir) / (iteration_dir_name(iteration) + OLD_SUFFIX)


def publish(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Rename ``iter_N.tmp`` to ``iter_N`` (replacing an older ``iter_N``) and move the pointer to N.

    Replacing an existing ``iter_N`` takes two renames; a process killed between them leaves
    ``iter_N.old``, which :func:`meshtron.checkpoint.load.resolve_checkpoint` falls back to.
    """
    save_dir = Path(save_dir)
    tmp, final = tmp_dir(save_dir, iteration), iteration_dir(save_dir, iteration)
    if final.exists():  # a re-save of the same iteration (after a resume): retire the old copy first
        old = old_dir(save_dir, iteration)
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(save_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(save_dir)
    write_latest(save_dir, iteration)
    return final


def apply_retention(save_dir: str | os.PathLike, keep: Optional[int], current: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (never ``current``), and stale temporaries.

    Returns the deleted iterations.
    """
    save_dir = Path(save_dir)
    for entry in save_dir.iterdir() if save_dir.is_dir() else []:
        if entry.is_dir() and entry.name.startswith("iter_") and entry.name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
            shutil.rmtree(entry, ignore_errors=True)  # left by a killed save: never complete, or superseded
    if keep is None or keep <= 0:
        return []
    iterations = list_iterations(save_dir)
    doomed = [it for it in iterations[:-keep] if it != current] if len(iterations) > keep else []
    for it in doomed:
        shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)
    return doomed
