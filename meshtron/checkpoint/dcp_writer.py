"""DCP's file-system writer, plus what a checkpoint save needs to know about its own writes.

:class:`ChecksummingWriter` is ``dcp.FileSystemWriter`` with three additions:

* every data file is CRC-32'd as its bytes go out (no second read), for the manifest;
* its writer threads report their failures: DCP's own threads die with a traceback on
  stderr and leave a file out of the index, while here the first failure fails the save;
* it remembers the operating-system errors its files met (a full disk surfaces from
  ``torch.save`` as ``unexpected pos ...``: the ``OSError`` beneath is what the user needs
  to hear) and how many bytes this rank planned to write (the size of a checkpoint that
  did not fit).
"""

from __future__ import annotations

import io
import math
import os
import queue
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from meshtron.checkpoint.checksums import ITEMS_KEY, crc_hex, file_entry

DATA_SUFFIX = ".distcp"
#: Bytes torch.save adds around each stored tensor (zip headers, the pickled tensor description), measured.
ITEM_OVERHEAD_BYTES = 1500


class HashingStream:
    """A write-only file wrapper that keeps the CRC-32 and byte count of everything written through it."""

    def __init__(self, raw: Any, on_error) -> None:
        self._raw = raw
        self._on_error = on_error
        self.crc = 0
        self.size = 0
        self.hash_s = 0.0
        self.items: list = []  # [offset, length, crc32] of each item, when the writer marks them

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._raw.write(view)
        except OSError as err:
            self._on_error(err)
            raise
        written = len(view) if written is None else written
        start = time.perf_counter()
        part = view[:written]
        self.crc = zlib.crc32(part, self.crc)
        if self._item_start is not None:
            self._item_crc = zlib.crc32(part, self._item_crc)
        self.hash_s += time.perf_counter() - start
        self.size += written
        return written

    _item_start: Optional[int] = None
    _item_crc = 0

    def begin_item(self) -> None:
        """Start the checksum of one stored item (the bytes written until :meth:`end_item`)."""
        self._item_start, self._item_crc = self.size, 0

    def end_item(self) -> list:
        """[offset, length, CRC-32] of the item written since :meth:`begin_item`."""
        start, self._item_start = self._item_start, None
        return [start, self.size - start, crc_hex(self._item_crc)]

    def _call(self, name: str, *args):
        try:
            return getattr(self._raw, name)(*args)
        except OSError as err:
            self._on_error(err)
            raise

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._raw.closed


