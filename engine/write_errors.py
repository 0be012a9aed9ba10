"""A write that fails during a collective save (a checkpoint, a model export): one line, no partial
folder left, every rank stopped alike.

Checkpoints and exports fill a `<name>.tmp` folder and rename it into place only when it is
complete, so a failed write (a full disk, a quota, a read-only folder) never touches the previous
checkpoint or model. `agreed_write` wraps each part of such a save that ranks write on their own:
instead of the barrier that followed it, the ranks agree on whether any of them failed (one
all_reduce), and if one did, rank 0 removes the partial folder and every rank raises the same
`WriteFailed` line (the first failing rank's), so no rank is left waiting for one that gave up.

A write error is an OSError with an errno (also inside DCP's CheckpointException, which collects
every rank's failures), or torch's own writer failing on a full disk: it reports no errno
("unexpected pos 704 vs 598", "file write failed"), so the file system's free space names it.
Any other failure is a bug and keeps its traceback on its rank.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError

FULL_BELOW_BYTES = 1 << 20
"""A file system with less free space than this is full (torch's writer reports no errno)."""
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
FIXES = {errno.ENOSPC: "free some space there", errno.EDQUOT: "free some of your quota there",
         errno.EROFS: "make it writable", errno.EACCES: "make it writable for this user",
         errno.EPERM: "make it writable for this user"}
"""What to do about a write error, by errno (otherwise: check that file system)."""


class WriteFailed(UserError):
    """A checkpoint or export could not be written; its partial folder is removed (exit code 2)."""


def _causes(exc: BaseException) -> Iterator[tuple[BaseException, int | None]]:
    """`exc` and what it wraps (causes, contexts, DCP's per-rank failures), with the rank each
    came from when known."""
    seen: set[int] = set()
    todo: list[tuple[BaseException, int | None]] = [(exc, None)]
    while todo:
        current, rank = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current, rank
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint's CheckpointException
            todo += [(pair[0], r) for r, pair in sorted(failures.items())
                     if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException)]
        todo += [(nested, rank) for nested in (current.__cause__, current.__context__) if nested is not None]


def _is_full(folder: Path) -> bool:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < FULL_BELOW_BYTES
    except OSError:
        return False


def write_error(exc: BaseException, folder: Path, rank: int) -> tuple[int, str] | None:
    """(errno, what failed on one line: 'ENOSPC (No space left on device) on rank 1 writing FILE')
    when `exc` is a write error (see the module docstring); None when it is not."""
    for cause, cause_rank in _causes(exc):
        if isinstance(cause, OSError) and cause.errno is not None:
            code, reason = errno.errorcode.get(cause.errno, str(cause.errno)), cause.strerror or str(cause)
            where = f" writing {cause.filename}" if cause.filename is not None else ""
            return cause.errno, f"{code} ({reason}) on rank {rank if cause_rank is None else cause_rank}{where}"
    text = " ".join(str(cause) for cause, _ in _causes(exc))
    if any(marker in text for marker in _TORCH_WRITE_FAILED) and _is_full(folder):
        return errno.ENOSPC, f"ENOSPC ({os.strerror(errno.ENOSPC)}) on rank {rank}"
    return None


@contextmanager
def agreed_write(ctx: DistributedContext, folder: Path, what: str, then: str = "") -> Iterator[None]:
    """This rank's part of filling `folder` (a `*.tmp` folder), then the agreement that replaces the
    barrier after it (collective). On a write error on any rank: rank 0 removes `folder`, and
    every rank raises WriteFailed('<what> not written: ENOSPC (...) on rank 1 writing FILE; the
    partial <folder> is removed; free some space there'). `what` names the save ('checkpoint
    step_00000004', 'the model export to runs/sft/model'); `then`, what to do after the fix."""
    error: tuple[int, str] | None = None
    try:
        yield
    except BaseException as exc:  # CheckpointException is a BaseException
        error = write_error(exc, folder, ctx.rank)
        if error is None:
            raise
    if ctx.world_size > 1:
        failed = int(ctx.all_reduce_max(torch.tensor(int(error is not None), dtype=torch.int64)).item())
        if failed:
            error = next(e for e in ctx.all_gather_object(error) if e is not None)  # type: ignore[assignment]
    if error is None:
        return
    if ctx.is_main:
        shutil.rmtree(folder, ignore_errors=True)
    if ctx.world_size > 1:
        ctx.barrier()  # the folder is gone before any rank says so
    code, line = error
    raise WriteFailed(f"{what} not written: {line}; the partial {folder} is removed; "
                      f"{FIXES.get(code, 'check that file system')}{', then ' + then if then else ''}")
