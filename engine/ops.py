"""Loaders for the csrc custom ops: JIT-built on first use, cached, self-tested, with a torch fallback.

Each op is registered with an `OpSpec`. `load_op(name)` returns its extension module: the build
in the op cache that matches its sources, flags and toolchain (engine/op_build.py: the key, the
folder, the lock), imported without running the compiler, or, on first use on a machine, a build
made now with torch.utils.cpp_extension (ninja), announced by one log line ("building op X for
this machine (first use, ~N s)...") and with the compiler's output in the folder's build.log.
When no compiler (or no GPU for a CUDA op) is available, or the build fails, it logs one warning
and returns None so the caller takes its PyTorch reference path. `rlhf report --build` builds
every op ahead of time (rlhf/report.py's `build_ops`).

A build that loads is not trusted yet: the first time a build is loaded for a device, its
self-test (registered with the op: `register_op(spec, self_test)`; engine/op_selftests.py) runs it
against its PyTorch reference on small inputs. A
mismatch (or an error the op raises) disables the op for the run, with one warning naming the
op, the device and the difference, and the torch path is used. The verdict is cached beside the
build (`selftest.json`, keyed by device and by the build's hash), so later processes on that
device read it instead of testing again. `RLHF_OPS_SELFTEST=0` skips the self-tests.
`op_report()` is what `rlhf report` prints, with every device's cached verdict.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from rlhf.engine.fileio import replace_file
from rlhf.engine.op_build import (
    CSRC_DIR,
    OpSpec,
    LockTimeout,
    build_lock,
    cached_build,
    compile_op,
    cuda_archs,
    expected_seconds,
    toolchain_folder,
)
from rlhf.engine.op_build import build_folder as _build_folder
from rlhf.engine.op_selftests import SelfTest
from rlhf.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class SelfTestVerdict:
    """The outcome of one op build's self-test on one device."""

    device: str
    """What it ran on: `device_description` (CPU model, or GPU name and compute capability)."""
    build: str
    """Hash of the built library: a rebuild is tested again."""
    passed: bool
    detail: str
    """The self-test's summary (max difference), or what differed or failed."""
    seconds: float


@dataclass
class _OpState:
    spec: OpSpec
    module: ModuleType | None = None
    tried: bool = False
    error: str | None = None
    verdict: SelfTestVerdict | None = None
    """This process's verdict (run now or read from the cache); None when not checked."""
    built_seconds: float | None = None
    """How long this process spent compiling the op; None when it found the build in the cache."""
    folder: Path | None = None
    """The op's build folder (None when it was not looked for)."""
    self_test: SelfTest | None = None
    """What a fresh build must pass before it is used (None: not registered yet, the build is used untested)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


_OPS: dict[str, _OpState] = {}


def register_op(spec: OpSpec, self_test: SelfTest | None = None) -> None:
    """Make `spec` known to `load_op` and `op_report`, with the self-test a build must pass (or
    `register_self_test` later, where the test needs code that imports the op); registering the same
    name twice is a no-op."""
    if spec.name not in _OPS:
        _OPS[spec.name] = _OpState(spec)
    if self_test is not None:
        register_self_test(spec.name, self_test)


def register_self_test(name: str, self_test: SelfTest) -> None:
    """The self-test of registered op `name` (run on each fresh build before it is used)."""
    _OPS[name].self_test = self_test


def self_tests() -> dict[str, SelfTest | None]:
    """Every registered op's self-test, by op name (None where none is registered)."""
    return {name: state.self_test for name, state in _OPS.items()}


def build_directory(name: str) -> Path:
    """The cache folder of op `name` for the current sources, flags and toolchain
    (engine/op_build.py); another name gets a plain folder of the cache (for a test's own build)."""
    if name in _OPS:
        return _build_folder(_OPS[name].spec)
    path = toolchain_folder() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ahead_of_time_cuda() -> bool:
    """A CUDA op may be built here without a GPU (for an image that runs on one): TORCH_CUDA_ARCH_LIST
    says for which GPUs, and the torch build has CUDA."""
    return bool(os.environ.get("TORCH_CUDA_ARCH_LIST")) and torch.version.cuda is not None


def unavailable_reason(spec: OpSpec, ahead_of_time: bool = False) -> str | None:
    """Why `spec` cannot be built here (no compiler, no GPU, ops turned off), or None."""
    if os.environ.get("RLHF_DISABLE_OPS") == "1":
        return "RLHF_DISABLE_OPS=1"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    if spec.needs_cuda:
        if not torch.cuda.is_available() and not (ahead_of_time and _ahead_of_time_cuda()):
            return "no CUDA device"
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return "CUDA_HOME not found (nvcc missing)"
    return None


