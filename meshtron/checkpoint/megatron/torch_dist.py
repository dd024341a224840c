"""Megatron-LM's ``torch_dist`` format: torch.distributed.checkpoint files written by megatron-core.

Tensors are stored whole-shape (``decoder.layers.self_attention.linear_qkv.weight`` stacked over the
layers as ``[num_layers, ...]``, or per layer as ``decoder.layers.N...`` for models whose layers differ), each
as the chunks its saving ranks held; ``ShardedObject`` entries (Transformer Engine's ``_extra_state``, the
common state) are pickled bytes. The common state (``args``, ``iteration``, ``opt_param_scheduler``, the
optimizer's parameter groups) is ``common.pt`` beside the files up to core 0.18 and the DCP entry
``common_state/shard_0_1`` from core 0.19 on (megatron-core reads ``common.pt`` first when both exist, and so
does this reader).

The index (``.metadata``) is read by the restricted unpickler of :mod:`meshtron.checkpoint.dcp_reader`
(extended with the bytes entries megatron-core writes); tensor chunks by DCP (``torch.load(weights_only=True)``);
the bytes of the common state are captured raw and read by :mod:`.unpickler`. The other bytes entries are
never read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from meshtron.checkpoint.dcp_reader import ALLOWED_GLOBALS, RefusedContent, _check_structure, unpickle_index
from meshtron.checkpoint.errors import CheckpointError, describe_dcp_failure
from meshtron.checkpoint.megatron.unpickler import load_pickled

COMMON_FILE = "common.pt"
COMMON_KEY_PREFIX = "common_state/"
#: megatron-core's index also holds bytes entries and the save plans it caches (plain DCP dataclasses and enums)
_ALLOWED = ALLOWED_GLOBALS | {("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")} | {
    ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}


def read_index(directory: Path) -> Metadata:
    """The DCP index of a Megatron ``torch_dist`` directory, read without running code."""
    f = directory / ".metadata"
    where = f"Megatron-LM checkpoint file {f}"
    try:
        md = unpickle_index(f.read_bytes(), _ALLOWED)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing: {directory} is not a complete torch_dist checkpoint") from None
    except RefusedContent as err:
        raise CheckpointError(f"{where} is not a checkpoint index: {err}; refusing to load it") from None
    except Exception as err:  # truncated or garbage bytes
        raise CheckpointError(f"{where} is truncated or damaged ({type(err).__name__}: {str(err)[:120]})") from None
    tensors_only = Metadata(
        state_dict_metadata={k: v for k, v in getattr(md, "state_dict_metadata", {}).items()
                             if not isinstance(v, BytesStorageMetadata)},
        storage_data={k: v for k, v in (getattr(md, "storage_data", None) or {}).items()})
    problem = _check_structure(md) if not isinstance(md, Metadata) else _check_structure(tensors_only)
    if problem is not None:
        raise CheckpointError(f"{where} is not a torch_dist index: {problem}; refusing to load it")
    return md


def tensor_shapes(md: Metadata) -> dict[str, tuple]:
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with the index already read (and checked) by :func:`read_index`."""

    def __init__(self, path: Path, md: Metadata):
        super().__init__(str(path))
        self._md = md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._md, "storage_meta", None) is not None:
            self._md.storage_meta.load_id = self.load_id
        return self._md


class _Planner(DefaultLoadPlanner):
    """Tensors as DCP loads them; bytes entries kept raw (never unpickled here)."""

    def __init__(self):
        super().__init__()
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def read_entries(directory: Path, md: Metadata, keys: Iterable[str], byte_keys: Iterable[str] = (),
                 dtype: Optional[torch.dtype] = None) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """({key: whole tensor} for ``keys``, {key: raw bytes} for ``byte_keys``) of a torch_dist directory."""
    from meshtron.checkpoint.writer import quiet_single_process_notice

    quiet_single_process_notice()
    state: dict[str, Any] = {}
    for key in keys:
        tmd = md.state_dict_metadata[key]
        state[key] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    for key in byte_keys:
        state[key] = io.BytesIO()
    if not state:
        return {}, {}
    planner = _Planner()
    try:
        dcp.load(state, storage_reader=_Reader(directory, md), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as err:
        lines = describe_dcp_failure(err)
        raise CheckpointError(f"reading tensors of the Megatron-LM checkpoint {directory} failed (a truncated or "
                              f"damaged __*.distcp file?): {lines[0] if lines else err}") from None
    tensors = {k: (v.to(dtype) if dtype is not None else v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, planner.raw


def read_common(directory: Path, md: Metadata) -> dict:
    """The common (non-sharded) state: ``common.pt`` (core <= 0.18) or the ``common_state`` entry (>= 0.19)."""
    f = directory / COMMON_FILE
    if f.is_file():
        common = load_pickled(f, str(f))
    else:
        keys = [k for k, v in md.state_dict_metadata.items()
                if k.startswith(COMMON_KEY_PREFIX) and isinstance(v, BytesStorageMetadata)]
        if not keys:
            raise CheckpointError(f"Megatron-LM checkpoint {directory} has neither {COMMON_FILE} nor a "
                                  f"'common_state' entry in {directory / '.metadata'}: its args and iteration are "
                                  "missing")
        _, raw = read_entries(directory, md, (), keys[:1])
        where = _data_file_of(md, keys[0])
        common = load_pickled(raw[keys[0]], f"{directory / where} (entry {keys[0]})")
        if isinstance(common, (list, tuple)) and len(common) == 1:  # a ShardedObject's value
            common = common[0]
        elif isinstance(common, dict) and set(common) == {0}:
            common = common[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"Megatron-LM checkpoint {directory}: the common state is a {type(common).__name__}, "
                              "not a mapping")
    return common


def _data_file_of(md: Metadata, key: str) -> str:
    for index, info in (md.storage_data or {}).items():
        if getattr(index, "fqn", None) == key:
            return getattr(info, "relative_path", "?")
    return "?"
