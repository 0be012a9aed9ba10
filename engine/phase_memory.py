"""Measured peak memory per phase: what every stage logs as `peak_mem_gb_<phase>` (GiB, 2^30 bytes).

    meter = PhaseMemory(ctx.device)
    with meter.phase("generation"):
        ...                                        # every allocation of the block counts
    metrics.update(meter.metrics(ctx.all_reduce_max))   # max over ranks; the window starts again

What a phase's peak is, per device:
- CUDA: `torch.cuda.max_memory_allocated` since `reset_peak_memory_stats` at the phase's start (the
  tensors torch holds), and `peak_mem_reserved_gb_<phase>` from `max_memory_reserved` (what the
  caching allocator took from the driver: the figure an out-of-memory error compares).
- CPU: the process's peak resident set. Linux keeps it as VmHWM in /proc/self/status, and writing
  "5" to /proc/self/clear_refs resets it to the current RSS (Linux 4.0+), so each phase reads its
  own peak at no cost. Where that file is not writable, a thread samples VmRSS every
  `SAMPLE_SECONDS` during the phase instead (a peak shorter than that can be missed); without
  /proc at all, the process's lifetime peak (getrusage) is all there is. Either fallback is said
  once in the log.

RSS counts memory the C allocator keeps after a tensor is freed: the engine's glibc tuning
(engine/backends/cpu/host_memory.py) keeps freed blocks for the next step, so on the CPU a phase's peak includes
what earlier phases freed and the per-phase figures only grow. With `MALLOC_MMAP_THRESHOLD_=65536`
in the environment (glibc then returns every freed tensor at once, and the engine leaves malloc as
it is) RSS follows the live tensors, which is what `rlhf plan` predicts per phase.

`record_baseline()` (called by every stage before it loads anything) keeps the process's memory at
that point: `mem_baseline_gb`, the fixed cost of torch, transformers and the imports (hundreds of
MB of RSS on the CPU, ~0 on a GPU) that the phases' figures include.

Phases may nest (an inner phase's peak counts for the outer one too); a peak is this rank's, and
`metrics` takes the max over ranks where the stage logs (a collective: every rank calls it).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf.engine.backends.registry import backend_for
from rlhf.logging import get_logger

log = get_logger(__name__)

GIB = 2**30
SAMPLE_SECONDS = 0.002
"""VmRSS sampling period of the fallback (no writable /proc/self/clear_refs)."""
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")

_baseline: int | None = None
_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info("%s", message)


def _status_kib(name: str) -> int | None:
    """A `VmXXX:  N kB` field of /proc/self/status in bytes, or None without /proc."""
    try:
        match = re.search(rf"^{name}:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def current_rss() -> int | None:
    """This process's resident set in bytes (None without /proc)."""
    return _status_kib("VmRSS")


def _lifetime_peak_rss() -> int:
    """The process's peak RSS since it started (getrusage; kB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; False where /proc/self/clear_refs cannot be written."""
    try:
        with CLEAR_REFS.open("w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def device_memory(device: torch.device) -> int:
    """Bytes in use now: tensors allocated on a GPU, this process's RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    rss = current_rss()
    return rss if rss is not None else _lifetime_peak_rss()


def record_baseline(device: torch.device | None = None) -> int:
    """Keep (and return) the memory in use now, before the stage loads its models:
    `mem_baseline_gb`. Each stage records its own (e2e runs them in one process)."""
    global _baseline
    _baseline = device_memory(device or torch.device("cpu"))
    return _baseline


def baseline() -> int | None:
    """The bytes `record_baseline` kept, or None before it was called."""
    return _baseline


class _RssSampler:
    """Polls VmRSS on a daemon thread until stopped; `peak` is the largest value seen."""

    def __init__(self) -> None:
        self.peak = current_rss() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlhf-rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, current_rss() or 0)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, current_rss() or 0)


@dataclass
class _Open:
    """A phase being measured: the largest peak seen so far (before an inner phase reset the counter)."""

    name: str
    peak: int = 0
    reserved: int = 0
    sampler: _RssSampler | None = None


@dataclass
class PhaseMemory:
    """Per-phase peaks of this rank, accumulated (max) until `metrics` or `take` reads them."""

    device: torch.device
    peaks: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    _open: list[_Open] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mode = self._mode()

    def _mode(self) -> str:
        """cuda, hwm (VmHWM reset per phase), sample (a VmRSS thread) or lifetime (getrusage)."""
        if self.device.type == "cuda":
            return "cuda"
        if current_rss() is None:
            _say_once("lifetime", "memory: no /proc here, so each phase's peak is the process's peak RSS so far")
            return "lifetime"
        if _reset_hwm():
            note = backend_for(self.device).peak_memory_note()
            if note is not None:
                _say_once("heap", f"memory: {note}")
            return "hwm"
        _say_once("sample", f"memory: {CLEAR_REFS} is not writable, so phase peaks come from sampling VmRSS every "
                            f"{SAMPLE_SECONDS * 1000:g} ms (shorter peaks can be missed)")
        return "sample"

    def _read_and_reset(self) -> tuple[int, int]:
        """(peak, reserved peak) since the last reset, then reset the counters."""
        if self.mode == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak, reserved
        if self.mode == "hwm":
            peak = _status_kib("VmHWM") or 0
            _reset_hwm()
            return peak, peak
        peak = (current_rss() or 0) if self.mode == "sample" else _lifetime_peak_rss()
        return peak, peak

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block's peak as phase `name` (the max over every block of that name until read)."""
        if self._open:  # the enclosing phase keeps what it has seen up to here
            outer = self._open[-1]
            peak, reserved = self._read_and_reset()
            outer.peak, outer.reserved = max(outer.peak, peak), max(outer.reserved, reserved)
        else:
            self._read_and_reset()
        current = _Open(name, sampler=_RssSampler() if self.mode == "sample" else None)
        self._open.append(current)
        try:
            yield
        finally:
            self._open.pop()
            peak, reserved = self._read_and_reset()
            if current.sampler is not None:
                peak = reserved = current.sampler.stop()
            peak, reserved = max(current.peak, peak), max(current.reserved, reserved)
            if self._open:
                outer = self._open[-1]
                outer.peak, outer.reserved = max(outer.peak, peak), max(outer.reserved, reserved)
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            self.reserved[name] = max(self.reserved.get(name, 0), reserved)

    def take(self) -> dict[str, int]:
        """This rank's peak bytes per phase since the last read; the window starts again."""
        peaks = dict(self.peaks)
        self.peaks.clear()
        self.reserved.clear()
        return peaks

    def metrics(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """`peak_mem_gb_<phase>` (and on CUDA `peak_mem_reserved_gb_<phase>`) in GiB, the max over
        ranks with `all_reduce_max` (every rank must call it with the same phases), plus
        `mem_baseline_gb` once recorded; the window starts again."""
        names = sorted(self.peaks)
        values = [self.peaks[n] for n in names]
        keys = [f"peak_mem_gb_{n}" for n in names]
        if self.mode == "cuda":
            values += [self.reserved[n] for n in names]
            keys += [f"peak_mem_reserved_gb_{n}" for n in names]
        if _baseline is not None:
            values.append(_baseline)
            keys.append("mem_baseline_gb")
        self.take()
        if not values:
            return {}
        reduced = torch.tensor(values, dtype=torch.float64)
        if all_reduce_max is not None:
            reduced = all_reduce_max(reduced).cpu()
        return {k: float(v) / GIB for k, v in zip(keys, reduced.tolist())}


__all__ = ["GIB", "PhaseMemory", "baseline", "current_rss", "device_memory", "record_baseline"]
