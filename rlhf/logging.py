"""Rank-aware logging: rank 0 logs at INFO, other ranks only warnings and errors. A line logged
while a tqdm progress bar is open is written above the bar (tqdm.write), never through it."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _BarAwareHandler(logging.StreamHandler):
    """stderr, through `tqdm.write` while a progress bar is open (the bar is redrawn below)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
        if not bars:
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def get_logger(name: str) -> logging.Logger:
    """A logger under the `rlhf` namespace; configures the root `rlhf` handler once per process."""
    global _CONFIGURED
    if not _CONFIGURED:
        root = logging.getLogger("rlhf")
        handler = _BarAwareHandler(sys.stderr)
        rank = _rank()
        prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("rlhf") else f"rlhf.{name}")
