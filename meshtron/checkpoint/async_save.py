"""Asynchronous saves: training continues while a background thread writes a CPU copy.

The foreground part copies this rank's chunks into host buffers (pinned, and
reused from one save to the next, on CUDA; a distributed optimizer's gathered
state one parameter at a time, so that device memory stays bounded); the thread then runs the whole
write-verify-publish sequence of :mod:`meshtron.checkpoint.writer`, whose
collectives use the checkpoint's own gloo group, never the training groups. At
most one save is in flight: a new save, a load and :func:`finalize_async_saves`
first wait for the previous one, and re-raise its error if it failed. The
checkpoint becomes visible (``latest``) only when the thread has published it.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.pieces import SavedShard
from meshtron.checkpoint.writer import SaveJob, write_and_publish


class AsyncCheckpointer:
    """A process's background checkpoint writer (one save in flight)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.last_timings: dict = {}

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has finished; raise CheckpointError if it failed."""
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.last_timings["waited_s"] = time.perf_counter() - start
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"the background checkpoint save failed: {type(err).__name__}: {err}") from err

    def begin_staging(self) -> None:
        """Start taking host copies (the previous save must be finished: its buffers are reused)."""
        if self.in_flight:
            raise CheckpointError("internal error: staging while a save is in flight")
        self._used: set = set()
        self._pending_cuda = False

    def stage(self, chunk: SavedShard, blocking: bool = False) -> SavedShard:
        """A host copy of ``chunk`` in a reused buffer (``blocking``: done when this returns, so that a
        temporary source may be freed)."""
        src = chunk.data
        key = (chunk.key, chunk.offsets)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.is_cuda and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        non_blocking = src.is_cuda and not blocking
        buf.copy_(src, non_blocking=non_blocking)
        self._pending_cuda = self._pending_cuda or non_blocking
        self._used.add(key)
        return SavedShard(chunk.key, chunk.global_shape, chunk.offsets, buf)

    def finish_staging(self) -> None:
        """Wait for the copies to land; drop buffers this save did not use (the layout changed)."""
        if self._pending_cuda:
            torch.cuda.current_stream().synchronize()
        for key in [k for k in self._buffers if k not in self._used]:
            del self._buffers[key]

    def submit(self, job: SaveJob) -> None:
        """Start writing ``job`` in the background (after the previous save finished)."""
        self.wait()
        self.last_timings = job.timings
        self._thread = threading.Thread(target=self._run, args=(job,), name="meshtron-checkpoint-writer",
                                        daemon=False)
        self._thread.start()

    def _run(self, job: SaveJob) -> None:
        try:
            write_and_publish(job)
        except BaseException as err:  # surfaced by the next wait()
            self._error = err


#: The process's one background writer. It lives at module level because the train
#: loop's ``finalize_async_saves()`` (called before exit) names no object to wait on.
_PROCESS_WRITER = AsyncCheckpointer()


def process_writer() -> AsyncCheckpointer:
    return _PROCESS_WRITER


def finalize_async_saves() -> None:
    """Wait for the in-flight asynchronous save of this process; raise CheckpointError if it failed."""
    _PROCESS_WRITER.wait()
