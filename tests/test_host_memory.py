"""glibc malloc tuning for CPU training (engine/host_memory.py)."""

from __future__ import annotations

import sys

import pytest

import rlhf.engine.host_memory as host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tunes_once_and_leaves_a_users_malloc_settings_alone(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "_tuned", False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert host_memory.tune_glibc_malloc() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    for name in [k for k in __import__("os").environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert host_memory.tune_glibc_malloc() is True  # every mallopt call accepted its value
    assert host_memory.tune_glibc_malloc() is True
    assert host_memory.TRIM_THRESHOLD < 2**31 and host_memory.MMAP_THRESHOLD_MAX < 2**31  # C ints
