"""Rank-aware logging: rank 0 logs at INFO, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str) -> logging.Logger:
    """A logger under the `rlhf` namespace; configures the root `rlhf` handler once per process."""
    global _CONFIGURED
    if not _CONFIGURED:
        root = logging.getLogger("rlhf")
        handler = logging.StreamHandler(sys.stderr)
        rank = _rank()
        prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("rlhf") else f"rlhf.{name}")
