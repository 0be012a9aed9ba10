"""Resume checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout under <output>/checkpoints/:

    step_00000012/            DCP shards of every engine's model + optimizer state
    step_00000012/host_rank{r}.pt   per-rank host state: RNG, schedules, loss scale, data position,
                              the run's config (what `--resume` compares its own with)
    latest                    name of the newest complete checkpoint (replaced atomically)

A checkpoint is written to `step_N.tmp/` and renamed once every rank has finished, so an
interrupted save never shadows the previous good one. A checkpoint is complete when it holds
DCP's `.metadata` (written after every shard) and rank 0's host state; resume takes the one
`latest` names when it is complete, else the newest complete one, so a broken or missing
`latest` never makes a run start over while a usable checkpoint exists. Folders are deleted by
renaming them to `*.old` first, so a deletion cut short leaves nothing that looks usable.

Resume reads nothing with a plain unpickler (engine/safe_unpickle.py), and a complete checkpoint
that still does not load (a truncated shard, a damaged index, another model's shapes) is named in
one warning and the complete one before it is used (`Checkpointer.resume`).
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
from torch.distributed.checkpoint.api import CheckpointException

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fileio import honour_umask, replace_file
from rlhf.engine.safe_unpickle import (
    SafeLoadPlanner, UnsafeCheckpoint, ValidatedReader, read_dcp_metadata, read_host_state, unsafe_reason,
)
from rlhf.engine.train_engine import TrainEngine
from rlhf.engine.write_errors import WriteFailed, agreed_write
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
    replace_file(tmp, path)


METADATA = ".metadata"  # DCP's index, written by its coordinator after every rank's shards


def checkpoint_step(path: Path) -> int | None:
    """The step of a `step_N` folder; None for any other name (`step_N.tmp`, `step_N.old`, `latest`)."""
    prefix, _, number = path.name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else None


def is_complete(path: Path) -> bool:
    """A checkpoint resume can load: DCP's index and rank 0's host state (the last files a save
    writes before the rename). Catches folders damaged after the rename: a partial copy, a
    deletion by hand."""
    return (checkpoint_step(path) is not None and (path / METADATA).is_file()
            and (path / "host_rank0.pt").is_file())


def complete_checkpoints(root: Path) -> list[Path]:
    """Every complete checkpoint under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def named_latest(root: Path) -> Path | None:
    """The folder the `latest` file names, or None when the file is absent or unreadable."""
    try:
        name = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if name and "/" not in name and name not in (".", "..") else None


def resume_order(root: Path) -> list[Path]:
    """The checkpoints `--resume` tries, in order: the one `latest` names when it is complete
    (else the newest complete one), then each complete one before it, newest first. Complete
    ones after it (a run resumed from an earlier one) are not: their steps run again."""
    complete = complete_checkpoints(root)
    named = named_latest(root)
    first = named if named is not None and is_complete(named) else (complete[-1] if complete else None)
    if first is None:
        return []
    return [first, *(p for p in reversed(complete) if (checkpoint_step(p) or 0) < (checkpoint_step(first) or 0))]


