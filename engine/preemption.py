"""Preemption: SIGTERM and SIGINT stop training at the next step boundary, after a checkpoint.

SLURM and Kubernetes send SIGTERM some seconds before they kill a job; a terminal's Ctrl-C sends
SIGINT. While `stop_on_signals` is active (the CLI wraps every command in it), the first such
signal only records itself. The training loops (stages/trainer.py `run_training`, stages/ppo/loop.py
`PPOTrainer.train`) call `agreed_stop` at every step boundary: one all_reduce of one integer, so
every rank stops after the same optimizer step (PPO: iteration), even a rank the signal never
reached, and the checkpoint written for it is collective and complete. The stage then raises
`Preempted`, whose exit code is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a
shell reports a process the signal killed.

A second signal ends the process at once with that code, leaving the last complete checkpoint
(an unfinished `step_N.tmp` is never resumed from, and the next save removes it). A repeat within
REPEAT_WINDOW_S of the first is the same request, not a second one: SLURM signals every process
of a job step and torchrun forwards the signal it got as well, so each rank may get it twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import torch

from rlhf.engine.distributed import DistributedContext

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0
"""A repeat of the signal within this many seconds of the first is the same request."""


@dataclass
class _Request:
    signum: int = 0
    """The first stop signal received (0: none)."""
    at: float = 0.0
    stopped: bool = False
    """The stop's checkpoint and line are done: a later signal ends the process quietly."""
    resume: str = "resume with --resume"
    """How the command is resumed, for the stop's line."""


_request = _Request()


class Preempted(SystemExit):
    """Every rank stopped for `signum` after a complete checkpoint (or before any step ran); the
    CLI ends the rank with `code`, 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(exit_code(signum))
        self.signum = signum


def exit_code(signum: int) -> int:
    """A shell's code for a process ended by `signum`: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _on_signal(signum: int, frame: FrameType | None) -> None:
    now = time.monotonic()
    if not _request.signum:
        _request.signum, _request.at = signum, now
        return
    if _request.stopped:  # the stop is complete; torchrun ending the ranks that are still exiting
        os._exit(exit_code(_request.signum))
    if now - _request.at < REPEAT_WINDOW_S:
        return
    if int(os.environ.get("RANK", "0")) == 0:
        line = (f"\nerror: a second {signal_name(signum)}: exiting at once; the last complete checkpoint is "
                f"kept ({_request.resume})\n")
        os.write(2, line.encode())
    os._exit(exit_code(signum))


@contextmanager
def stop_on_signals(resume: str = "resume with --resume") -> Iterator[None]:
    """SIGTERM and SIGINT request a stop at the next step boundary while the block runs (see the
    module docstring; `resume` says how to go on, in the stop's line); the previous handlers come
    back after it, except after `Preempted`: the process is ending, and a further signal (torchrun
    ending a rank still tearing down) ends it at once with the same code. A no-op outside the main
    thread, where Python cannot set handlers."""
    global _request
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _request = _Request(resume=resume)
    previous = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS}
    try:
        yield
    except Preempted:
        previous = {}
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous:
            _request = _Request()


def resume_hint() -> str:
    """How the running command is resumed after a stop ('resume with --resume')."""
    return _request.resume


def requested_signal() -> int | None:
    """The stop signal this process got (None: none); `agreed_stop` is what the ranks act on."""
    return _request.signum or None


def agreed_stop(ctx: DistributedContext) -> int | None:
    """The signal every rank stops for at this step boundary, None to go on. Collective: every rank
    calls it at the same boundary (one all_reduce of one integer; ranks that got different signals
    agree on the higher number, SIGTERM over SIGINT)."""
    signum = _request.signum
    if ctx.world_size > 1:
        signum = int(ctx.all_reduce_max(torch.tensor(signum, dtype=torch.int64)).item())
    return signum or None


def forward_stop_signals() -> None:
    """In a launcher (torchrun run in this process): SIGTERM and SIGINT are passed on to its child
    processes, the workers (each the leader of its own session, so to its process group), and do
    not end the launcher, which goes on waiting for the workers and so exits with their code."""

    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in child_pids():
            try:
                os.killpg(pid, signum)
            except OSError:  # not a group leader: the child alone
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass

    for signum in STOP_SIGNALS:
        signal.signal(signum, forward)


def child_pids() -> list[int]:
    """The pids of this process's children (from /proc: each thread's `children`, else every
    process's parent)."""
    me = os.getpid()
    try:
        pids: list[int] = []
        for task in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        return pids
    except OSError:
        pass
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"
        except (OSError, ValueError, IndexError):
            continue
        if parent == me:
            pids.append(int(entry))
    return pids


def mark_stopped(signum: int) -> None:
    """The stop for `signum` is complete (checkpoint written, line logged): a further signal ends
    the process at once without a word."""
    _request.signum = _request.signum or signum
    _request.stopped = True
