"""Reading torch.distributed.checkpoint files without ever running code from them.

DCP's own ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain
``pickle.load``: a crafted file runs whatever it names. Here that file goes through
an unpickler that resolves only the classes a DCP index is made of (its metadata
dataclasses, ``torch.Size``, dtypes, the layout and memory-format lookups, a path),
and the result is checked for the shape meshtron writes: tensors only (an entry
stored as bytes would be read by DCP's planner with ``torch.load(weights_only=False)``),
data files that are plain names inside the checkpoint directory, no stream transforms.
The data files themselves are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import zlib
from pathlib import Path, PurePath
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from torch.futures import Future

from meshtron.checkpoint.checksums import ALGORITHM, crc_hex
from meshtron.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
#: (module, name) pairs a DCP index may name; dtypes (``torch.float32``...) are allowed separately.
ALLOWED_GLOBALS = frozenset({
    (_METADATA_MODULE, "Metadata"),
    (_METADATA_MODULE, "TensorStorageMetadata"),
    (_METADATA_MODULE, "TensorProperties"),
    (_METADATA_MODULE, "ChunkStorageMetadata"),
    (_METADATA_MODULE, "MetadataIndex"),
    (_METADATA_MODULE, "StorageMeta"),
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),  # an Enum: called with its integer value
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory it was written to
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
})


class RefusedContent(pickle.UnpicklingError):
    """The index names something a DCP index never holds (as opposed to being truncated or garbled)."""


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``allowed`` (default :data:`ALLOWED_GLOBALS`) and torch dtypes."""

    def __init__(self, file, allowed: frozenset = ALLOWED_GLOBALS) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedContent(f"it names {module}.{name}, which a checkpoint index never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedContent("it holds a persistent reference, which a checkpoint index never holds")


def unpickle_index(data: bytes, allowed: frozenset = ALLOWED_GLOBALS) -> Any:
    """Unpickle the bytes of a DCP ``.metadata`` file, refusing any global outside ``allowed``."""
    return _IndexUnpickler(io.BytesIO(data), allowed).load()


def _is_plain_file_name(name: Any) -> bool:
    if not isinstance(name, str) or not name or "\x00" in name:
        return False
    parts = PurePath(name).parts
    return len(parts) == 1 and parts[0] not in (".", "..") and "/" not in name and "\\" not in name


def _size_like(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(v, int) and v >= 0 for v in value)


def _check_structure(md: Any) -> Optional[str]:
    """What is wrong with an unpickled index for meshtron (None when it has the expected shape)."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not DCP Metadata"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        return "its tensor or storage tables are not mappings"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"entry {key!r} is not named by a string"
        if not isinstance(entry, TensorStorageMetadata):
            return (f"entry {key!r} is stored as {type(entry).__name__}; meshtron checkpoints hold tensors only "
                    "(non-tensor entries are unpickled by DCP without restrictions)")
        props = entry.properties
        if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
            return f"entry {key!r} has no valid tensor properties"
        if not _size_like(entry.size) or not isinstance(entry.chunks, list):
            return f"entry {key!r} has no valid shape"
        for chunk in entry.chunks:
            if (not isinstance(chunk, ChunkStorageMetadata) or not _size_like(chunk.offsets)
                    or not _size_like(chunk.sizes) or len(chunk.offsets) != len(entry.size)
                    or len(chunk.sizes) != len(entry.size)):
                return f"entry {key!r} has a malformed chunk"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return "a storage entry has a malformed index"
        path = getattr(info, "relative_path", None)
        if not _is_plain_file_name(path):
            return f"storage of {index.fqn!r} names {path!r}, not a file inside the checkpoint directory"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            return f"storage of {index.fqn!r} has an invalid byte range"
        if getattr(info, "transform_descriptors", None):
            return f"storage of {index.fqn!r} uses stream transforms {info.transform_descriptors!r}, which meshtron " \
                   "never writes"
    return None


def read_dcp_metadata(ckpt_dir: str | Path) -> Metadata:
    """The DCP index of ``ckpt_dir``, read without executing code; CheckpointError naming the file otherwise."""
    f = Path(ckpt_dir) / METADATA_FILE
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {ckpt_dir} is not a complete checkpoint") from None
    except OSError as err:
        raise CheckpointError(f"cannot read the tensor index {f}: {err.strerror or err}") from None
    try:
        md = unpickle_index(data)
    except RefusedContent as err:
        raise CheckpointError(f"{f} is not a checkpoint tensor index: {err}; refusing to load it") from None
    except Exception as err:  # truncated or garbage bytes: UnpicklingError, EOFError, ValueError, ...
        raise CheckpointError(f"{f} is not a readable checkpoint tensor index ({type(err).__name__}: "
                              f"{str(err)[:120]}); the checkpoint is damaged") from None
    problem = _check_structure(md)
    if problem is not None:
        raise CheckpointError(f"{f} is not a meshtron checkpoint tensor index: {problem}; refusing to load it")
    return md


class CorruptItem(CheckpointError):
    """Stored bytes that do not match the checksum their save recorded (found while reading them)."""


#: {(data file name, offset, length): crc32} of every stored item, from the manifest (ITEMS_KEY).
ItemChecksums = dict


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with ``read_metadata`` through :func:`read_dcp_metadata`.

    ``metadata`` (already read and checked) is returned instead of reading the file again.
    Per-rank index files (``__N.metadata``, which meshtron never writes) are refused.
    With ``checksums``, every stored item read is checked against its recorded CRC-32 from the very
    bytes the load deserialises (no separate pass over the files), and read once however many of this
    rank's regions it serves.
    """

    def __init__(self, path: str | Path, metadata: Optional[Metadata] = None,
                 checksums: Optional[ItemChecksums] = None) -> None:
        super().__init__(str(path))
        self._checked = metadata
        self._checksums = checksums
        self._files_with_items = {name for name, _, _ in checksums} if checksums else set()

    def read_data(self, plan, planner):
        if self._checksums is None:
            return super().read_data(plan, planner)
        per_file: dict[str, dict[tuple[int, int], list]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, {}).setdefault((info.offset, info.length), []).append(req)
        for name, items in per_file.items():
            path = Path(self.path) / name
            try:
                f = open(path, "rb")
            except OSError as err:
                raise CorruptItem(f"cannot read {path}: {err.strerror or err}") from None
            with f:
                for (offset, length), reqs in sorted(items.items()):
                    tensor = self._verified_item(f, path, name, offset, length, reqs[0].storage_index.fqn)
                    for req in reqs:
                        part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != part.size():
                            raise CheckpointError(f"{path}: {req.storage_index.fqn} holds a region of size "
                                                  f"{tuple(part.size())} where {tuple(target.size())} was expected")
                        target.copy_(part)
                        planner.commit_tensor(req, target)
                    del tensor
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _verified_item(self, f, path: Path, name: str, offset: int, length: int, fqn: str) -> torch.Tensor:
        expected = self._checksums.get((name, offset, length))
        if expected is None and name not in self._files_with_items:
            # A file without item checksums (an older save) was checked whole before the load began.
            f.seek(offset)
            return torch.load(io.BytesIO(f.read(length)), map_location="cpu", weights_only=True)
        if expected is None:
            raise CorruptItem(f"{path}: the bytes {offset}-{offset + length} of tensor {fqn} have no recorded "
                              "checksum (the index and the manifest disagree)")
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise CorruptItem(f"{path} ends inside tensor {fqn} ({len(data)} of {length} bytes at {offset})")
        crc = crc_hex(zlib.crc32(data))
        if crc != expected:
            raise CorruptItem(f"{path} does not match its checksum in the bytes of tensor {fqn} "
                              f"({ALGORITHM} {crc}, recorded {expected})")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: meshtron checkpoints have one index ({METADATA_FILE}), not one per "
                                  "rank")
        md = self._checked if self._checked is not None else read_dcp_metadata(self.path)
        self._checked = md
        if getattr(md, "storage_meta", None) is not None:
            md.storage_meta.load_id = self.load_id
        return md


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus its one unrestricted ``torch.load``: non-tensor entries are refused.

    A second line of defence: :func:`read_dcp_metadata` already refuses an index with such entries.
    """

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as bytes; meshtron "
                              "checkpoints hold tensors only, refusing to unpickle it")


def safe_dcp_load(state_dict: dict, ckpt_dir: str | Path, metadata: Optional[Metadata] = None,
                  process_group=None, no_dist: bool = True, checksums: Optional[ItemChecksums] = None) -> None:
    """``dcp.load`` with the restricted reader and planner (``metadata``: the index, if already read;
    ``checksums``: verify each stored item as it is read)."""
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(ckpt_dir, metadata, checksums),
             planner=TensorOnlyLoadPlanner(), process_group=process_group, no_dist=no_dist)


def corrupt_item_in(err: BaseException) -> Optional[CorruptItem]:
    """The CorruptItem behind a failed DCP load (on any rank), if that is why it failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CorruptItem):
        return err
    if isinstance(err, CheckpointException):
        for _, (exc, _) in sorted(err.failures.items()):
            found = corrupt_item_in(exc)
            if found is not None:
                return found
    cause = err.__cause__ or err.__context__
    return corrupt_item_in(cause) if cause is not None and cause is not err else None
