"""The one place that maps a device to its backend, chosen once.

    backend = select_backend(ctx.device, config.cpu, config.cuda)   # a stage, once, before models load
    backend_for(device).prepare_model(model)                          # anywhere below: the chosen one

A device without a backend of its own (mps, xpu) runs the reference (`Backend`). Importing this
module registers every backend's csrc ops with their self-tests (engine/ops.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlhf.engine import fused_adam  # registers the fused Adam ops (the optimizer's, on every device)
from rlhf.engine.backends.base import Backend
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends.cuda import CudaBackend
from rlhf.engine.backends.tuning import CpuConfig, CudaConfig
from rlhf.logging import get_logger

log = get_logger(__name__)

_chosen: dict[str, Backend] = {}


def _make(device_type: str, cpu: CpuConfig | None, cuda: CudaConfig | None) -> Backend:
    if device_type == "cpu":
        return CpuBackend(cpu)
    if device_type == "cuda":
        return CudaBackend(cuda)
    return Backend()


def select_backend(device: torch.device | str, cpu: CpuConfig | None = None, cuda: CudaConfig | None = None) -> Backend:
    """The backend of `device` tuned by the config's `cpu:` / `cuda:` sections, started and made the
    one `backend_for` answers for that device type from now on (a stage calls this once)."""
    device_type = torch.device(device).type
    backend = _make(device_type, cpu, cuda)
    backend.start()
    _chosen[device_type] = backend
    log.debug("device backend: %s", backend.describe())
    return backend


def backend_for(device: torch.device | str) -> Backend:
    """The backend chosen for `device`'s type (`select_backend`), else its default tuning."""
    device_type = torch.device(device).type
    if device_type not in _chosen:
        _chosen[device_type] = _make(device_type, None, None)
    return _chosen[device_type]


def plan_backend(device: str, cpu: CpuConfig | None = None, cuda: CudaConfig | None = None) -> Backend:
    """The backend a run on `device` would choose, for the memory plan: not started, not made current."""
    return _make(torch.device(device).type, cpu, cuda)


@contextlib.contextmanager
def using_backend(backend: Backend) -> Iterator[Backend]:
    """Within the block, `backend_for(backend.device_type)` answers `backend` (tests and benchmarks)."""
    previous = _chosen.get(backend.device_type)
    _chosen[backend.device_type] = backend
    try:
        yield backend
    finally:
        if previous is None:
            _chosen.pop(backend.device_type, None)
        else:
            _chosen[backend.device_type] = previous


__all__ = ["backend_for", "plan_backend", "select_backend", "using_backend"]