class _RecordingFileSystem(dcp_fs.FileSystem):
    """DCP's local file system whose written streams are hashed and whose OS errors are kept."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.files: dict[str, dict] = {}
        self.items: dict[str, list] = {}  # file name -> [[offset, length, crc32], ...] of its stored items
        self.os_errors: list[OSError] = []
        self.hash_s = 0.0  # seconds spent hashing, summed over the writer threads

    def record_error(self, err: OSError) -> None:
        with self._lock:
            self.os_errors.append(err)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                stream = HashingStream(raw, self.record_error)
                yield stream
        except OSError as err:
            self.record_error(err)
            raise
        name = Path(path).name
        if name.endswith(DATA_SUFFIX):
            with self._lock:
                self.files[name] = file_entry(stream.size, crc_hex(stream.crc))
                if stream.items:
                    self.files[name][ITEMS_KEY] = stream.items
                self.hash_s += stream.hash_s


class ChecksummingWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` recording each data file's checksum, its threads' failures and its OS errors."""

    def __init__(self, path: str | Path, thread_count: int = 1) -> None:
        super().__init__(str(path), thread_count=thread_count)
        self.fs = _RecordingFileSystem()
        self.planned_bytes = 0

    @property
    def data_files(self) -> dict[str, dict]:
        """{file name: manifest entry} of the data files this rank wrote."""
        return dict(self.fs.files)

    @property
    def os_errors(self) -> list[OSError]:
        return list(self.fs.os_errors)

    @property
    def hash_s(self) -> float:
        """Seconds this rank's writer threads spent computing checksums (summed over threads)."""
        return self.fs.hash_s

    def write_data(self, plan, planner) -> Future:
        self.planned_bytes = sum(_item_bytes(item) + ITEM_OVERHEAD_BYTES for item in plan.items)
        future = super().write_data(plan, planner)
        written = len(future.value())
        if written != len(plan.items):  # a lost writer thread: never publish an index with holes
            raise RuntimeError(f"only {written} of {len(plan.items)} checkpoint items were written")
        return future

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        """Write the queued files on ``thread_count`` threads; raise the first thread's failure."""
        results: queue.Queue = queue.Queue()
        failures: list[BaseException] = []

        def work() -> None:
            try:
                write_files_one_chunk_at_a_time(self.fs.create_stream, file_queue, results, planner,
                                                self.transforms, self.sync_files, self.serialization_format)
            except BaseException as err:  # re-raised below, in the caller's thread
                failures.append(err)

        threads = [threading.Thread(target=work, name=f"meshtron-dcp-writer-{i}", daemon=True)
                   for i in range(1, self.thread_count)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        if failures:
            os_errors = self.os_errors
            raise os_errors[0] if os_errors else failures[0]
        written = []
        while not results.empty():
            written += results.get_nowait()
        future: Future = Future()
        future.set_result(written)
        return future


def write_files_one_chunk_at_a_time(create_stream, file_queue: queue.Queue, result_queue: queue.Queue, planner,
                                    transforms, use_fsync: bool, serialization_format) -> None:
    """DCP's per-file write loop (``filesystem._write_files_from_queue``), holding one chunk at a time.

    DCP's loop keeps every host copy of a file's tensors until the file is closed (for its safetensors
    format), so a rank's extra memory during a synchronous save grew with its whole share of the
    checkpoint. Here each chunk is copied to the host (or out of a larger buffer: a view would make
    ``torch.save`` write the whole storage), written and released before the next: the extra memory is
    the largest chunk. Each item's bytes are also checksummed on their own (``begin_item``/``end_item``
    of :class:`HashingStream`), so that a load can verify exactly the items it reads.
    """
    if serialization_format != dcp_fs.SerializationFormat.TORCH_SAVE:
        raise ValueError(f"meshtron writes checkpoints with torch.save, not {serialization_format}")
    try:
        while True:
            file_name, storage_key, write_items = file_queue.get_nowait()
            write_results = []
            with create_stream(file_name, "wb") as stream:
                marks = hasattr(stream, "begin_item")
                for write_item in sorted(write_items, key=lambda w: w.type != WriteItemType.BYTE_IO):
                    if write_item.type == WriteItemType.BYTE_IO:
                        data = planner.resolve_data(write_item)
                    else:
                        data = planner.resolve_data(write_item).detach().cpu()
                        if data.untyped_storage().nbytes() != data.nbytes:
                            data = data.clone()  # only the chunk's bytes, not its buffer's
                    if marks:
                        stream.begin_item()
                    write_results.append(dcp_fs._write_item(transforms, stream, data, write_item, storage_key,
                                                            serialization_format))
                    if marks:
                        stream.items.append(stream.end_item())
                    del data
                if use_fsync:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, io.UnsupportedOperation):
                        os.sync()
            result_queue.put(write_results)
    except queue.Empty:
        pass


def _item_bytes(item) -> int:
    data = getattr(item, "tensor_data", None)
    if data is not None:
        return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    nbytes = getattr(getattr(item, "bytes_io_data", None), "nbytes", 0)
    return int(nbytes or 0)


def first_os_error(err: BaseException, writer: Optional[ChecksummingWriter] = None) -> Optional[OSError]:
    """The operating-system error behind a failed write: in the exception's chain or met by ``writer``."""
    seen = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    errors = writer.os_errors if writer is not None else []
    return errors[0] if errors else None
