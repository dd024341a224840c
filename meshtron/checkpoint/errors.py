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


def describe_dcp_failure(err: BaseException) -> list[str]:
    """One line per failed rank of a torch.distributed.checkpoint error (which carries every rank's exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException):
        return [f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(err.failures.items())]
    return [f"{type(err).__name__}: {err}"]
