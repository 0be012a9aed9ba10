"""glibc malloc tuning for CPU training (engine/backends/cpu/host_memory.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import rlhf.engine.backends.cpu.host_memory as host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tunes_once_and_leaves_a_users_malloc_settings_alone(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "_tuned", False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert host_memory.tune_glibc_malloc() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert host_memory.tune_glibc_malloc() is True  # every mallopt call accepted its value
    assert host_memory.tune_glibc_malloc() is True
    assert host_memory.TRIM_THRESHOLD < 2**31 and host_memory.MMAP_THRESHOLD_MAX < 2**31  # C ints


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_populate_heap_makes_every_heap_page_resident_and_keeps_contents(monkeypatch) -> None:
    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert host_memory.tune_glibc_malloc() is True
    monkeypatch.setattr(host_memory, "_populated_end", 0)
    monkeypatch.setattr(host_memory, "_populate_refused", False)
    kept = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB on the heap (no mmap once tuned), touched
    fresh = torch.empty(16 << 20, dtype=torch.uint8)  # 16 MiB, not touched (in a fresh process: on the heap)
    populated = host_memory.populate_heap()
    if populated == 0:
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux 5.14+)")
    start, end = host_memory.heap_span()
    assert populated == end - start and fresh.numel() == 16 << 20
    assert heap_resident_kib() == populated >> 10  # every page of it, the untouched ones included
    assert torch.equal(kept, torch.arange(1 << 20, dtype=torch.float32))
    assert host_memory.populate_heap() == 0  # nothing new
    grown = torch.empty(host_memory.TOP_PAD + (64 << 20), dtype=torch.uint8)  # more than the heap's top holds
    _, new_end = host_memory.heap_span()  # grown, where the main thread's allocations come from the heap
    assert host_memory.populate_heap() == new_end - end and heap_resident_kib() == (new_end - start) >> 10
    del grown


def test_populate_heap_does_nothing_where_malloc_was_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "_tuned", False)
    monkeypatch.setattr(host_memory, "_populated_end", 0)
    assert host_memory.populate_heap() == 0


def heap_resident_kib() -> int:
    """Rss of the [heap] mapping in /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    heap = next(i for i, line in enumerate(lines) if line.rstrip().endswith("[heap]"))
    return next(int(line.split()[1]) for line in lines[heap + 1:] if line.startswith("Rss:"))
