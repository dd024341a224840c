"""Writing a Megatron-LM ``torch_dist`` save directory, as megatron-core 0.19 lays it out.

``SAVE_DIR/iter_NNNNNNN/`` holds torch.distributed.checkpoint files (``.metadata``, ``__0_0.distcp``) with

* every tensor whole, under megatron-core's key (``decoder.layers.X`` stacked over the layers);
* the ``ShardedObject`` entries megatron-core writes as bytes: each one ``torch.save([value])`` under
  ``KEY/shard_OFFSETS_SHAPE`` (Transformer Engine's ``_extra_state``, empty here, and the common state
  ``common_state/shard_0_1``: ``args``, ``iteration``, ``opt_param_scheduler``...);

and ``metadata.json`` (the backend megatron-core checks before reading). ``SAVE_DIR/latest_checkpointed_iteration.txt``
is written last, once the iteration directory is complete: a failed write never leaves a checkpoint marked as the
latest.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from meshtron.checkpoint.errors import CheckpointError, CheckpointSaveError, describe_os_error
from meshtron.checkpoint.megatron.detect import TRACKER_FILE

CONFIG_FILE = "metadata.json"
#: What megatron-core's ``metadata.json`` says of a torch_dist checkpoint.
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_KEY = "common_state/shard_0_1"


def object_key(key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """megatron-core's storage key of a ShardedObject (``key/shard_<offsets>_<shape>``, dot-joined)."""
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _as_bytes(value: Any) -> io.BytesIO:
    """A ShardedObject's bytes as megatron-core stores them: the list of this rank's values, torch.save'd."""
    buf = io.BytesIO()
    torch.save([value], buf)
    buf.seek(0)
    return buf


class _BytesPlanner(DefaultSavePlanner):
    """DCP's planner, except that BytesIO values are written as they are (DCP would pickle the BytesIO)."""

    def transform_object(self, write_item, obj):
        return obj if isinstance(obj, io.BytesIO) else super().transform_object(write_item, obj)


def write_iteration(directory: Path, tensors: dict[str, torch.Tensor], objects: dict[str, Any],
                    common: dict) -> None:
    """The files of one iteration directory (which must exist, empty): ``tensors`` by key, ``objects``
    (storage key -> value) and the ``common`` state as bytes entries, then ``metadata.json``."""
    from meshtron.checkpoint.writer import quiet_single_process_notice

    quiet_single_process_notice()
    state: dict[str, Any] = {k: v.contiguous() for k, v in tensors.items()}
    state.update({k: _as_bytes(v) for k, v in objects.items()})
    state[COMMON_KEY] = _as_bytes(common)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True),
             planner=_BytesPlanner(), no_dist=True)
    (directory / CONFIG_FILE).write_text(json.dumps(BACKEND), encoding="utf-8")


def check_destination(save_dir: Path, iteration: int, add_to_existing: bool, flag: str = "--output") -> None:
    """CheckpointError when ``save_dir`` holds files and ``add_to_existing`` is off, or already holds
    ``iter_NNNNNNN`` of ``iteration``."""
    if save_dir.exists() and not save_dir.is_dir():
        raise CheckpointError(f"{flag} {save_dir} is a file, not a directory")
    if save_dir.is_dir() and any(save_dir.iterdir()):
        if not add_to_existing:
            raise CheckpointError(f"{flag} {save_dir} is not empty (give --add-to-existing to add an iteration to a "
                                  "Megatron-LM save directory)")
        if (save_dir / iteration_dir_name(iteration)).exists():
            raise CheckpointError(f"{flag} {save_dir} already holds {iteration_dir_name(iteration)}: refusing to "
                                  "overwrite it")


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def publish(save_dir: Path, iteration: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any],
            common: dict) -> Path:
    """Write ``iter_NNNNNNN`` under ``save_dir`` (in a hidden directory renamed when complete), then the
    tracker file; returns the iteration directory. On failure nothing is left that was not there before."""
    from meshtron.checkpoint.conversion_checks import first_missing

    created = first_missing(save_dir)
    final = save_dir / iteration_dir_name(iteration)
    tmp = save_dir / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    moved = False
    try:
        tmp.mkdir(parents=True)
        write_iteration(tmp, tensors, objects, common)
        os.replace(tmp, final)
        moved = True
        tracker_tmp = save_dir / f".{TRACKER_FILE}.tmp-{os.getpid()}"
        tracker_tmp.write_text(str(iteration), encoding="utf-8")
        os.replace(tracker_tmp, save_dir / TRACKER_FILE)  # last: the checkpoint is complete
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif moved:  # complete, but the tracker could not name it: not left behind half-published
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointSaveError(f"writing the Megatron-LM checkpoint {final} failed: {describe_os_error(err)}; "
                                      "nothing was left there") from None
        raise
    return final
