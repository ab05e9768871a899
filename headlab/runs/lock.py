"""One run per run directory: an exclusive ``fcntl`` lock held while the run lives.

The lock is on ``RUN_DIR/.headlab.lock``, which holds the owner's pid. The kernel
drops the lock when its process ends, however it ends, so a lock file left by a killed
run is stale by construction: the next ``--resume`` takes it over. A second live run
on the same directory is refused, naming the first's pid.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from headlab.errors import RunLockedError

LOCK_NAME = ".headlab.lock"
log = logging.getLogger("headlab")


class RunLock:
    """An acquired lock on a run directory; `release` (or the process's end) frees it."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            os.close(fd)
            who = f"process {pid}" if pid else "another process"
            raise RunLockedError(
                f"run directory {directory} is in use by {who} (lock {self.path}); wait for "
                "it to end or give another --out", pid=pid) from None
        previous = _pid_in(fd)
        if previous and previous != os.getpid():
            log.info("taking over the lock of run process %d, which has ended", previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def __del__(self) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def holder(directory: str | Path) -> int | None:
    """The pid of the live run holding ``directory`` (0 if it wrote none), else None."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(fd) or 0
    finally:
        os.close(fd)
    return None


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete the temporary files and staging folders a killed run left in its
    directory (``.NAME.*.tmp``); only call it while holding the run's lock."""
    import shutil

    removed = []
    for tmp in sorted(Path(directory).rglob(".*.tmp")):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    if removed:
        log.info("removed %d temporary file(s) left by the interrupted run", len(removed))
    return removed