def discard(path: Path) -> None:
    """Delete a checkpoint folder: renamed to `*.old` first (atomic), then removed, so an
    interrupted deletion never leaves a half-deleted `step_N` behind."""
    if not path.name.endswith((".tmp", ".old")):
        doomed = path.with_name(path.name + ".old")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """Saves and restores the state of a stage's engines plus its loop position."""

    def __init__(self, root: str | Path, ctx: DistributedContext, keep: int = 2,
                 run_config: dict[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep = max(1, keep)
        # Saved in every checkpoint's host state: what `--resume` compares its config with
        # (`saved_run_config`), whatever has become of config.yaml since.
        self.run_config = run_config

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one `latest` names when it is complete, else the
        newest complete one (with a warning); None when there is none."""
        named = named_latest(self.root)
        if named is not None and is_complete(named):
            return named
        complete = complete_checkpoints(self.root)
        if not complete:
            return None
        what = "is missing" if named is None else f"names {named.name}, which is missing or incomplete"
        log.warning("%s %s; resuming from the newest complete checkpoint, %s", self.root / "latest", what,
                    complete[-1].name)
        return complete[-1]

    def save(self, step: int, engines: dict[str, TrainEngine], loop_state: dict[str, Any]) -> Path:
        """Write a checkpoint for optimizer step `step` (collective: every rank calls it). A write
        that fails on any rank (a full disk) leaves no `step_N.tmp` and the earlier checkpoints as
        they were, and raises the same WriteFailed line on every rank (engine/write_errors.py)."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        try:
            self._write(step, final, tmp, engines, loop_state)
        except WriteFailed as exc:
            kept = complete_checkpoints(self.root)
            previous = f"the checkpoint before it, {kept[-1]}, is intact" if kept else "no earlier checkpoint exists"
            raise WriteFailed(f"{exc}; {previous}; then resume with --resume") from None
        log.info("checkpoint saved: %s", final)
        return final

    def _write(self, step: int, final: Path, tmp: Path, engines: dict[str, TrainEngine],
               loop_state: dict[str, Any]) -> None:
        """`save`'s three parts, each ended by the ranks' agreement that it was written (the barrier
        every rank waits at): the empty `tmp` (rank 0); the shards and each rank's host state;
        `tmp` renamed to `final`, `latest`, pruning (rank 0)."""
        what = f"checkpoint {final.name}"
        with agreed_write(self.ctx, tmp, what):
            if self.ctx.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
        with agreed_write(self.ctx, tmp, what):
            dcp.save({name: e.sharded_state() for name, e in engines.items()}, checkpoint_id=str(tmp))
            host = {
                "rng": rng_state(),
                "engines": {name: e.host_state() for name, e in engines.items()},
                "loop": loop_state,
                "world_size": self.ctx.world_size,
                "config": self.run_config,
            }
            torch.save(host, tmp / f"host_rank{self.ctx.rank}.pt")
        with agreed_write(self.ctx, tmp, what):
            if self.ctx.is_main:
                if final.exists():  # a step redone after resuming from an earlier checkpoint
                    discard(final)
                honour_umask(tmp)
                os.replace(tmp, final)
                try:
                    write_text_atomic(self.root / "latest", final.name)
                finally:
                    (self.root / "latest.tmp").unlink(missing_ok=True)
                self._prune(step)

    def _prune(self, saved_step: int) -> None:
        """Delete what no resume can use once step `saved_step` is saved: leftovers of interrupted
        saves and deletions (`*.tmp`, `*.old`), incomplete checkpoints before it, and complete
        ones beyond the newest `keep` up to it. Checkpoints after it (a run resumed from an earlier
        one) are left alone: their steps are redone and replaced one by one."""
        for path in self.root.iterdir():
            if not path.is_dir():
                continue
            step = checkpoint_step(path)
            if path.name.startswith("step_") and path.name.endswith((".tmp", ".old")):
                discard(path)
            elif step is not None and step < saved_step and not is_complete(path):
                discard(path)
        complete = [p for p in complete_checkpoints(self.root) if (checkpoint_step(p) or 0) <= saved_step]
        for old in complete[: max(0, len(complete) - self.keep)]:
            discard(old)

    def resume(self, engines: dict[str, TrainEngine]) -> tuple[Path, dict[str, Any]] | None:
        """Restore the newest checkpoint that loads (collective): (its folder, its loop state);
        None when there is no complete checkpoint. One that does not load (a damaged shard or
        index, another model's shapes, a file naming code to run) is named in one warning and
        the complete one before it is tried; UserError when none loads."""
        if self.latest() is None:  # (its warning, when `latest` names no complete checkpoint)
            return None
        candidates = resume_order(self.root)
        failed: list[str] = []
        for i, path in enumerate(candidates):
            try:
                return path, self.load(path, engines)
            except UnloadableCheckpoint as exc:
                failed.append(f"{path.name}: {exc}")
                then = (f"resuming from the newest complete earlier checkpoint, {candidates[i + 1].name}"
                        if i + 1 < len(candidates) else "no earlier checkpoint to resume from")
                if self.ctx.is_main:  # every rank agreed on it (`_agree`): one line for the job
                    log.warning("resume: %s cannot be loaded (%s); %s", path, exc, then)
        raise UserError(f"--resume: no checkpoint in {self.root} can be loaded ({'; '.join(failed)}); delete "
                        f"{self.root} to train from the start, or choose another --output")

    def load(self, path: Path, engines: dict[str, TrainEngine]) -> dict[str, Any]:
        """Restore engines, RNG and return the saved loop state (collective). Nothing is read
        with a plain unpickler (engine/safe_unpickle.py). The ranks agree after reading their
        files and after restoring: a failure on any rank is UnloadableCheckpoint on every rank
        (its engines may hold part of the checkpoint: a later load overwrites all of it); a
        world size that differs is a UserError."""
        host_file = path / f"host_rank{self.ctx.rank}.pt"
        host: dict[str, Any] = {}
        metadata = None
        verdict = ("ok", "")
        try:
            if not host_file.is_file():
                raise UserError(f"{path}: no host state for rank {self.ctx.rank}; resume with the world size it was "
                                "saved with")
            host = read_host_state(host_file)
            if host["world_size"] != self.ctx.world_size:
                raise UserError(f"{path}: saved with world size {host['world_size']}, resuming with "
                                f"{self.ctx.world_size}; use the same --nproc-per-node")
            metadata = read_dcp_metadata(path / METADATA)
        except UserError as exc:
            verdict = ("user", str(exc))
        except UnsafeCheckpoint as exc:
            verdict = ("unloadable", str(exc))
        self._agree(verdict)
        state = {name: e.sharded_state() for name, e in engines.items()}
        try:
            dcp.load(state, storage_reader=ValidatedReader(path, metadata), planner=SafeLoadPlanner())
            for name, e in engines.items():
                e.load_sharded_state(state[name])
                e.load_host_state(host["engines"][name])
            set_rng_state(host["rng"])
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure: the checkpoint's reason
            verdict = ("unloadable", load_failure(exc))
        self._agree(verdict)
        log.info("resumed from %s", path)
        return host["loop"]

    def _agree(self, verdict: tuple[str, str]) -> None:
        """Every rank raises the same error when any rank's `verdict` is not ("ok", ""): a
        UserError before an UnloadableCheckpoint, the lowest rank's message."""
        verdicts = self.ctx.all_gather_object(verdict) if self.ctx.world_size > 1 else [verdict]
        for kind, error in (("user", UserError), ("unloadable", UnloadableCheckpoint)):
            for rank, (got, message) in enumerate(verdicts):  # type: ignore[misc]
                if got == kind:
                    raise error(message if len(verdicts) == 1 else f"rank {rank}: {message}")


class UnloadableCheckpoint(Exception):
    """A complete checkpoint that cannot be restored; the message says why, in one line."""


def load_failure(exc: BaseException) -> str:
    """One line for what stopped a load: the first failing rank's exception inside DCP's
    CheckpointException (whose text is a traceback per rank), else the exception's first line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return str(exc) if isinstance(exc, UnsafeCheckpoint) else unsafe_reason(exc)


def saved_run_config(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """(checkpoint, config) of the newest checkpoint `--resume` would try that holds the run's
    config; None when none does (no checkpoint yet, or saved before checkpoints held it). Read
    on one rank before any engine exists; an unreadable checkpoint is skipped here and named by
    `Checkpointer.resume`."""
    for path in resume_order(root):
        try:
            config = read_host_state(path / "host_rank0.pt", lazy=True).get("config")
        except UnsafeCheckpoint:
            continue
        if isinstance(config, dict):
            return path, config
    return None
