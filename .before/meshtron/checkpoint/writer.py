"""Writing one checkpoint and making it visible: the sequence every rank runs (in the foreground or a thread).

1. rank 0 creates a fresh ``iter_N.tmp`` directory;
2. every rank writes its chunks through torch.distributed.checkpoint (DCP writes the
   ``.metadata`` file last, after every rank's data files are fsynced), hashing each
   data file as it is written;
3. every rank writes its RNG file and sends rank 0 the size and checksum of each file
   it wrote; rank 0 writes the config and the tokenizer, then the manifest
   (``meshtron_checkpoint.json``: progress, model, and every file's size and checksum);
4. rank 0 checks that every data file named by DCP's metadata is in the manifest and
   every listed file exists with its recorded size, and that every tensor is covered;
5. rank 0 renames ``iter_N.tmp`` to ``iter_N``, moves the ``latest`` pointer and
   prunes old checkpoints (``retain``).

After each step the ranks compare notes: if any rank failed, every rank raises the
same :class:`CheckpointSaveError`, rank 0 removes ``iter_N.tmp`` and the pointer stays
where it was. A full disk is said so, with the size the checkpoint needs.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtron.checkpoint import layout
from meshtron.checkpoint.checksums import ALGORITHM, FILES_KEY, crc32_bytes, crc32_file, entries_for_tree, file_entry
from meshtron.checkpoint.checksums import seal_manifest
from meshtron.checkpoint.coordination import all_gather_object, agree_or_raise
from meshtron.checkpoint.dcp_reader import METADATA_FILE, read_dcp_metadata
from meshtron.checkpoint.dcp_writer import ChecksummingWriter, first_os_error
from meshtron.checkpoint.errors import (
    CheckpointError, CheckpointSaveError, describe_dcp_failure, describe_exception, is_disk_full,
)
from meshtron.checkpoint.metadata import CONFIG_FILE, META_FILE, TOKENIZER_DIR, meta_json, rng_file

#: Files each rank's DCP writer spreads its chunks over (more threads, more write bandwidth).
WRITER_THREADS = 2


def quiet_single_process_notice() -> None:
    """DCP warns on every single-process save/load that it assumes one process; that is the intent here."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


@dataclass
class SaveJob:
    """Everything one rank needs to write its part of checkpoint ``iteration``."""

    save_dir: Path
    iteration: int
    rank: int
    state_dict: dict
    meta: dict
    config_text: str
    rng: Optional[bytes]
    group: Optional[dist.ProcessGroup]
    tokenizer: Any = None
    retain: Optional[int] = None
    timings: dict = field(default_factory=dict)


def _attempt(fn: Callable, *args) -> tuple[Any, Optional[str]]:
    """Run ``fn``; return (its result, None) or (None, the error as one line)."""
    try:
        return fn(*args), None
    except CheckpointError as err:
        return None, err.summary + (": " + "; ".join(err.differences) if err.differences else "")
    except Exception as err:  # reported to every rank, then raised there as CheckpointSaveError
        return None, describe_exception(err)


def _try(fn: Callable, *args) -> Optional[str]:
    """Run ``fn``; return None, or the error as one line."""
    return _attempt(fn, *args)[1]


def _agree(error: Optional[str], group, what: str) -> None:
    try:
        agree_or_raise(error, group, what)
    except CheckpointError as err:
        raise CheckpointSaveError(err.summary, err.differences) from None


def _write_rank_files(job: SaveJob, tmp: Path, storage: ChecksummingWriter) -> dict[str, dict]:
    """Write this rank's RNG file; return the manifest entries of every file this rank wrote."""
    entries = dict(storage.data_files)
    if job.rng is not None:
        f = rng_file(tmp, job.rank)
        f.parent.mkdir(parents=True, exist_ok=True)
        layout.write_file_durable(f, job.rng)
        layout.fsync_dir(f.parent)
        entries[f.relative_to(tmp).as_posix()] = file_entry(len(job.rng), crc32_bytes(job.rng))
    return entries


def _write_lead_files(job: SaveJob, tmp: Path, rank_entries: dict[str, dict]) -> None:
    """Rank 0: the config, the tokenizer, then the manifest with every file's checksum (last: marks the save done)."""
    files = dict(rank_entries)
    config = job.config_text.encode()
    layout.write_file_durable(tmp / CONFIG_FILE, config)
    files[CONFIG_FILE] = file_entry(len(config), crc32_bytes(config))
    if job.tokenizer is not None:
        job.tokenizer.save(tmp / TOKENIZER_DIR)
        layout.fsync_tree(tmp / TOKENIZER_DIR)
        files.update(entries_for_tree(tmp / TOKENIZER_DIR, tmp))
    files[METADATA_FILE] = file_entry(*crc32_file(tmp / METADATA_FILE))
    meta = {**job.meta, "checksum_algorithm": ALGORITHM, FILES_KEY: dict(sorted(files.items()))}
    layout.write_file_durable(tmp / META_FILE, meta_json(seal_manifest(meta)))
    layout.fsync_dir(tmp)


