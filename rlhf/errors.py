"""User-facing errors: one clear line naming the file/field and the fix, exit code 2.

`UserError` is what the project raises itself. `as_user_error` turns the errors a user causes
outside its checks (a full disk, a read-only folder, a corrupt weights file, memory that cannot be
allocated, a rank of the job that stopped) into the same one line, for the CLI's top-level
handler; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType


class UserError(Exception):
    """An error the user caused (bad file, flag, config or data row).

    The CLI prints `error: <message>` on one line and exits with code 2, never a traceback.
    The message should name the file and/or field and say what to do.
    """

    exit_code = 2


class JobStalled(UserError):
    """A collective failed because another rank stopped (timed out) or exited (connection closed)."""


def import_dependency(module: str, needed_for: str, instead: str = "") -> ModuleType:
    """`module`, or one UserError line naming what needs it and how to get it (a broken or minimal
    environment otherwise ends in a ModuleNotFoundError traceback mid-run)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        alternative = f", or {instead}" if instead else ""
        raise UserError(f"{needed_for} needs the Python package {package!r} ({exc}): pip install {package}"
                        f"{alternative}") from None


def debug_enabled() -> bool:
    """RLHF_DEBUG=1 (any value but empty or 0): code that turns a user's own exception (a reward
    function that raised) into a one-line UserError re-raises the original instead, traceback and all,
    and the CLI lets every error through with its traceback instead of printing its one line."""
    return os.environ.get("RLHF_DEBUG", "") not in ("", "0")


_WRITE_FAILED = re.compile(r"file write failed|No space left|StorageFull|Disk quota", re.IGNORECASE)
_OOM = re.compile(r"out of memory|can't allocate memory|Cannot allocate memory|CUDA error: out of memory", re.IGNORECASE)
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|timed out after|Watchdog caught collective operation timeout",
                                 re.IGNORECASE)
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused",
                        re.IGNORECASE)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp|c):\d+\]\s*")
MEMORY_HINT = ("lower --micro-batch-size (PPO: --generation-batch-size, --max-new-tokens), or use "
               "--gradient-checkpointing / --offload / --zero-stage 3")


def first_line(exc: BaseException) -> str:
    """The exception's message on one line (nested tracebacks that some wrappers embed dropped)."""
    text = str(exc).strip()
    for line in text.splitlines():
        line = _SOURCE_PREFIX.sub("", line.strip())  # "[.../gloo/.../pair.cc:534] " says nothing to a user
        if line and not line.startswith(("Traceback", "File ", "[rank")):
            return line
    return type(exc).__name__


TEXT_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".csv", ".txt", ".jinja", ".py")


def path_in_traceback(exc: BaseException, suffixes: tuple[str, ...]) -> str | None:
    """The file an exception was raised about when it does not say: the innermost frame's local
    variable holding an existing path with one of `suffixes` (a decoder or a safetensors reader
    reports bytes and offsets, never the file name)."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (str, os.PathLike)) and str(value).lower().endswith(suffixes):
                if len(str(value)) < 4096 and os.path.isfile(value):
                    return str(value)
    return None


def _no_space_on(path: str | None) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) is full."""
    if not path:
        return False
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < (1 << 20)
    except OSError:
        return False


def _os_error(exc: OSError, where: str | None) -> UserError | None:
    """One line for a file-system error a user can fix: a full disk, a read-only or forbidden path."""
    path = exc.filename if exc.filename is not None else where
    shown = str(path) if path is not None else "the output folder"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return UserError(f"{reason} on {shown}; free some space there or choose another --output")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
        target = Path(str(path)) if path is not None else None
        if target is not None and not target.exists() and target.parent.is_dir():  # creating a file in a folder
            return UserError(f"{target.parent}: {reason} (cannot create {target.name} in it); make the folder "
                             "writable for this user or choose another --output")
        return UserError(f"{shown}: {reason}; make it writable (or readable) for this user, or choose another path")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP) and exc.filename is not None:
        return UserError(f"{shown}: {exc.strerror}; check the path")
    return None


def _torch_error(exc: BaseException, where: str | None) -> UserError | None:
    """Out of memory at allocation, a write that failed on a full disk, a stalled or vanished rank."""
    torch = sys.modules.get("torch")
    message = first_line(exc)
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or (
            isinstance(exc, RuntimeError) and _OOM.search(message)):
        message = message[message.find("can't allocate"):] if "can't allocate" in message else message
        return UserError(f"out of memory: {message}; {MEMORY_HINT}")
    if _WRITE_FAILED.search(str(exc)) and ("No space left" in str(exc) or _no_space_on(where)):
        return UserError(f"no space left on {where or 'the output folder'} ({message}); free some space there or "
                         "choose another --output")
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    distributed = isinstance(exc, RuntimeError) and (
        isinstance(exc, dist_error) or "gloo" in str(exc) or "NCCL" in str(exc))
    if distributed and _COLLECTIVE_TIMEOUT.search(str(exc)):
        return JobStalled(f"a collective operation timed out ({message}): a rank it waited for made no progress for "
                          "--dist-timeout seconds (stopped, hung or gone); raise --dist-timeout if it was only slow")
    if distributed and _PEER_GONE.search(str(exc)):
        return JobStalled(f"another rank of the job exited ({message}); its own error is above")
    return None


def as_user_error(exc: BaseException, where: str | None = None) -> UserError | None:
    """`exc` as the one-line UserError a user can act on, or None when it is a bug (which keeps its
    traceback). `where` is the path to name when the exception carries none (the --output folder)."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, UnicodeDecodeError):
        path = path_in_traceback(exc, TEXT_SUFFIXES) or "a file"
        return UserError(f"{path}: not UTF-8 text ({exc.reason}: byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start}); save it as UTF-8")
    if isinstance(exc, OSError) and exc.errno is not None:
        return _os_error(exc, where)
    if type(exc).__name__ == "SafetensorError":
        path = path_in_traceback(exc, (".safetensors",)) or "a .safetensors weights file"
        return UserError(f"{path}: truncated or corrupt ({first_line(exc)}); copy or export that model folder again")
    return _torch_error(exc, where)
