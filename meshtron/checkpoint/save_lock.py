"""One job per ``--save`` directory: an exclusive lock that the job holds for its whole life.

Two jobs saving into the same directory would overwrite each other's ``iter_N`` directories and move
``latest`` back and forth, both exiting 0. So the saving process of a job (global rank 0: the one that
publishes checkpoints) takes an ``fcntl.flock`` lock on ``<save>/.meshtron_save.lock`` before training
starts, and keeps it until the job ends. The lock file's JSON body names the holder (host, pid, start
time), so that a second job is refused with one line saying who has the directory.

Staleness is the kernel's business: a flock lock belongs to the open file and disappears when the
holding process ends in any way (exception, SIGKILL, OOM kill, a lost node's NFS lease). A lock file
whose lock nobody holds is therefore free; if its body still names a holder, that job ended without
releasing it (a crash) and the new job says it took the directory over. A clean release empties the
body. The lock file is never deleted: deleting it would let two jobs lock two different files of the
same name.

One exception: processes the holder forked (data-loader workers) share its open file, so a holder
killed outright leaves its lock held until they notice and exit, a few seconds later. A job that finds
the lock held by a holder on this host whose process is gone (an automatic restart, typically) waits
for them, up to :data:`LEFTOVER_WAIT_S` seconds, before refusing.

Where the file system refuses flock (ENOLCK, EOPNOTSUPP: some network file systems), the body alone
decides: a holder on this host whose process is alive, or one on another host (which cannot be
checked), refuses the job with the path of the lock file to remove; a dead holder on this host is taken
over.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshtron.checkpoint import coordination
from meshtron.checkpoint.async_save import process_writer
from meshtron.checkpoint.errors import CheckpointError
from meshtron.parallel.context import ParallelContext

logger = logging.getLogger(__name__)

LOCK_FILE = ".meshtron_save.lock"
#: How long a job waits for the leftover children of a dead holder to let the lock go.
LEFTOVER_WAIT_S = 30.0
#: Seconds between two attempts while waiting.
RETRY_S = 0.25
#: flock errors that mean "this file system does not do flock", not "someone holds it".
_NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class SaveDirLockedError(CheckpointError):
    """Another live job holds the ``--save`` directory. Exit status 2 (bad input, as every refusal before
    training): the command names a directory this job may not use; rerunning it unchanged while the other
    job lives gives the same answer, and nothing was trained or written."""

    exit_code = 2


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a save directory, from the lock file's body."""

    host: str
    pid: int
    started: str  # ISO 8601, local time with offset

    @classmethod
    def me(cls) -> "Holder":
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), now)

    @classmethod
    def parse(cls, text: str) -> Optional["Holder"]:
        """The holder a lock file's body names; None for an empty body (released) or one being written."""
        try:
            body = json.loads(text)
            return cls(str(body["host"]), int(body["pid"]), str(body["started"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "pid": self.pid, "started": self.started}) + "\n"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    def alive_here(self) -> Optional[bool]:
        """Whether this holder's process runs: True/False on this host, None on another (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive
            return True
        return True


class SaveDirLock:
    """The exclusive lock of one save directory, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, save_dir: str | os.PathLike) -> None:
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / LOCK_FILE
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Optional[Holder]:
        """Take the lock, or raise SaveDirLockedError naming the holder. Returns the holder of a lock this
        call took over (a job that ended without releasing it), else None."""
        if self._fd is not None:
            return None
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise CheckpointError(f"--save {self.save_dir}: cannot create its lock file {self.path} "
                                  f"({err.strerror or err})") from None
        try:
            previous = self._lock(fd)
            body = Holder.me().to_json().encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, body, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # closing drops a lock taken here
            raise
        self._fd = fd
        return previous

    def _lock(self, fd: int) -> Optional[Holder]:
        """flock ``fd`` (or judge the body where flock is not supported); returns a stale holder taken over."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            if holder is None or holder.alive_here() is not False:
                raise self._refusal(holder) from None
            if not self._wait_for_leftovers(fd):  # the holder is gone; what it forked still holds the lock
                raise self._refusal(holder, leftovers=True) from None
            return holder
        except OSError as err:
            if err.errno not in _NO_FLOCK_ERRNOS:
                raise CheckpointError(f"--save {self.save_dir}: cannot lock {self.path} "
                                      f"({err.strerror or err})") from None
            holder = self._read(fd)
            if holder is not None and holder.alive_here() is not False and holder.pid != os.getpid():
                raise self._refusal(holder, no_flock=True) from None
            return holder  # a dead holder on this host (the caller says it took over), or none
        return self._read(fd)  # a body left behind: its job ended without releasing the lock

    def _wait_for_leftovers(self, fd: int) -> bool:
        """Retry the lock for up to LEFTOVER_WAIT_S seconds; whether it was taken."""
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while time.monotonic() < deadline:
            _pause(RETRY_S)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                continue
        return False

    def _read(self, fd: int) -> Optional[Holder]:
        try:
            return Holder.parse(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
        except OSError:
            return None

    def _refusal(self, holder: Optional[Holder], no_flock: bool = False,
                 leftovers: bool = False) -> SaveDirLockedError:
        who = holder.describe() if holder is not None else "a job whose details are not written yet"
        if leftovers:
            return SaveDirLockedError(
                f"--save {self.save_dir} is still locked, {LEFTOVER_WAIT_S:g} s after its job ({who}) exited, by "
                f"processes that job started (`fuser -v {self.path}` lists them): stop them, or give this job "
                "another --save directory")
        hint = (f"; if that job is gone, remove {self.path} (this file system does not support file locks)"
                if no_flock else "")
        return SaveDirLockedError(
            f"--save {self.save_dir} is in use by another job ({who}): two jobs saving into one directory "
            f"would overwrite each other's checkpoints; give this job another --save directory, or stop that "
            f"job first{hint}")

    def release(self) -> None:
        """Empty the holder record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a clean end: the next job finds no holder to report as crashed
            # Unlock explicitly: a child forked meanwhile (a data worker) shares this open file, and closing
            # our descriptor alone would leave the lock held while it lives.
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)


