"""The stalled-rank watchdog: when one rank stops making progress, every other rank stops the job.

A collective waits for every rank, so a rank that is stopped (SIGSTOP, a paused VM), hung or whose
host is gone leaves the others waiting: up to the process group's timeout (`--dist-timeout`),
then gloo/NCCL raise an error that names no rank, and torchrun waits another 30 s for a stopped
worker to take its SIGTERM. The watchdog is a daemon thread per rank (multi-process jobs only):

- every `interval` seconds it bumps this rank's heartbeat in the job's TCP store (the one
  torchrun or rank 0 hosts), with the rank's pid and host;
- it reads the other ranks' heartbeats; a rank whose heartbeat has not changed for `timeout`
  seconds is stalled: this rank prints one line naming it, SIGKILLs it when it runs on the same
  host (a stopped process would otherwise keep its SIGTERM pending), and exits with code 2 while
  its main thread still waits in the collective. torchrun then tears down what is left.

Only one rank prints the line (`claim_report`: the first to add to a store counter). The thread
needs the GIL for a few microseconds per beat, which every torch op and collective releases.

Test hook (tests/test_dist_timeout.py): RLHF_TEST_STALL="RANK:N" makes rank RANK send itself
SIGSTOP when it enters its N-th `DistributedContext.all_reduce_sum` (the SFT loop calls it twice
per step, so N=3 stops at the start of step 2), after printing one line saying so. Nothing else
reads it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

_STORE_TIMEOUT = datetime.timedelta(seconds=30)


@dataclass
class PeerState:
    """What this rank last saw of a peer: its heartbeat text and when that text last changed."""

    beat: str = ""
    changed_at: float = 0.0

    @property
    def pid(self) -> int | None:
        parts = self.beat.split()
        return int(parts[1]) if len(parts) >= 3 else None

    @property
    def host(self) -> str | None:
        parts = self.beat.split()
        return parts[2] if len(parts) >= 3 else None


class StallWatchdog:
    """Heartbeats through the job's store; stops this process when a peer has been silent for
    `timeout` seconds (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, timeout: float, interval: float | None = None) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = interval if interval is not None else min(5.0, max(0.5, timeout / 10))
        self.host = socket.gethostname()
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"rlhf_watchdog/{run}/"
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=_STORE_TIMEOUT, wait_for_workers=False)
        started = time.monotonic()
        self.peers = {r: PeerState(changed_at=started) for r in range(world_size) if r != rank}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlhf-stall-watchdog", daemon=True)

    def start(self) -> "StallWatchdog":
        self._beat(0)
        self._thread.start()
        return self

    def stop(self) -> None:
        """After the job's last collective: no verdicts any more (peers are exiting)."""
        self._stop.set()

    def _beat(self, count: int) -> None:
        self.store.set(f"{self.prefix}{self.rank}", f"{count} {os.getpid()} {self.host}")

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self._beat(count)
                stalled = self._check_peers()
            except Exception:  # the store is gone: the job is ending, and its own errors say why
                return
            if stalled is not None and not self._stop.is_set():
                self._stop_job(stalled)

    def _read_beats(self) -> dict[int, str]:
        """Every other rank's heartbeat text ("" before its first): two store round trips, not one per rank."""
        keys = {r: f"{self.prefix}{r}" for r in self.peers}
        if self.store.check(list(keys.values())):
            return {r: v.decode() for r, v in zip(keys, self.store.multi_get(list(keys.values())))}
        return {r: self.store.get(k).decode() if self.store.check([k]) else "" for r, k in keys.items()}

    def _check_peers(self) -> int | None:
        """The first peer silent for more than `timeout` seconds, else None."""
        beats = self._read_beats()
        now = time.monotonic()
        for r, peer in self.peers.items():
            beat = beats[r]
            if beat != peer.beat:
                peer.beat, peer.changed_at = beat, now
            elif now - peer.changed_at > self.timeout:
                return r
        return None

    def describe(self, rank: int) -> str:
        """`rank 1 (pid 123 on host) made no progress for 12 s`."""
        peer = self.peers[rank]
        where = f" (pid {peer.pid} on {peer.host})" if peer.pid is not None else ""
        return f"rank {rank}{where} made no progress for {time.monotonic() - peer.changed_at:.0f} s"

    def silent_peers(self, min_age: float) -> list[int]:
        """The peers whose heartbeat has not changed for `min_age` seconds (as last read)."""
        now = time.monotonic()
        return [r for r, peer in self.peers.items() if now - peer.changed_at > min_age]

    def kill_if_local(self, rank: int) -> None:
        """SIGKILL a stalled peer on this host: a stopped process keeps torchrun's SIGTERM pending
        (torchrun then waits 30 s more), and a hung one may ignore it."""
        peer = self.peers[rank]
        if peer.pid is not None and peer.host == self.host and peer.pid != os.getpid():
            try:
                os.kill(peer.pid, signal.SIGKILL)
            except OSError:
                pass

    def verdict(self, stalled: list[int]) -> str:
        """The job's error line (without `error: `) for these stalled peers."""
        return (f"{'; '.join(self.describe(r) for r in stalled)} (--dist-timeout {self.timeout:g}): stopped, hung or "
                "its host is gone; stopping every rank")

    def _stop_job(self, stalled: int) -> None:
        if claim_report(self.store, self.prefix):
            # Rank 0 may have a progress bar on the line: start a new one.
            line = f"{chr(10) if self.rank == 0 else ''}error: {self.verdict([stalled])}\n"
            os.write(sys.stderr.fileno(), line.encode())
        self.kill_if_local(stalled)
        os._exit(2)


def claim_report(store: dist.Store, prefix: str) -> bool:
    """True for the first rank of the job to ask: it prints the job's one error line."""
    try:
        return int(store.add(f"{prefix}reported", 1)) == 1
    except Exception:  # no store to agree through: every rank reports
        return True


_test_calls = 0


def test_stall_hook(rank: int) -> None:
    """RLHF_TEST_STALL="RANK:N": rank RANK stops itself (SIGSTOP) on its N-th call (tests only)."""
    global _test_calls
    spec = os.environ.get("RLHF_TEST_STALL")
    if not spec:
        return
    _test_calls += 1
    stall_rank, call = (int(x) for x in spec.split(":"))
    if rank == stall_rank and _test_calls == call:
        os.write(sys.stderr.fileno(), f"RLHF_TEST_STALL: rank {rank} stops itself (SIGSTOP)\n".encode())
        os.kill(os.getpid(), signal.SIGSTOP)
