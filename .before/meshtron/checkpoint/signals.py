"""``--exit-signal-handler``: note SIGTERM (e.g. SLURM preemption) so the train loop can save and exit cleanly."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Iterable, Optional


class SignalHandler:
    """Records that one of ``signals`` arrived instead of dying; the train loop polls :attr:`triggered`.

    The loop then agrees with the other ranks (a reduction of the flag), saves a checkpoint
    and exits. :meth:`restore` puts the previous handlers back.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self.received: Optional[int] = None

    @property
    def triggered(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame) -> None:
        if not self._event.is_set():
            self.received = signum
            name = signal.Signals(signum).name
            print(f"meshtron: received {name}: saving a checkpoint and exiting after this iteration",
                  file=sys.stderr, flush=True)
        self._event.set()

    def install(self) -> "SignalHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("--exit-signal-handler: signal handlers can only be installed from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "SignalHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def install_signal_handler(signals: Iterable[int] = (signal.SIGTERM,)) -> SignalHandler:
    """Install and return a :class:`SignalHandler` for ``signals`` (default SIGTERM)."""
    return SignalHandler(signals).install()