def verify_tensor_files(ckpt_dir: Path) -> list[str]:
    """Problems with the DCP files of ``ckpt_dir``: missing or short data files, tensors not fully covered."""
    problems = []
    md = read_dcp_metadata(ckpt_dir)
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        f = ckpt_dir / rel
        if not f.is_file():
            problems.append(f"data file {f} is missing")
        elif f.stat().st_size < size:
            problems.append(f"data file {f} has {f.stat().st_size} bytes, expected at least {size}")
    for key, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, TensorStorageMetadata) and len(tmd.size) > 0:
            covered = sum(math.prod(c.sizes) for c in tmd.chunks)
            if covered != math.prod(tmd.size):
                problems.append(f"tensor {key} {tuple(tmd.size)}: chunks cover {covered} of "
                                f"{math.prod(tmd.size)} elements")
    return problems


def verify_manifest_files(ckpt_dir: Path, files: dict[str, dict]) -> list[str]:
    """Problems between the manifest's file list and the directory: unlisted data files, missing or resized files."""
    problems = []
    md = read_dcp_metadata(ckpt_dir)
    for rel in sorted({info.relative_path for info in md.storage_data.values()} - set(files)):
        problems.append(f"data file {ckpt_dir / rel} has no checksum in the manifest")
    for rel, entry in files.items():
        f = ckpt_dir / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, {entry['bytes']} were written")
    return problems


def _verify(job: SaveJob, tmp: Path, files: Optional[dict[str, dict]]) -> None:
    problems = []
    f = rng_file(tmp, job.rank)
    if job.rng is not None and (not f.is_file() or f.stat().st_size != len(job.rng)):
        problems.append(f"RNG file {f} is missing or incomplete")
    if job.rank == 0:
        problems += verify_tensor_files(tmp)
        for name in (META_FILE, CONFIG_FILE):
            if not (tmp / name).is_file():
                problems.append(f"{tmp / name} is missing")
        if not problems and files is not None:
            problems += verify_manifest_files(tmp, files)
    if problems:
        raise CheckpointError("verification failed", problems)


def _write_tensors(job: SaveJob, storage: ChecksummingWriter, what: str) -> None:
    try:
        dcp.save(job.state_dict, storage_writer=storage, process_group=job.group, no_dist=job.group is None)
    except (Exception, CheckpointException) as err:  # DCP reports every rank's failure on every rank
        raise CheckpointSaveError(f"{what} while writing the tensors", describe_dcp_failure(err)) from None


def write_and_publish(job: SaveJob) -> Path:
    """Run the whole save sequence for this rank (collective over ``job.group``); returns the final directory."""
    group, lead = job.group, job.rank == 0
    tmp = layout.tmp_dir(job.save_dir, job.iteration)
    what = f"saving checkpoint iteration {job.iteration} to {job.save_dir} failed"
    start = time.perf_counter()

    def prepare() -> None:
        job.save_dir.mkdir(parents=True, exist_ok=True)
        layout.prepare_tmp_dir(job.save_dir, job.iteration)

    storage = ChecksummingWriter(tmp, thread_count=WRITER_THREADS)
    try:
        _agree(_try(prepare) if lead else None, group, what)
        _write_tensors(job, storage, what)
        job.timings["tensors_s"] = time.perf_counter() - start
        job.timings["checksum_s"] = storage.hash_s
        entries, error = _attempt(_write_rank_files, job, tmp, storage)
        gathered = all_gather_object((entries, error), group)
        _agree(next((f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e is not None), None)
               if lead else None, group, what)
        files = {name: entry for part, _ in gathered for name, entry in (part or {}).items()}
        _agree(_try(_write_lead_files, job, tmp, files) if lead else None, group, what)
        _agree(_try(_verify, job, tmp, files), group, what)

        def commit() -> None:
            layout.publish(job.save_dir, job.iteration)
            layout.apply_retention(job.save_dir, job.retain, job.iteration)

        _agree(_try(commit) if lead else None, group, what)
    except CheckpointSaveError as err:
        raise _after_failure(job, err, storage, tmp, what) from None
    job.timings["total_s"] = time.perf_counter() - start
    return layout.iteration_dir(job.save_dir, job.iteration)


def _human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _after_failure(job: SaveJob, err: CheckpointSaveError, storage: ChecksummingWriter, tmp: Path,
                   what: str) -> CheckpointSaveError:
    """Remove the partial directory (rank 0, once every rank stopped writing) and say what happened.

    Every rank gets here together: each failure is agreed on collectively first. A full disk
    becomes one line with the size the checkpoint needs and the space left.
    """
    if job.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        previous = layout.read_latest(job.save_dir)
    except CheckpointError:
        previous = None
    kept = f"the latest checkpoint is still iteration {previous}" if previous is not None else \
        "no earlier checkpoint exists"
    if not is_disk_full(err):  # decided from the agreed message: every rank takes the same branch
        return CheckpointSaveError(f"{err.summary} (removed {tmp.name}; {kept})", err.differences)
    mine = storage.planned_bytes + len(job.rng or b"") + len(job.config_text)
    needed = sum(all_gather_object(mine, job.group))
    try:
        free = f", {_human_bytes(shutil.disk_usage(job.save_dir).free)} free there"
    except OSError:
        free = ""
    os_err = first_os_error(err, storage)
    where = f" ({os_err.filename})" if os_err is not None and getattr(os_err, "filename", None) else ""
    return CheckpointSaveError(f"{what}: no space left on device{where}: the checkpoint needs about "
                               f"{_human_bytes(needed)} in {job.save_dir}{free}; removed the partial {tmp.name}, "
                               f"{kept}")
