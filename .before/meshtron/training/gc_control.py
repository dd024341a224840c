"""``--manual-gc``: Python garbage collection at fixed iterations instead of whenever it triggers.

Python's cyclic garbage collector runs when allocation counters cross a threshold, at a different
moment on every rank. A collection pauses its rank for up to hundreds of milliseconds with large
heaps, and every collective waits for the slowest rank, so at scale each rank's pauses add up for
all. With ``--manual-gc`` automatic collection is off during training and every rank collects at the
same iterations (``--manual-gc-interval``), around evaluations (``--manual-gc-eval``) and at the end.
"""

from __future__ import annotations

import gc


class ManualGC:
    """Context manager for the training loop; does nothing unless ``enabled``."""

    def __init__(self, enabled: bool, interval: int = 0, around_eval: bool = True):
        self.enabled, self.interval, self.around_eval = enabled, interval, around_eval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()  # start from a clean heap, so the first interval has as little to do as any
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.collect()
            if self._was_enabled:
                gc.enable()

    def after_step(self, iteration: int) -> None:
        """Collect when ``iteration`` is a multiple of the interval."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        """Collect before and after an evaluation (and before a checkpoint save)."""
        if self.enabled and self.around_eval:
            gc.collect()
