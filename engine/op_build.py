"""Building one csrc op: where its build lives, the lock around a build, a quiet compile.

    folder = build_folder(spec)            # <root>/torch<version>-cu<cuda>/<name>-<key>/
    module = cached_build(spec, folder)    # the finished build, imported; None before the first build
    with build_lock(folder, spec.name):    # one process builds, the others wait (bounded)
        module = compile_op(spec, folder)  # copies the sources in, compiles, imports

The key is a hash of everything that goes into the library: the content of the op's sources and
of every file they include (`#include "..."`, followed), the compile and link flags, and the
toolchain (torch and CUDA versions, Python ABI, the C++ compiler's and nvcc's version lines, the
CUDA architectures). The sources are copied into the build folder (`src/`) and compiled from
there, so every checkout and every virtual environment with the same sources writes the same
build.ninja and shares one build, while changed sources get another folder and never overwrite a
build in use. A finished build is imported directly (no ninja, no compiler run): the folder's
key says it is current. `root` is RLHF_OPS_CACHE, default ~/.cache/rlhf/ops.

The compiler's output goes to `build.log` in the folder (RLHF_DEBUG=1 shows it instead). The lock
is an flock on `build.lock`, which the kernel releases when its holder dies, so a killed build never
blocks the next one; a waiter gives up after RLHF_OPS_LOCK_TIMEOUT seconds (default 1800) with an
error naming the lock file and its holder's pid.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rlhf.engine.fileio import replace_file
from rlhf.errors import debug_enabled
from rlhf.logging import get_logger

log = get_logger(__name__)


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
    build_seconds: float = 60.0
    """About how long a first build takes (two cores); the first-use log line says so until this
    machine has built the op once and the measured time replaces it."""


CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
"""The op sources: <checkout>/csrc in a source tree or an editable install (engine/ is beside it),
<site-packages>/rlhf/csrc in a wheel (package data of rlhf.csrc, beside rlhf/engine/)."""
KEY_VERSION = "1"
"""Bumped when the folder layout or what the key covers changes."""
MANIFEST = "build.json"
"""Written last by a finished build: the library's file name, the key's inputs, the build's seconds."""
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class LockTimeout(RuntimeError):
    """Another process held an op's build lock for longer than RLHF_OPS_LOCK_TIMEOUT."""


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_OPS_CACHE") or Path.home() / ".cache" / "rlhf" / "ops")


def toolchain_folder() -> Path:
    """The cache's folder for this torch and CUDA version (readable by people; the key decides)."""
    return cache_root() / f"torch{torch.__version__.replace('+', '_')}-cu{torch.version.cuda or 'cpu'}"


def source_files(spec: OpSpec, csrc: Path | None = None) -> list[str]:
    """The op's sources and every file they include with quotes, transitively: paths relative to
    `csrc`, sorted. An include that names no file under `csrc` is left out (a system header)."""
    seen: set[str] = set()
    pending = list(spec.sources)
    root = (csrc or CSRC_DIR).resolve()
    while pending:
        rel = pending.pop()
        if rel in seen:
            continue
        seen.add(rel)
        path = root / rel
        for include in _INCLUDE.findall(path.read_text(errors="replace")):
            target = (path.parent / include).resolve()
            if target.is_file() and target.is_relative_to(root):
                pending.append(target.relative_to(root).as_posix())
    return sorted(seen)


def _first_line(command: list[str], last: bool = False) -> str:
    """The first (or last) line `command` prints; "" when it cannot run."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out[-1] if last else out[0]) if out else ""


@cache
def _compiler_id(compiler: str) -> str:
    return f"{shutil.which(compiler) or compiler}: {_first_line([compiler, '--version'])}"


@cache
def _nvcc_id() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else "nvcc"
    return f"{nvcc}: {_first_line([nvcc, '--version'], last=True)}"


def cuda_archs() -> str:
    """What torch compiles CUDA code for: TORCH_CUDA_ARCH_LIST, else every visible GPU's capability."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if not torch.cuda.is_available():
        return "none"
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))


def key_inputs(spec: OpSpec, csrc: Path | None = None) -> dict[str, Any]:
    """Everything the build depends on, as the key hashes it (sources by content, not by path)."""
    csrc = csrc or CSRC_DIR
    inputs: dict[str, Any] = {
        "key_version": KEY_VERSION,
        "sources": {rel: hashlib.sha256((csrc / rel).read_bytes()).hexdigest() for rel in source_files(spec, csrc)},
        "compiled": list(spec.sources),
        "cflags": compile_flags(spec)["extra_cflags"],
        "ldflags": list(spec.extra_ldflags),
        "torch": f"{torch.__version__} {torch.version.git_version} cuda {torch.version.cuda}",
        "python": f"{sys.implementation.cache_tag} {platform.machine()}",
        "cxx": _compiler_id(os.environ.get("CXX", "c++")),
    }
    if spec.needs_cuda:
        inputs.update(cuda_cflags=compile_flags(spec)["extra_cuda_cflags"], nvcc=_nvcc_id(), cuda_archs=cuda_archs())
    return inputs


def cache_key(spec: OpSpec, csrc: Path | None = None) -> str:
    """16 hex digits of the hash of `key_inputs`: equal inputs, one shared build."""
    return hashlib.sha256(json.dumps(key_inputs(spec, csrc), sort_keys=True).encode()).hexdigest()[:16]


