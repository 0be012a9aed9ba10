"""`python -m tests.write_failure_worker ARGS`: `rlhf ARGS`, with one rank's writes into some
files going to /dev/full, so they fail with the kernel's own ENOSPC as on a full disk
(tests/test_write_failures.py; under torchrun: `-m tests.write_failure_worker`).

RLHF_TEST_FULL="RANK:PATTERN": on rank RANK, DCP's checkpoint streams (shards, `.metadata`) and
in-place `os.pwrite`s (the export's weights) whose path contains PATTERN write to /dev/full.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _fill_up(pattern: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_stream = FileSystem.create_stream

    @contextmanager
    def create_stream(self: Any, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode.startswith("w") and pattern in str(path):
            with open("/dev/full", "wb") as stream:
                yield stream
            return
        with real_stream(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    real_pwrite, full = os.pwrite, os.open("/dev/full", os.O_WRONLY)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if pattern in os.readlink(f"/proc/self/fd/{fd}"):
            return real_pwrite(full, data, 0)
        return real_pwrite(fd, data, offset)

    os.pwrite = pwrite  # type: ignore[assignment]


def main() -> None:
    rank, _, pattern = os.environ["RLHF_TEST_FULL"].partition(":")
    if int(os.environ.get("RANK", "0")) == int(rank):
        _fill_up(pattern)
    from rlhf.cli import main as rlhf_main

    rlhf_main()


if __name__ == "__main__":
    assert Path("/dev/full").exists()
    main()
