"""Asynchronous saves: training continues while a background thread writes a CPU copy.

The foreground part copies this rank's chunks into host buffers (pinned, and
reused from one save to the next, on CUDA; a distributed optimizer's gathered
state one parameter at a time, so that device memory stays bounded); the thread then runs the whole
write-verify-publish sequence of :mod:`meshtron.checkpoint.writer`, whose
collectives use the checkpoint's own gloo group, never the training groups. At
most one save is in flight: a new save, a load and :func:`finalize_async_saves`
first wait for the previous one, and re-raise its error if it failed. The
checkpoint becomes visible (``latest``) only when the thread has published it.

The train loop calls :func:`poll_async_saves` at every iteration boundary: it never
waits for the write, but once the thread has finished on every rank it completes the
save there, at the same iteration on all ranks: "saved ... (durable)" is reported, or
the failure is raised (CheckpointSaveError, exit 1: the same outcome as a failed
synchronous save, one iteration later, never a checkpoint lost without a word).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from meshtron.checkpoint import coordination
from meshtron.checkpoint.errors import CheckpointError, CheckpointSaveError
from meshtron.checkpoint.pieces import SavedShard
from meshtron.checkpoint.writer import SaveJob, write_and_publish


class AsyncCheckpointer:
    """A process's background checkpoint writer (one save in flight)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.last_timings: dict = {}
        self.last_description = ""  # "iteration N to DIR" of the last save submitted
        self._done_message: Optional[str] = None  # what to report once the in-flight save is durable
        self._report: Optional[Callable[[str], None]] = None
        self._running = False  # the thread has not yet run its end-of-save callbacks
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the in-flight save (if any) has finished; raise CheckpointError if it failed, else
        report it durable."""
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.last_timings["waited_s"] = time.perf_counter() - start
        report, message = self._report, self._done_message
        self._report = self._done_message = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointSaveError(f"the background checkpoint save failed: {type(err).__name__}: {err}") \
                from err
        if report is not None and message is not None:
            report(message)

    def poll(self, device: Optional[torch.device] = None) -> None:
        """Complete the in-flight save if its thread has finished on every rank (see the module's docstring);
        never waits for the write. Collective while a save is in flight: every rank submitted it at the same
        iteration, and one small all-reduce on the default group tells whether all threads are done."""
        if self._thread is None:
            return
        running = self._thread.is_alive()
        failed_here = not running and self._error is not None
        failed_anywhere = failed_here
        if coordination.is_distributed():
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
                    else torch.device("cpu")
            flags = torch.tensor([int(running), int(failed_here)], dtype=torch.int32, device=device)
            dist.all_reduce(flags)  # the main thread's own group: the writer's collectives use the checkpoint group
            running, failed_anywhere = bool(flags[0].item()), bool(flags[1].item())
        if running:
            return
        if failed_anywhere and not failed_here:  # the save's collective agreement makes this rare
            self._done_message = None
            self._error = CheckpointSaveError(f"the background checkpoint save failed on another rank "
                                              f"({self.last_description}); see that rank's error")
        self.wait()

    def after_current_save(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no save is being written: now, or in the writer thread as its save ends."""
        with self._lock:
            if self._running:
                self._callbacks.append(fn)
                return
        fn()

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

    def submit(self, job: SaveJob, report: Optional[Callable[[str], None]] = None) -> None:
        """Start writing ``job`` in the background (after the previous save finished). ``report`` receives
        "saved checkpoint at iteration N to DIR (durable)" once the save is complete (poll or wait)."""
        self.wait()
        self.last_timings = job.timings
        self.last_description = f"iteration {job.iteration} to {job.save_dir}"
        self._report = report
        self._done_message = f"saved checkpoint at iteration {job.iteration} to {job.save_dir} (durable)"
        self._thread = threading.Thread(target=self._run, args=(job,), name="meshtron-checkpoint-writer",
                                        daemon=False)
        with self._lock:
            self._running = True
        self._thread.start()

    def _run(self, job: SaveJob) -> None:
        try:
            write_and_publish(job)
        except BaseException as err:  # surfaced by the next poll() or wait()
            self._error = err
        finally:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                self._running = False
            for fn in callbacks:
                fn()


#: The process's one background writer. It lives at module level because the train
#: loop's ``finalize_async_saves()`` (called before exit) names no object to wait on.
_PROCESS_WRITER = AsyncCheckpointer()


def process_writer() -> AsyncCheckpointer:
    return _PROCESS_WRITER


def finalize_async_saves() -> None:
    """Wait for the in-flight asynchronous save of this process; raise CheckpointError if it failed."""
    _PROCESS_WRITER.wait()


def poll_async_saves(device: Optional[torch.device] = None) -> None:
    """At an iteration boundary (every rank): report the background save durable, or raise its failure
    (CheckpointSaveError), once it has finished everywhere; never waits for the write."""
    _PROCESS_WRITER.poll(device)
