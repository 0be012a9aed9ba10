"""Device backends: what is specific to a device type, behind one small interface, chosen once.

    base.py      `Backend`: the interface, and its torch reference (every fast path must match it)
    registry.py  `select_backend` (a stage, once) and `backend_for(device)` (the generic engine)
    tuning.py    `CpuConfig` and `CudaConfig`: the `cpu:` and `cuda:` config sections
    cpu/         the CPU's: fused layer kernels, oneDNN linears, the fused decode step, row groups,
                 malloc tuning
    cuda/        the GPU's: the generation kernels' wiring, graph-replayed decode steps

This package's own import is light (the tuning sections, no torch): the CLI's configs compose them.
"""

from rlhf.engine.backends.tuning import RENAMED_FIELDS, CpuConfig, CudaConfig

__all__ = ["RENAMED_FIELDS", "CpuConfig", "CudaConfig"]
