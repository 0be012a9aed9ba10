"""Loaders for the csrc custom ops: JIT-built on first use, cached, with a torch fallback.

Each op is registered with an `OpSpec`. `load_op(name)` builds it once per process with
torch.utils.cpp_extension (ninja) into a cache folder keyed by torch version, and returns the
extension module; when no compiler (or no GPU for a CUDA op) is available, or the build fails,
it logs one warning and returns None so the caller takes its PyTorch reference path.
`op_report()` is what `rlhf report` prints.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from rlhf.logging import get_logger

log = get_logger(__name__)

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"


@dataclass(frozen=True)
class OpSpec:
    """How to build one extension from csrc/."""

    name: str
    sources: tuple[str, ...]
    """Paths relative to csrc/."""
    needs_cuda: bool = False
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = ()


@dataclass
class _OpState:
    spec: OpSpec
    module: ModuleType | None = None
    tried: bool = False
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_OPS: dict[str, _OpState] = {}


def register_op(spec: OpSpec) -> None:
    """Make `spec` known to `load_op` and `op_report`; registering the same name twice is a no-op."""
    if spec.name not in _OPS:
        _OPS[spec.name] = _OpState(spec)


def build_directory(name: str) -> Path:
    """Cache folder of one op, keyed by torch version and CUDA version."""
    root = Path(os.environ.get("RLHF_OPS_CACHE", Path.home() / ".cache" / "rlhf" / "ops"))
    cuda = torch.version.cuda or "cpu"
    path = root / f"torch{torch.__version__.replace('+', '_')}-cu{cuda}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _unavailable_reason(spec: OpSpec) -> str | None:
    if os.environ.get("RLHF_DISABLE_OPS") == "1":
        return "RLHF_DISABLE_OPS=1"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    if spec.needs_cuda:
        if not torch.cuda.is_available():
            return "no CUDA device"
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return "CUDA_HOME not found (nvcc missing)"
    return None


def load_op(name: str) -> ModuleType | None:
    """The built extension module for op `name`, or None (with one warning) if it cannot be built."""
    state = _OPS[name]
    with state.lock:
        if state.tried:
            return state.module
        state.tried = True
        spec = state.spec
        reason = _unavailable_reason(spec)
        if reason is not None:
            state.error = reason
            log.warning("op %s not built (%s); using the PyTorch reference path", name, reason)
            return None
        from torch.utils.cpp_extension import load

        log.info("op %s: building or loading from %s (a first build takes a while)", name, build_directory(spec.name))
        try:
            state.module = load(
                name=spec.name,
                sources=[str(CSRC_DIR / s) for s in spec.sources],
                extra_cflags=["-O3", *spec.extra_cflags],
                extra_cuda_cflags=["-O3", *spec.extra_cuda_cflags],
                extra_ldflags=list(spec.extra_ldflags),
                build_directory=str(build_directory(spec.name)),
                verbose=False,
            )
        except Exception as exc:  # a build failure must not stop training: fall back loudly
            state.error = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
            log.warning("op %s not built (%s); using the PyTorch reference path", name, state.error)
            return None
        return state.module


def op_report() -> list[dict[str, str | bool | None]]:
    """One row per registered op: name, whether it needs CUDA, whether built, why not."""
    return [
        {
            "name": s.spec.name,
            "needs_cuda": s.spec.needs_cuda,
            "built": s.module is not None,
            "tried": s.tried,
            "error": s.error,
        }
        for s in _OPS.values()
    ]
