"""How a ``meshtron train`` process ends: one owner for every exit path and its exit code.

Exit codes (DESIGN.md section 11): 0 done (also after ``--exit-signal-handler`` saved a checkpoint
and stopped), 1 failure while running, 2 bad input (also when it is found after the process groups
exist, on some ranks only), 128+n on signal n (130 for Ctrl-C).

Why the teardown order matters: a gloo worker thread that drops the tensors of the last collective
after the interpreter has begun to finalise must take the GIL to release them; Python then ends
that thread (``pthread_exit``) inside a C++ destructor, which aborts the process ("terminate called
without an active exception", SIGABRT) after training has finished. So every path, the normal end,
an error, bad input, Ctrl-C and the signal handler's save-and-exit alike, runs
:func:`shutdown_distributed` while the interpreter is whole:

1. background threads: the train loop closes its data iterators (whose prefetch threads are joined)
   as it leaves; an asynchronous checkpoint save still in flight is waited for, bounded;
2. process groups: subgroups first, the default group last, bounded (a dead peer cannot hang the
   exit); then the last references go and each group's destructor joins its worker threads;
3. stdout and stderr are flushed.

If a bounded step did not finish, the process leaves through ``os._exit`` with its exit code, since
a normal interpreter exit would wait for (or abort on) the threads still running.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import threading
import traceback
from typing import Callable, Optional

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def signal_exit_code(signum: int) -> int:
    """The exit code of a process ended by signal ``signum``: 128 + n, as a shell reports it."""
    return 128 + int(signum)


def wait_for_async_saves(timeout_s: float) -> tuple[bool, Optional[BaseException]]:
    """Wait up to ``timeout_s`` for this process's background checkpoint save; (finished, its error)."""
    try:
        from meshtron.checkpoint import finalize_async_saves
    except ImportError:
        return True, None
    error: list[BaseException] = []

    def wait() -> None:
        try:
            finalize_async_saves()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            error.append(err)

    waiter = threading.Thread(target=wait, name="meshtron-wait-async-save", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    return not waiter.is_alive(), (error[0] if error else None)


def shutdown_distributed(timeout_s: float) -> bool:
    """Wait for an async checkpoint save, destroy every process group, collect their objects, flush.

    Each step is bounded by ``timeout_s``. Returns True when everything finished in time. Used by
    ``meshtron train`` and by the test harness alike, so that both end the same way.
    """
    from meshtron.parallel.context import destroy_process_groups

    saved, save_error = wait_for_async_saves(timeout_s)
    if save_error is not None:
        print(f"meshtron: error: {save_error}", file=sys.stderr)
    destroyed = destroy_process_groups(timeout_s)
    gc.collect()  # the group objects' destructors join their worker threads, while the interpreter is whole
    _flush_stdio()
    return saved and destroyed


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass


#: How gloo's transport words a peer that went away (it raises a plain RuntimeError, not a DistError).
_PEER_LOST_PHRASES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _is_peer_lost(err: BaseException) -> bool:
    """True for a collective that failed because another rank left or died (its own output says why)."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if isinstance(dist_error, type) and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(phrase in str(err) for phrase in _PEER_LOST_PHRASES)


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, without a leading ``[source.cc:123]`` location."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", line)


class RunLifecycle:
    """Runs the body of a training process and ends it: one message, ordered teardown, the exit code.

    ``bad_input`` and ``failures`` are the exception classes reported as one line with exit code 2
    and 1; any other exception is a bug and keeps its traceback (exit 1). Ctrl-C (SIGINT) gives
    130; a second Ctrl-C during the teardown is recorded, not raised, so that the teardown finishes.
    ``quiet_interrupt`` leaves the "interrupted" line to the launcher, which prints one for all ranks.
    ``on_exit_code`` is called with the exit code as soon as it is known, before the teardown.
    """

    def __init__(self, prog: str, rank: int, world_size: int, timeout_s: float,
                 bad_input: tuple[type[BaseException], ...] = (), failures: tuple[type[BaseException], ...] = (),
                 quiet_interrupt: bool = False, on_exit_code: Optional[Callable[[int], None]] = None) -> None:
        self.prog = prog
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.bad_input = bad_input
        self.failures = failures
        self.quiet_interrupt = quiet_interrupt
        self.on_exit_code = on_exit_code
        self.signal_received: Optional[int] = None
        self.exit_code: Optional[int] = None
        self._interrupt_raises = False  # True while the body runs: a Ctrl-C then stops it

    def run(self, body: Callable[[], Optional[int]]) -> int:
        """``body()`` (an int result is its exit code), then the teardown; returns the exit code."""
        previous = self._install_interrupt_handler()
        try:
            try:
                self._interrupt_raises = True
                result = body()
                self._interrupt_raises = False
                code = result if isinstance(result, int) else EXIT_OK
            except BaseException as err:  # noqa: BLE001 - every exit path ends here, in order
                self._interrupt_raises = False  # from here a Ctrl-C is noted, the teardown goes on
                code = self._report(err)
            # The exception, its traceback and the frames holding the run's objects are gone here, so
            # that the collection in shutdown_distributed() can free the process groups.
            if self.on_exit_code is not None:  # before the teardown: peers see this rank leave during it
                self.on_exit_code(code)
            if not shutdown_distributed(self.timeout_s):
                print(f"{self.prog}: warning: {self._where()}the teardown did not finish within "
                      f"{self.timeout_s:g}s (--distributed-timeout-minutes); exiting now", file=sys.stderr)
                _flush_stdio()
                os._exit(code)
            self.exit_code = code
            return code
        finally:
            self._restore_interrupt_handler(previous)

    # ------------------------------------------------------------------------------- messages
    def _where(self) -> str:
        return f"[rank {self.rank}] " if self.world_size > 1 else ""

    def _report(self, err: BaseException) -> int:
        """Print what the user must know about ``err`` (one line where it is not a bug); its exit code."""
        if isinstance(err, SystemExit):
            return err.code if isinstance(err.code, int) else (EXIT_OK if err.code is None else EXIT_FAILURE)
        if isinstance(err, KeyboardInterrupt) or self.signal_received is not None:
            # An error raised while Ctrl-C stops the ranks (a peer left a collective) is its consequence.
            self.signal_received = self.signal_received or signal.SIGINT
            if not self.quiet_interrupt and self.rank == 0:
                print(f"{self.prog}: interrupted", file=sys.stderr)
            return signal_exit_code(self.signal_received)
        if isinstance(err, self.bad_input + self.failures):
            print(f"{self.prog}: error: {self._where()}{err}", file=sys.stderr)
            # An error class may say its own code (a checkpoint that failed to save is a failure, exit 1,
            # although checkpoint errors are bad input by default).
            default = EXIT_BAD_INPUT if isinstance(err, self.bad_input) else EXIT_FAILURE
            code = getattr(err, "exit_code", default)
            return code if isinstance(code, int) else default
        if _is_peer_lost(err):
            print(f"{self.prog}: error: {self._where()}lost contact with another rank: {_first_line(err)}",
                  file=sys.stderr)
            return EXIT_FAILURE
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        print(f"{self.prog}: error: {self._where()}unexpected {type(err).__name__} (traceback above)",
              file=sys.stderr)
        return EXIT_FAILURE

    # ------------------------------------------------------------------------------- Ctrl-C
    def _on_interrupt(self, signum: int, frame) -> None:
        first = self.signal_received is None
        self.signal_received = signum
        if first and self._interrupt_raises:
            raise KeyboardInterrupt

    def _install_interrupt_handler(self):
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, self._on_interrupt)

    def _restore_interrupt_handler(self, previous) -> None:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