def build_folder(spec: OpSpec, csrc: Path | None = None) -> Path:
    """The op's build folder for these sources, flags and toolchain (created)."""
    path = toolchain_folder() / f"{spec.name}-{cache_key(spec, csrc)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_flags(spec: OpSpec) -> dict[str, list[str]]:
    return {"extra_cflags": ["-O3", *spec.extra_cflags], "extra_cuda_cflags": ["-O3", *spec.extra_cuda_cflags],
            "extra_ldflags": list(spec.extra_ldflags)}


def _import_library(path: Path) -> ModuleType:
    """Import a built extension (its module name is the library's file name without suffix)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and (folder / str(manifest.get("library"))).is_file() else None


def cached_build(folder: Path) -> ModuleType | None:
    """The finished build in `folder`, imported; None when there is none yet."""
    manifest = read_manifest(folder)
    return None if manifest is None else _import_library(folder / manifest["library"])


def expected_seconds(spec: OpSpec) -> float:
    """How long a build of the op took last on this machine (any sources), else the spec's estimate."""
    times = [(m.get("finished", 0), m.get("seconds")) for f in toolchain_folder().glob(f"{spec.name}-*")
             if (m := read_manifest(f)) is not None]
    recorded = [seconds for _, seconds in sorted(times) if isinstance(seconds, (int, float))]
    return recorded[-1] if recorded else spec.build_seconds


# ------------------------------------------------------------------------------------ lock


def _lock_timeout() -> float:
    return float(os.environ.get("RLHF_OPS_LOCK_TIMEOUT", "1800"))


@contextlib.contextmanager
def build_lock(folder: Path, name: str, timeout: float | None = None) -> Iterator[None]:
    """Hold `folder`'s build lock: an flock on build.lock, holding the holder's pid. Waits at most
    `timeout` seconds (RLHF_OPS_LOCK_TIMEOUT) for another process's build, saying once whom it waits
    for; raises LockTimeout naming the file after that. A holder that died holds nothing: the
    kernel drops its flock, so the next process takes the lock at once. Where the file system has
    no flock, builds go ahead unlocked (with an info line)."""
    import fcntl

    timeout = _lock_timeout() if timeout is None else timeout
    path = folder / "build.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = Path(path).read_text().strip() or "unknown"
                if time.monotonic() - start > timeout:
                    raise LockTimeout(f"op {name}: {path} is still locked by pid {holder} (alive: the kernel drops "
                                      f"a dead holder's lock) after {timeout:g} s (RLHF_OPS_LOCK_TIMEOUT); if that "
                                      f"process is stuck, stop it") from None
                if not said:
                    log.info("op %s: waiting for pid %s to finish building it (lock %s)", name, holder, path)
                    said = True
                time.sleep(0.2)
            except OSError as exc:  # no flock here (some network file systems)
                log.info("op %s: cannot lock %s (%s); building without a lock", name, path, exc)
                break
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


# ------------------------------------------------------------------------------------ compile


@contextlib.contextmanager
def _output_to(log_file: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2: the compiler's, ninja's,
    torch's warnings) to `log_file` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log_file.open("w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _build_failure(log_file: Path, error: str) -> str:
    """One line for a failed build: the first compiler error (else the error's last line) and
    where the whole output is (torch puts the compiler's output into the exception: appended to
    the log, after what reached the terminal's file descriptors)."""
    with log_file.open("a") as f:
        f.write(error + "\n")
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or ["unknown error"]
    first = next((line for line in lines if "error:" in line), next((line for line in lines if "error" in line.lower()),
                                                                    lines[-1]))
    return f"{first[:400]} (full output: {log_file})"


def compile_op(spec: OpSpec, folder: Path, csrc: Path | None = None) -> ModuleType:
    """Build `spec` in `folder` from a copy of its sources and import it; call under `build_lock`.
    The compiler's output is in folder/build.log (on the terminal with RLHF_DEBUG=1); a failed
    build raises a RuntimeError of one line: the first compiler error and the log's path."""
    import torch.utils.cpp_extension as cpp_extension

    csrc, src = csrc or CSRC_DIR, folder / "src"
    for rel in source_files(spec, csrc):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(csrc / rel, src / rel)
    # torch < 2.14's own lock (FileBaton) waits forever on a file a killed build left; ours is held now.
    (folder / "lock").unlink(missing_ok=True)
    start = time.perf_counter()
    verbose = debug_enabled()
    output = contextlib.nullcontext() if verbose else _output_to(folder / "build.log")
    try:
        with output:
            module = cpp_extension.load(name=spec.name, sources=[str(src / s) for s in spec.sources],
                                        build_directory=str(folder), verbose=verbose, **compile_flags(spec))
    except Exception as exc:
        raise RuntimeError(_build_failure(folder / "build.log", str(exc))) from exc
    library = Path(getattr(module, "__file__", "") or "")
    if library.parent == folder and library.is_file():  # a real build (a test may hand in a stand-in)
        manifest = {"library": library.name, "seconds": round(time.perf_counter() - start, 1), "finished": time.time(),
                    "inputs": key_inputs(spec, csrc)}
        tmp = folder / f".{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        replace_file(tmp, folder / MANIFEST)
    return module
