"""``verify_checkpoint``: refuse a checkpoint whose files differ from what its save wrote.

:func:`verify_checkpoint` checks every byte of every file (``meshtron convert --to hf`` and anyone who
wants a whole checkpoint checked): the files are spread over the ranks (largest first, to the least
loaded), each rank hashes its share on a few threads, and the ranks agree: a mismatch anywhere fails
every rank with one line naming the file.

A load (``meshtron train --load``, ``meshtron generate``) does not read the checkpoint twice:
:func:`verify_for_load` checks the manifest's own checksum, every file's presence and size, and hashes
only the small files (index, config, RNG states, tokenizer) and data files written before per-item
checksums; it returns the CRC-32 of every stored tensor chunk, which the reader checks from the very
bytes it deserialises (:class:`meshtron.checkpoint.dcp_reader.SafeFileSystemReader`). A chunk that no
rank reads (say, optimizer state under ``--no-load-optim``) is then not checked: nothing of it is used.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from meshtron.checkpoint import coordination
from meshtron.checkpoint.checksums import FILES_KEY, ITEMS_KEY, SEAL_KEY, check_files, hashing_threads, size_problem
from meshtron.checkpoint.checksums import manifest_seal_matches, safe_relative_name
from meshtron.checkpoint.checksums import share_of
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.metadata import META_FILE, read_meta

logger = logging.getLogger(__name__)

SKIP_HINT = "--no-verify-checkpoint loads it anyway"


def verify_checkpoint(ckpt_dir: str | Path, group=None, enabled: bool = True) -> Optional[float]:
    """Check every file of ``ckpt_dir`` against the manifest (collective over ``group``).

    Returns the seconds it took, or None when nothing was checked: ``enabled`` False
    (``--no-verify-checkpoint``) or a checkpoint from before checksums were recorded
    (both with a one-line warning). Raises CheckpointError naming the first file that
    is missing, resized or does not match its checksum, or an edited manifest.
    """
    ckpt_dir = Path(ckpt_dir)
    start = time.perf_counter()
    files = _listed_files(ckpt_dir, read_meta(ckpt_dir), coordination.rank() == 0, enabled)
    if files is None:
        return None
    names = share_of(files, coordination.rank(), coordination.world_size())
    _raise_first_problem(ckpt_dir, check_files(ckpt_dir, files, names, hashing_threads()), group)
    return time.perf_counter() - start


def _listed_files(ckpt_dir: Path, meta: dict, lead: bool, enabled: bool) -> Optional[dict]:
    """The manifest's file table, or None when nothing is to be checked (with the one-line warning)."""
    if not enabled:
        if lead:
            logger.warning("checkpoint %s: --no-verify-checkpoint: its files are not checked against their "
                           "checksums", ckpt_dir)
        return None
    files = meta.get(FILES_KEY)
    if files is None and SEAL_KEY not in meta and int(meta.get("version", 1)) < 2:
        if lead:
            logger.warning("checkpoint %s records no checksums (written by an older meshtron): its files are not "
                           "verified", ckpt_dir)
        return None
    if not isinstance(files, dict) or not manifest_seal_matches(meta):
        raise CheckpointError(f"{ckpt_dir / META_FILE} does not match its own checksum: the manifest was changed or "
                              f"damaged after the save; {SKIP_HINT}")
    return files


def _raise_first_problem(ckpt_dir: Path, problems: list, group) -> None:
    """Share every rank's problems (collective over ``group``) and raise one line naming the first."""
    mine = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") if problems else None
    found = [p for p in coordination.all_gather_object(mine, group) if p is not None]
    if found:
        more = f" (and problems on {len(found) - 1} more ranks)" if len(found) > 1 else ""
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {found[0]}{more}; {SKIP_HINT}")


def _item_table(name: str, entry) -> Optional[list]:
    items = entry.get(ITEMS_KEY) if isinstance(entry, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 3 for i in items):
        return None
    return items


def _size_problem(ckpt_dir: Path, name: str, entry) -> Optional[str]:
    if not safe_relative_name(name):
        return f"the manifest names {name!r}, which is not a file inside the checkpoint"
    return size_problem(ckpt_dir, name, entry)


def verify_for_load(ckpt_dir: str | Path, group=None, enabled: bool = True) -> Optional[dict]:
    """What a load checks before reading (collective over ``group``); returns the item checksums.

    The manifest's seal, every listed file's presence and size, and the full CRC-32 of every file
    without per-item checksums. Returns {(data file, offset, length): crc32} for the reader to check
    as it reads, or None when nothing is checked (``enabled`` False, or a checkpoint from before
    checksums, both with a one-line warning). Raises CheckpointError naming the first bad file.
    """
    ckpt_dir = Path(ckpt_dir)
    lead = coordination.rank() == 0
    files = _listed_files(ckpt_dir, read_meta(ckpt_dir), lead, enabled)
    if files is None:
        return None
    checksums: dict = {}
    whole: dict = {}
    problems = []
    for name, entry in files.items():
        items = _item_table(name, entry)
        if items is None:
            whole[name] = entry
            continue
        problem = _size_problem(ckpt_dir, name, entry) if lead else None
        if problem is not None:
            problems.append(problem)
        for offset, length, crc in items:
            checksums[(name, int(offset), int(length))] = crc
    names = share_of(whole, coordination.rank(), coordination.world_size())
    _raise_first_problem(ckpt_dir, problems + check_files(ckpt_dir, whole, names, hashing_threads()), group)
    return checksums
