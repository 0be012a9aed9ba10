"""Resume checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout under <output>/checkpoints/:

    step_00000012/            DCP shards of every engine's model + optimizer state
    step_00000012/host_rank{r}.pt   per-rank host state: RNG, schedules, loss scale, data position
    latest                    name of the newest complete checkpoint (replaced atomically)

A checkpoint is written to `step_N.tmp/` and renamed once every rank has finished, so an
interrupted save never shadows the previous good one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.train_engine import TrainEngine
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Checkpointer:
    """Saves and restores the state of a stage's engines plus its loop position."""

    def __init__(self, root: str | Path, ctx: DistributedContext, keep: int = 2) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep = max(1, keep)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        return path if path.is_dir() else None

    def save(self, step: int, engines: dict[str, TrainEngine], loop_state: dict[str, Any]) -> Path:
        """Write a checkpoint for optimizer step `step` (collective: every rank calls it)."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.ctx.barrier()
        dcp.save({name: e.sharded_state() for name, e in engines.items()}, checkpoint_id=str(tmp))
        host = {
            "rng": rng_state(),
            "engines": {name: e.host_state() for name, e in engines.items()},
            "loop": loop_state,
            "world_size": self.ctx.world_size,
        }
        torch.save(host, tmp / f"host_rank{self.ctx.rank}.pt")
        self.ctx.barrier()
        if self.ctx.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_text_atomic(self.root / "latest", final.name)
            self._prune(keep_name=final.name)
        self.ctx.barrier()
        log.info("checkpoint saved: %s", final)
        return final

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[: max(0, len(done) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, engines: dict[str, TrainEngine]) -> dict[str, Any]:
        """Restore engines, RNG and return the saved loop state (collective)."""
        host_file = path / f"host_rank{self.ctx.rank}.pt"
        if not host_file.is_file():
            raise UserError(f"{path}: no host state for rank {self.ctx.rank}; resume with the world size it was saved with")
        host = torch.load(host_file, weights_only=False)
        if host["world_size"] != self.ctx.world_size:
            raise UserError(
                f"{path}: saved with world size {host['world_size']}, resuming with {self.ctx.world_size}; "
                "use the same --nproc-per-node"
            )
        state = {name: e.sharded_state() for name, e in engines.items()}
        dcp.load(state, checkpoint_id=str(path))
        for name, e in engines.items():
            e.load_sharded_state(state[name])
            e.load_host_state(host["engines"][name])
        set_rng_state(host["rng"])
        log.info("resumed from %s", path)
        return host["loop"]
