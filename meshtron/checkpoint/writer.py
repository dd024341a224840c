"""Writing one checkpoint and making it visible: the sequence every rank runs (in the foreground or a thread).

1. rank 0 creates a fresh ``iter_N.tmp`` directory;
2. every rank writes its chunks through torch.distributed.checkpoint (DCP writes the
   ``.metadata`` file last, after every rank's data files are fsynced);
3. every rank writes its RNG file; rank 0 writes the JSON metadata, the config and the tokenizer;
4. rank 0 checks that every data file named by DCP's metadata exists with its full
   size and that every tensor is covered; every rank checks its RNG file;
5. rank 0 renames ``iter_N.tmp`` to ``iter_N``, moves the ``latest`` pointer and
   prunes old checkpoints (``retain``).

After each step the ranks compare notes: if any rank failed, every rank raises the
same :class:`CheckpointError` and the pointer stays where it was.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtron.checkpoint import layout
from meshtron.checkpoint.coordination import agree_or_raise
from meshtron.checkpoint.errors import CheckpointError, describe_dcp_failure
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


def _try(fn, *args) -> Optional[str]:
    """Run ``fn``; return None, or the error as one line."""
    try:
        fn(*args)
    except CheckpointError as err:
        return err.summary + (": " + "; ".join(err.differences) if err.differences else "")
    except OSError as err:
        return f"{getattr(err, 'filename', '') or ''}: {err.strerror or err}".lstrip(": ")
    except Exception as err:  # reported to every rank, then raised there as CheckpointError
        return f"{type(err).__name__}: {err}"
    return None


def _write_extras(job: SaveJob, tmp: Path) -> None:
    if job.rng is not None:
        f = rng_file(tmp, job.rank)
        f.parent.mkdir(parents=True, exist_ok=True)
        layout.write_file_durable(f, job.rng)
        layout.fsync_dir(f.parent)
    if job.rank == 0:
        layout.write_file_durable(tmp / CONFIG_FILE, job.config_text.encode())
        if job.tokenizer is not None:
            job.tokenizer.save(tmp / TOKENIZER_DIR)
            layout.fsync_tree(tmp / TOKENIZER_DIR)
        layout.write_file_durable(tmp / META_FILE, meta_json(job.meta))  # written last: marks the extras done
        layout.fsync_dir(tmp)


def verify_tensor_files(ckpt_dir: Path) -> list[str]:
    """Problems with the DCP files of ``ckpt_dir``: missing or short data files, tensors not fully covered."""
    problems = []
    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
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


def _verify(job: SaveJob, tmp: Path) -> None:
    problems = []
    f = rng_file(tmp, job.rank)
    if job.rng is not None and (not f.is_file() or f.stat().st_size != len(job.rng)):
        problems.append(f"RNG file {f} is missing or incomplete")
    if job.rank == 0:
        problems += verify_tensor_files(tmp)
        for name in (META_FILE, CONFIG_FILE):
            if not (tmp / name).is_file():
                problems.append(f"{tmp / name} is missing")
    if problems:
        raise CheckpointError("verification failed", problems)


def write_and_publish(job: SaveJob) -> Path:
    """Run the whole save sequence for this rank (collective over ``job.group``); returns the final directory."""
    group, lead = job.group, job.rank == 0
    tmp = layout.tmp_dir(job.save_dir, job.iteration)
    what = f"saving checkpoint iteration {job.iteration} to {job.save_dir} failed"
    start = time.perf_counter()

    def prepare() -> None:
        job.save_dir.mkdir(parents=True, exist_ok=True)
        layout.prepare_tmp_dir(job.save_dir, job.iteration)

    agree_or_raise(_try(prepare) if lead else None, group, what)
    try:
        dcp.save(job.state_dict, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=WRITER_THREADS),
                 process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as err:  # DCP reports every rank's failure on every rank
        raise CheckpointError(f"{what} while writing the tensors", describe_dcp_failure(err)) from None
    job.timings["tensors_s"] = time.perf_counter() - start
    agree_or_raise(_try(_write_extras, job, tmp), group, what)
    agree_or_raise(_try(_verify, job, tmp), group, what)

    def commit() -> None:
        layout.publish(job.save_dir, job.iteration)
        layout.apply_retention(job.save_dir, job.retain, job.iteration)

    agree_or_raise(_try(commit) if lead else None, group, what)
    job.timings["total_s"] = time.perf_counter() - start
    return layout.iteration_dir(job.save_dir, job.iteration)
