"""The errors every checkpoint operation raises for a problem the user can act on."""

from __future__ import annotations

import errno
from typing import Iterable, Optional


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, read or matched to this run.

    ``differences`` lists one item per problem (for a mismatch at load: every field or
    tensor that differs), so that a caller can print one line per item. ``exit_code``
    is the process exit status the command line gives it: 2, bad input (a checkpoint
    that is missing, corrupt or does not match the run).
    """

    exit_code = 2

    def __init__(self, message: str, differences: Optional[Iterable[str]] = None):
        self.differences = list(differences or [])
        full = message
        if self.differences:
            full += ":\n" + "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(full)
        self.summary = message


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed while the run was going (full disk, permissions, a failed rank):
    a failure while running, exit status 1. The previous checkpoint stays the latest."""

    exit_code = 1


#: errno values that mean the file system has no room left for the checkpoint.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def describe_os_error(err: OSError) -> str:
    """One line for an operating-system error: the file, then what happened."""
    where = getattr(err, "filename", None)
    text = err.strerror or str(err)
    return f"{where}: {text}" if where else text


def describe_exception(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        return describe_os_error(err)
    if isinstance(err, CheckpointError):
        return err.summary
    return f"{type(err).__name__}: {err}"


def describe_dcp_failure(err: BaseException) -> list[str]:
    """One line per failed rank of a torch.distributed.checkpoint error (which carries every rank's exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException):
        return [f"rank {rank}: {describe_exception(exc)}" for rank, (exc, _) in sorted(err.failures.items())]
    return [describe_exception(err)]


def is_disk_full(err: BaseException) -> bool:
    """Whether an error (an OSError, a DCP failure of several ranks, or a CheckpointError's lines) is a full disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, OSError):
        return err.errno in DISK_FULL_ERRNOS
    if isinstance(err, CheckpointException):
        return any(is_disk_full(exc) for exc, _ in err.failures.values())
    text = " ".join([getattr(err, "summary", str(err))] + list(getattr(err, "differences", []))).lower()
    return any(os_text.lower() in text for os_text in _disk_full_texts())


def _disk_full_texts() -> list[str]:
    import os

    return [os.strerror(code) for code in sorted(DISK_FULL_ERRNOS)]
