"""Device backends: what is specific to a device type, behind one small interface, chosen once.

    backend = select_backend(ctx.device, config.cpu, config.cuda)   # a stage, once, before models load
    backend_for(device).prepare_model(model)                          # anywhere below: the chosen one

    base.py   `Backend`: the interface, and its torch reference (every fast path must match it)
    cpu/      the CPU's: fused layer kernels, oneDNN linears, the fused decode step, row groups,
              malloc tuning (`CpuConfig`: the `cpu:` config section, `--cpu-...` flags)
    cuda/     the GPU's: the generation kernels' wiring, graph-replayed decode steps
              (`CudaConfig`: the `cuda:` section, `--cuda-...` flags)

This package is the one place that maps a device to its backend. A device without one (mps, xpu)
runs the reference. Importing it registers every backend's csrc ops with their self-tests
(engine/ops.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlhf.engine import fused_adam  # registers the fused Adam ops (the optimizer's, on every device)
from rlhf.engine.backends.base import Backend, generation_kernels, generation_kernels_enabled
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends.cpu.config import RENAMED_CPU_FIELDS, CpuConfig
from rlhf.engine.backends.cuda import CudaBackend
from rlhf.engine.backends.cuda.config import CudaConfig
from rlhf.logging import get_logger

log = get_logger(__name__)

_chosen: dict[str, Backend] = {}

RENAMED_FIELDS: dict[str, str] = {**RENAMED_CPU_FIELDS}
"""Earlier names of the backends' config fields -> today's (config files, saved configs and flags read both)."""


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


__all__ = [
    "RENAMED_FIELDS", "Backend", "CpuBackend", "CpuConfig", "CudaBackend", "CudaConfig", "backend_for", "generation_kernels",
    "generation_kernels_enabled", "plan_backend", "select_backend", "using_backend",
]