def _pause(seconds: float) -> None:
    time.sleep(seconds)  # a bounded retry of the lock, not a synchronisation


class JobSaveLock:
    """A job's hold on its ``--save`` directory: the lock on the saving rank, nothing elsewhere."""

    def __init__(self, lock: Optional[SaveDirLock]) -> None:
        self.lock = lock

    def release(self) -> None:
        """Let the directory go, once the background checkpoint writer (if any) has finished with it:
        released now when it is idle, else by the writer as its save ends."""
        if self.lock is not None and self.lock.held:
            process_writer().after_current_save(self.lock.release)


def lock_save_dir(save_dir: Optional[str], ctx: Optional[ParallelContext]) -> JobSaveLock:
    """Take the job's exclusive lock on ``save_dir`` (collective when ``save_dir`` is set: every rank calls it).

    Global rank 0, which publishes checkpoints, takes the lock; every rank learns its outcome, so that a
    refused job stops on all ranks with the same SaveDirLockedError (exit 2). A lock left by a job that
    ended without releasing it is taken over with a warning naming that job.
    """
    if not save_dir:
        return JobSaveLock(None)
    lock = SaveDirLock(save_dir) if coordination.rank() == 0 else None
    error: Optional[str] = None
    refused = False
    if lock is not None:
        try:
            stale = lock.acquire()
        except CheckpointError as err:
            error, refused = str(err), isinstance(err, SaveDirLockedError)
        else:
            if stale is not None and (stale.host, stale.pid) != (socket.gethostname(), os.getpid()):
                logger.warning("--save %s: took over the lock of a job that ended without releasing it (%s)",
                               save_dir, stale.describe())
    group = coordination.checkpoint_group(ctx) if coordination.is_distributed() else None
    error, refused = coordination.broadcast_object((error, refused), group)
    if error is not None:  # every rank stops with rank 0's words
        raise SaveDirLockedError(error) if refused else CheckpointError(error)
    return JobSaveLock(lock)
