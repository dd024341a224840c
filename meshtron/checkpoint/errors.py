"""The error every checkpoint operation raises for a problem the user can act on."""

from __future__ import annotations

from typing import Iterable, Optional


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, read or matched to this run.

    ``differences`` lists one item per problem (for a mismatch at load: every field or
    tensor that differs), so that a caller can print one line per item.
    """

    def __init__(self, message: str, differences: Optional[Iterable[str]] = None):
        self.differences = list(differences or [])
        full = message
        if self.differences:
            full += ":\n" + "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(full)
        self.summary = message