def _one_line(exc: BaseException) -> str:
    """The last line of an exception's message (a build failure's is one line), or its type."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _obtain_build(state: _OpState) -> ModuleType:
    """The op's build from the cache, or built now (under the folder's lock, announced once)."""
    spec = state.spec
    folder = state.folder = _build_folder(spec)
    module = cached_build(folder)
    if module is not None:
        return module
    with build_lock(folder, spec.name):
        module = cached_build(folder)  # another process may have built it while this one waited
        if module is not None:
            return module
        log.info("building op %s for this machine (first use, ~%.0f s)...", spec.name, expected_seconds(spec))
        start = time.perf_counter()
        module = compile_op(spec, folder)
        state.built_seconds = time.perf_counter() - start
        log.debug("op %s: built in %.1f s in %s", spec.name, state.built_seconds, folder)
        return module


def load_op(name: str, ahead_of_time: bool = False) -> ModuleType | None:
    """The built extension module for op `name`, or None (with one warning) if it cannot be built.
    `ahead_of_time`: `rlhf report --build`, where a CUDA op may build without a GPU (see
    `_ahead_of_time_cuda`; its self-test waits for a process on the GPU)."""
    state = _OPS[name]
    with state.lock:
        if state.tried:
            return state.module
        state.tried = True
        spec = state.spec
        reason = unavailable_reason(spec, ahead_of_time)
        if reason is not None:
            state.error = reason
            log.warning("op %s not built (%s); using the PyTorch reference path", name, reason)
            return None
        try:
            state.module = _obtain_build(state)
        except LockTimeout as exc:
            state.error = str(exc)
            log.warning("op %s not built (%s); using the PyTorch reference path", name, exc)
            return None
        except Exception as exc:  # a build failure must not stop training: fall back loudly
            state.error = f"build failed: {_one_line(exc)}"
            log.warning("op %s not built (%s); using the PyTorch reference path", name, state.error)
            return None
        if spec.needs_cuda and not torch.cuda.is_available():
            return state.module  # built ahead of time: tested where it first runs on a GPU
        _check_build(state)
        return state.module


# ------------------------------------------------------------------------------ self-tests


def self_test_enabled() -> bool:
    """False when RLHF_OPS_SELFTEST=0 asks to trust builds without checking them."""
    return os.environ.get("RLHF_OPS_SELFTEST", "1") != "0"


def cpuinfo_field(name: str) -> str:
    """The first `name` field of /proc/cpuinfo ("model name", "vendor_id", ...); "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def op_device(spec: OpSpec) -> torch.device:
    """The device a build of `spec` runs on in this process (the current GPU for a CUDA op)."""
    return torch.device("cuda", torch.cuda.current_device()) if spec.needs_cuda else torch.device("cpu")


def device_description(device: torch.device) -> str:
    """The verdict cache's key for a device: a verdict holds for every device of that model."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda {props.name} sm_{props.major}{props.minor}"
    return f"cpu {_cpu_model()}"


def build_hash(module: ModuleType) -> str:
    """Hash of the module's shared library (16 hex digits), or "unknown" when it has no file."""
    path = getattr(module, "__file__", None)
    if not path or not Path(path).is_file():
        return "unknown"
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def verdict_file(name: str) -> Path:
    """Where an op's self-test verdicts are cached: beside its build."""
    folder = _OPS[name].folder if name in _OPS else None
    return (folder or build_directory(name)) / "selftest.json"


def cached_verdicts(name: str) -> list[SelfTestVerdict]:
    """Every verdict cached for op `name` (one per device model), for `rlhf report`."""
    try:
        rows = json.loads(verdict_file(name).read_text())
        return [SelfTestVerdict(**row) for row in rows.values()]
    except (OSError, ValueError, TypeError):
        return []


def _store_verdict(name: str, verdict: SelfTestVerdict) -> None:
    """Add `verdict` to the cache file, atomically (ranks of one job may write at once)."""
    path = verdict_file(name)
    rows = {v.device: asdict(v) for v in cached_verdicts(name)}
    rows[verdict.device] = asdict(verdict)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(rows, indent=1, sort_keys=True))
        replace_file(tmp, path)
    except OSError as exc:  # a read-only cache only costs the next process a re-test
        log.info("op %s: could not cache its self-test verdict in %s (%s)", name, path, exc)


def run_self_test(name: str, module: ModuleType, device: torch.device) -> SelfTestVerdict:
    """Run op `name`'s self-test on `module` now (own RNG state, no autograd); never raises."""
    test = _OPS[name].self_test
    if test is None:
        raise KeyError(f"op {name} has no registered self-test")
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            detail, passed = test(module, device), True
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous kernel fault surfaces here
    except Exception as exc:  # a wrong or crashing op is exactly what this catches
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        detail, passed = f"{type(exc).__name__}: {first_line[:300]}", False
    return SelfTestVerdict(device_description(device), build_hash(module), passed, detail,
                           round(time.perf_counter() - start, 4))


def _check_build(state: _OpState) -> None:
    """Give `state`'s freshly loaded build its verdict for this device (cached or run now);
    a failing build is dropped, so callers take the torch path."""
    spec, module = state.spec, state.module
    if module is None or not self_test_enabled() or state.self_test is None:
        return
    device = op_device(spec)
    key, build = device_description(device), build_hash(module)
    cached = [v for v in cached_verdicts(spec.name) if v.device == key and v.build == build and build != "unknown"]
    verdict = cached[0] if cached else run_self_test(spec.name, module, device)
    if not cached:
        _store_verdict(spec.name, verdict)
        log.debug("op %s: self-test on %s %s in %.3f s (%s)", spec.name, key, "passed" if verdict.passed else "FAILED",
                  verdict.seconds, verdict.detail)
    state.verdict = verdict
    if not verdict.passed:
        state.module = None
        state.error = f"self-test failed on {key}: {verdict.detail}"
        log.warning("op %s disabled on %s: its self-test against the PyTorch reference failed (%s); using the "
                    "PyTorch reference path", spec.name, key, verdict.detail)


def op_report() -> list[dict[str, object]]:
    """One row per registered op: name, whether it needs CUDA, whether built (and passed its
    self-test), why not, this process's verdict, every device's cached verdict, the seconds this
    process spent building it (None: found in the cache) and its build folder."""
    return [
        {
            "name": s.spec.name,
            "needs_cuda": s.spec.needs_cuda,
            "built": s.module is not None,
            "tried": s.tried,
            "error": s.error,
            "verdict": s.verdict,
            "cached_verdicts": cached_verdicts(s.spec.name),
            "built_seconds": s.built_seconds,
            "folder": s.folder,
        }
        for s in _OPS.values()
    ]


def registered_ops() -> list[OpSpec]:
    """Every op registered so far (the modules that define ops register them on import)."""
    return [s.spec for s in _OPS.values()]
