"""The one object that owns process groups and device meshes.

Nothing else in the project reads RANK/WORLD_SIZE or calls init_process_group. A single process
without torchrun still gets a (1-rank) process group, so FSDP2 and DCP code paths are the same at
every world size.

Collectives time out after `--dist-timeout` seconds (EngineConfig.dist_timeout; the app passes it
with `set_dist_timeout` before a stage creates the group), and a multi-process job runs a
`StallWatchdog` (engine/watchdog.py) that stops every rank within that time when one rank stops
making progress, with one line naming it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import typing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlhf.engine.config import EngineConfig
from rlhf.engine.watchdog import StallWatchdog, claim_report, test_stall_hook
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

_dist_timeout: float = EngineConfig().dist_timeout
_watchdog: StallWatchdog | None = None


def set_dist_timeout(seconds: float) -> None:
    """The collective timeout (and stall limit) of the process group the next `initialize` creates."""
    global _dist_timeout
    _dist_timeout = float(seconds)


def claim_error_report() -> bool:
    """Whether this rank prints the job's one error line: True alone, else only for the first rank
    of the job to ask (the others exit quietly with the same code)."""
    if _watchdog is None:
        return True
    return claim_report(_watchdog.store, _watchdog.prefix)


def is_multi_process() -> bool:
    """A process group of several ranks exists."""
    return dist.is_initialized() and dist.get_world_size() > 1


def stall_verdict() -> str | None:
    """After a collective timed out: the line naming each peer whose heartbeat stopped for half the
    timeout or more ('rank 1 (pid 123 on host) made no progress for 600 s (--dist-timeout 600):
    ...'); None when none is known (no watchdog, or every peer is alive and one is hung inside the
    job, which the collective's own error then reports)."""
    if _watchdog is None:
        return None
    stalled = _watchdog.silent_peers(min_age=_watchdog.timeout / 2)
    return _watchdog.verdict(stalled) if stalled else None


def exit_job(code: int) -> None:
    """End this rank of a failed multi-process job at once, its error already printed: stalled
    peers on this host are killed (a stopped one would hold torchrun's teardown 30 s), and the
    process exits without running teardown that could wait on a dead peer. torchrun (or the
    other ranks' watchdogs) stop the other ranks."""
    if _watchdog is not None:
        for rank in _watchdog.silent_peers(min_age=_watchdog.timeout / 2):
            _watchdog.kill_if_local(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_rank(code: int = 0) -> typing.NoReturn:
    """End a rank whose process group is torn down, without interpreter finalization: the steps
    of a normal exit before it (join the other non-daemon threads, run the atexit handlers, flush),
    then `os._exit`.

    A collective issued inside backward (FSDP2's gradient reduce) keeps the Python context that
    autograd put in thread-local state, and the last reference to it can be dropped by one of
    gloo's worker threads just after this rank's final barrier returns (a barrier holds the
    collectives queued before it). If finalization has begun by then, taking the GIL for it ends
    that thread inside a C++ destructor and the rank aborts ("terminate called without an active
    exception"), after its work was done. Exiting without finalization leaves that thread nothing
    to collide with; every file the job writes is closed by then (each is written in a `with`)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what finalization runs first: join non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_watchdog() -> None:
    """After the job's last collective (every rank passed it), before the group is torn down."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def _start_watchdog(rank: int, world_size: int, timeout: float) -> None:
    global _watchdog
    if world_size > 1 and "MASTER_ADDR" in os.environ and _watchdog is None:
        _watchdog = StallWatchdog(rank, world_size, timeout).start()


def rank_device(local_rank: int, cuda_devices: int) -> torch.device:
    """This rank's device: the CPU without CUDA; `cuda:LOCAL_RANK` where the rank sees every GPU of
    its node (torchrun); `cuda:0` where a launcher gives each rank the one GPU it sees (`srun
    --gpus-per-task=1`, CUDA_VISIBLE_DEVICES per rank)."""
    if cuda_devices == 0:
        return torch.device("cpu")
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    if local_rank >= cuda_devices:
        raise UserError(f"LOCAL_RANK {local_rank} but this process sees only {cuda_devices} GPUs; lower "
                        "--nproc-per-node, or give each rank one GPU (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """The process group's backends: gloo for CPU tensors always (CPU offload's gradient clipping and
    gathers, metrics reduced on the host), NCCL for CUDA ones where the ranks run on GPUs."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class TPCoordinates:
    """Where this rank sits among the tensor-parallel groups of size `size`.

    Consecutive ranks form one group (they share a node): group `rank // size`, position
    `rank % size` in it. The ranks of one group generate the same rollouts together, so they
    must read the same prompts; the `num_groups` groups split the prompts between them.
    """

    size: int
    group_index: int
    rank_in_group: int
    num_groups: int


@dataclass
class DistributedContext:
    """Rank, world size, device, and the meshes built over them.

    `mesh` is 1-D over all ranks ("dp") for FSDP2 sharding; `replicate_mesh` is the 2-D
    ("replicate", "shard") mesh with a shard dim of 1 used for ZeRO-0 (HSDP that shards nothing =
    data parallel); `tp_mesh(tp)` is a 2-D ("dp", "tp") mesh for tensor-parallel rollout.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    _tp_meshes: dict[int, DeviceMesh] = field(default_factory=dict, repr=False)
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _replicate_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def initialize(cls, timeout_s: float | None = None) -> "DistributedContext":
        """Join (or create) the default process group from torchrun's environment, or alone.
        `timeout_s` (default: `set_dist_timeout`'s, else EngineConfig.dist_timeout) bounds every
        collective; with several ranks the stall watchdog starts with the same limit."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and os.environ.get("RLHF_FORCE_CPU") != "1"
        device = rank_device(local_rank, torch.cuda.device_count() if use_cuda else 0)
        if use_cuda:
            torch.cuda.set_device(device)
        backend = process_group_backend(device)
        if not dist.is_initialized():
            seconds = timeout_s if timeout_s is not None else _dist_timeout
            timeout = datetime.timedelta(seconds=seconds)
            if "MASTER_ADDR" in os.environ:
                # device_id: NCCL's communicator forms now, on this rank's GPU (gloo keeps the CPU tensors).
                dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
                _start_watchdog(dist.get_rank(), dist.get_world_size(), seconds)
            else:
                # A lone process: an in-memory store, so no port is opened.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        ctx = cls(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(),
                  device=device, backend=backend)
        log.info("distributed: world_size=%d backend=%s device=%s", ctx.world_size, backend, device)
        return ctx

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def mesh(self) -> DeviceMesh:
        """1-D mesh over all ranks, for FSDP2 sharding (ZeRO 1/2/3)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device_type, (self.world_size,), mesh_dim_names=("dp",))
        return self._mesh

    @property
    def replicate_mesh(self) -> DeviceMesh:
        """2-D (replicate=world, shard=1) mesh: FSDP2 over it replicates params (ZeRO-0)."""
        if self._replicate_mesh is None:
            self._replicate_mesh = init_device_mesh(
                self.device_type, (self.world_size, 1), mesh_dim_names=("replicate", "shard")
            )
        return self._replicate_mesh

    def tp_coordinates(self, tp_size: int) -> TPCoordinates:
        """This rank's TP group and place in it; the one check that `tp_size` fits the world."""
        if tp_size < 1 or self.world_size % tp_size:
            raise UserError(
                f"--inference-tp-size {tp_size} must be >= 1 and divide the world size {self.world_size}; "
                "pick a divisor of the number of processes"
            )
        return TPCoordinates(size=tp_size, group_index=self.rank // tp_size, rank_in_group=self.rank % tp_size,
                             num_groups=self.world_size // tp_size)

    def tp_mesh(self, tp_size: int) -> DeviceMesh:
        """2-D (dp, tp) mesh whose "tp" rows are the groups of `tp_coordinates` (consecutive ranks)."""
        coords = self.tp_coordinates(tp_size)
        if tp_size not in self._tp_meshes:
            self._tp_meshes[tp_size] = init_device_mesh(
                self.device_type, (coords.num_groups, tp_size), mesh_dim_names=("dp", "tp")
            )
        return self._tp_meshes[tp_size]

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce_sum(self, value: float | torch.Tensor) -> torch.Tensor:
        """Sum a scalar or tensor over all ranks (returns a new tensor on this rank's device)."""
        t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None).to(self.device).clone()
        test_stall_hook(self.rank)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        t = value.to(self.device).clone()
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_agree(self, flag: bool) -> bool:
        """True when `flag` holds on every rank (one small all_reduce on several ranks)."""
        if self.world_size == 1:
            return flag
        return not bool(self.all_reduce_max(torch.tensor(int(not flag))))

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank `src`'s Python object on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's Python object, in rank order, on every rank (pickled: keep it small, on CPU)."""
        if self.world_size == 1:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self) -> None:
        """Tear the process group down; every rank must call it (see `shutdown_process_group`)."""
        shutdown_process_group()


def shutdown_process_group() -> None:
    """Wait for every rank (so that no rank closes gloo's connections while a peer is still
    receiving), stop the stall watchdog, then tear the default group down; collective."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        stop_watchdog()
        dist.destroy_process_group()
