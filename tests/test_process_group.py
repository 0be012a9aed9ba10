"""The process group and each rank's device, as a GPU launcher sets them up (checked on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf.engine import distributed
from rlhf.engine.distributed import DistributedContext, process_group_backend, rank_device
from rlhf.errors import UserError


def test_each_rank_takes_its_local_gpu_or_the_one_it_sees() -> None:
    assert rank_device(0, 0) == torch.device("cpu")
    assert rank_device(3, 8) == torch.device("cuda", 3)
    # srun --gpus-per-task=1: every rank sees one GPU, whatever its LOCAL_RANK.
    assert rank_device(5, 1) == torch.device("cuda", 0)
    with pytest.raises(UserError, match="LOCAL_RANK 4 but this process sees only 2 GPUs"):
        rank_device(4, 2)


def test_the_gpu_process_group_carries_a_cpu_backend() -> None:
    """Offload's gradient clipping and gathers run collectives on CPU tensors: NCCL alone has no CPU backend."""
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_initialize_on_a_gpu_launcher_asks_for_both_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA (faked) and torchrun's environment, initialize binds the rank's GPU and passes the
    two-backend string to init_process_group."""
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    class Stop(Exception):
        pass

    def init_process_group(backend: str, **kwargs: object) -> None:
        calls["backend"], calls["device_id"] = backend, kwargs.get("device_id")
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("RLHF_FORCE_CPU", raising=False)
    with pytest.raises(Stop):
        DistributedContext.initialize(timeout_s=5)
    assert calls == {"set_device": torch.device("cuda", 0), "backend": "cpu:gloo,cuda:nccl",
                     "device_id": torch.device("cuda", 0)}
    assert distributed._watchdog is None
