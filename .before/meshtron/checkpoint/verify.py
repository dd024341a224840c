"""``verify_checkpoint``: refuse a checkpoint whose files differ from what its save wrote.

Every loader calls it before reading a tensor: ``meshtron train --load``, ``meshtron
generate``, ``meshtron convert --to hf``. The files are spread over the ranks (largest
first, to the least loaded), each rank hashes its share on a few threads, and the
ranks agree: a mismatch anywhere fails every rank with one line naming the file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from meshtron.checkpoint import coordination
from meshtron.checkpoint.checksums import FILES_KEY, SEAL_KEY, check_files, hashing_threads, manifest_seal_matches
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
    lead = coordination.rank() == 0
    meta = read_meta(ckpt_dir)
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
    start = time.perf_counter()
    manifest = ckpt_dir / META_FILE
    if not isinstance(files, dict) or not manifest_seal_matches(meta):
        raise CheckpointError(f"{manifest} does not match its own checksum: the manifest was changed or damaged "
                              f"after the save; {SKIP_HINT}")
    names = share_of(files, coordination.rank(), coordination.world_size())
    problems = check_files(ckpt_dir, files, names, hashing_threads())
    mine = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") if problems else None
    found = [p for p in coordination.all_gather_object(mine, group) if p is not None]
    if found:
        more = f" (and problems on {len(found) - 1} more ranks)" if len(found) > 1 else ""
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {found[0]}{more}; {SKIP_HINT}")
    return time.perf_counter() - start
