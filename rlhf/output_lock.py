"""One writer per output folder: an exclusive flock on <output>/.lock, held for the run.

    lock = lock_output(folder)     # UserError naming the holder's pid and host if another run has it
    ...                            # everything the run writes
    release_output(folder)         # also at exit; the kernel drops the flock of a killed process

The lock is taken by one process per run (rank 0 of a multi-process job) before anything is
written, without waiting: a second run on the folder, or a `--resume` of it while it still
runs, stops at once. The file records the holder's pid and host for that message; a file left
by a killed holder is taken over with a line (the flock died with its process, so a recorded pid
on another host never blocks a run). Releasing unlinks the file, and a taker checks that the
file it locked is still the one at the path, so an unlink racing a new taker never lets two runs
hold the folder.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

LOCK_NAME = ".lock"


@dataclass
class OutputLock:
    path: Path
    fd: int


_held: dict[str, OutputLock] = {}  # realpath of the folder -> its lock, for this process


def _holder(fd: int) -> dict[str, object]:
    """What the lock file records (pid, host, since); {} when empty or unreadable."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, object]) -> str:
    if not holder.get("pid"):
        return "a process that has not recorded its pid yet"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{since}"


def lock_output(folder: Path, what: str = "--output") -> OutputLock:
    """Take `folder`'s lock for this process (again: the lock it already holds). UserError, one
    line, when another process holds it, or when the lock file cannot be a plain file there."""
    key = os.path.realpath(folder)
    if key in _held:
        return _held[key]
    path = folder / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:  # a read-only folder, a full disk: the CLI's one line for that error
            if exc.errno != errno.ELOOP:
                raise
            raise UserError(f"{what} {folder}: its lock file {LOCK_NAME} is a symbolic link (to {os.readlink(path)}); "
                            "remove the link") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(f"{what} {folder}: in use by another run ({_describe(holder)}); wait for it to end "
                            f"or stop it, or choose another {what}") from None
        try:  # the holder we waited on may have unlinked it: lock the file that is at the path
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _holder(fd)
    if previous:
        log.warning("%s: taking over the lock of %s, which no longer runs", path, _describe(previous))
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[key] = lock = OutputLock(path, fd)
    return lock


def release_output(folder: Path) -> None:
    """Give `folder`'s lock back (no-op when this process does not hold it): unlinked, then closed."""
    lock = _held.pop(os.path.realpath(folder), None)
    if lock is None:
        return
    try:
        lock.path.unlink(missing_ok=True)
    except OSError:
        pass  # the file stays; the next taker sees its holder gone and takes it over
    os.close(lock.fd)


@atexit.register
def release_all() -> None:
    """Every lock this process holds (at exit, and when a CLI command ends in-process)."""
    for key in list(_held):
        release_output(Path(key))
