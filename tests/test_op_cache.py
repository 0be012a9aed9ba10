"""The op build cache (engine/op_build.py): keyed by sources, flags and toolchain; the build lock.

Two copies of the same sources (two checkouts, two venvs) share one build; changed sources (an
included header too) or flags get their own folder and never overwrite a build in use; a cached
build loads without the compiler; a stale lock never blocks. The builds here are of a tiny
pybind11-only op (a few seconds), through the real key and the real compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf.engine import op_build, ops
from rlhf.engine.op_build import LockTimeout, build_folder, build_lock, cache_key, cached_build, source_files
from rlhf.engine.ops import OpSpec

REPO = Path(__file__).resolve().parent.parent
TINY = OpSpec("rlhf_test_tiny_op", sources=("tiny/tiny.cpp",), build_seconds=5.0)

TINY_CPP = """#include <pybind11/pybind11.h>
#include "tiny.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return ANSWER; }); }
"""


def _sources(root: Path, answer: int = 42) -> Path:
    """A csrc folder holding the tiny op: tiny/tiny.cpp including tiny/tiny.h (ANSWER)."""
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "tiny.cpp").write_text(TINY_CPP)
    (root / "tiny" / "tiny.h").write_text(f"#define ANSWER {answer}\n")
    return root


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("RLHF_OPS_CACHE", str(tmp_path / "ops"))
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    return tmp_path / "ops"


@pytest.fixture
def compiler() -> None:
    if ops.unavailable_reason(TINY) is not None:
        pytest.skip(f"cannot build ops here: {ops.unavailable_reason(TINY)}")


def test_the_key_follows_content_headers_and_flags_not_paths(cache: Path, tmp_path: Path) -> None:
    a, b = _sources(tmp_path / "a"), _sources(tmp_path / "b")
    assert source_files(TINY, a) == ["tiny/tiny.cpp", "tiny/tiny.h"]
    assert cache_key(TINY, a) == cache_key(TINY, b)  # two checkouts, one key
    (b / "tiny" / "tiny.h").write_text("#define ANSWER 43\n")  # only an included header changed
    assert cache_key(TINY, a) != cache_key(TINY, b)
    flagged = OpSpec(TINY.name, TINY.sources, extra_cflags=("-DEXTRA",))
    assert cache_key(flagged, a) != cache_key(TINY, a)
    # The real ops: their key covers what their sources include from csrc/common.
    from rlhf.engine.fused_adam import CPU_OP

    assert "common/cpu_features.h" in source_files(ops._OPS[CPU_OP].spec)


def test_same_sources_share_one_build_and_changed_ones_do_not_collide(
    cache: Path, tmp_path: Path, compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = _sources(tmp_path / "a"), _sources(tmp_path / "b"), _sources(tmp_path / "c", answer=43)
    folder = build_folder(TINY, a)
    # A lock file left by a killed build: torch < 2.14's FileBaton would wait on it forever (2.14's
    # flock-based FileLock keeps the file by design), so the build must go ahead regardless.
    (folder / "lock").write_text("")
    with build_lock(folder, TINY.name):
        assert op_build.compile_op(TINY, folder, a).answer() == 42
    assert (folder / "build.log").is_file()

    # Another checkout with the same sources: the same folder, loaded without any compiler run.
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: pytest.fail("a shared build was rebuilt"))
    assert build_folder(TINY, b) == folder
    assert cached_build(folder).answer() == 42
    monkeypatch.undo()
    monkeypatch.setenv("RLHF_OPS_CACHE", str(cache))

    # Changed sources: a folder of their own; the first build is still there, unchanged.
    other = build_folder(TINY, c)
    assert other != folder and cached_build(other) is None
    with build_lock(other, TINY.name):
        assert op_build.compile_op(TINY, other, c).answer() == 43
    assert cached_build(folder).answer() == 42 and cached_build(other).answer() == 43


def test_load_op_says_once_that_it_builds_then_loads_quietly(
    cache: Path, tmp_path: Path, compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(op_build, "CSRC_DIR", _sources(tmp_path / "csrc"))
    monkeypatch.setitem(ops._OPS, TINY.name, ops._OpState(TINY))
    monkeypatch.setattr(ops, "_check_build", lambda state: None)  # the tiny op has no self-test
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("rlhf").addHandler(handler)
    try:
        assert ops.load_op(TINY.name).answer() == 42
        first = [r.getMessage() for r in records]
        records.clear()
        monkeypatch.setitem(ops._OPS, TINY.name, ops._OpState(TINY))  # a later process
        assert ops.load_op(TINY.name).answer() == 42
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    assert first == [f"building op {TINY.name} for this machine (first use, ~5 s)..."]
    assert records == []
    assert ops._OPS[TINY.name].built_seconds is None  # found in the cache


_HOLDER = ("import sys, time; from pathlib import Path; from rlhf.engine.op_build import build_lock\n"
           "with build_lock(Path(sys.argv[1]), 'held'):\n    print('held', flush=True); time.sleep(120)\n")


@contextlib.contextmanager
def _holding(folder: Path) -> Iterator[subprocess.Popen]:
    """Another process holding `folder`'s build lock (its pid recorded) for the block, unless killed."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[subprocess.Popen]:
    with _holding(tmp_path) as holder:
        yield holder


def test_a_held_lock_is_waited_for_a_bounded_time_and_named(tmp_path: Path, held_lock: subprocess.Popen) -> None:
    start = time.monotonic()
    with pytest.raises(LockTimeout) as caught:
        with build_lock(tmp_path, "rlhf_x", timeout=0.5):
            pytest.fail("took a lock another process holds")
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert str(tmp_path / "build.lock") in message and f"pid {held_lock.pid}" in message


def test_the_lock_of_a_killed_holder_is_taken_at_once(tmp_path: Path, held_lock: subprocess.Popen) -> None:
    os.kill(held_lock.pid, signal.SIGKILL)
    held_lock.wait()
    assert (tmp_path / "build.lock").read_text().strip() == str(held_lock.pid)  # the file stays behind
    start = time.monotonic()
    with build_lock(tmp_path, "rlhf_x", timeout=5):
        assert (tmp_path / "build.lock").read_text().strip() == str(os.getpid())
    assert time.monotonic() - start < 1


def test_a_lock_timeout_falls_back_with_one_warning(
    cache: Path, tmp_path: Path, compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(op_build, "CSRC_DIR", _sources(tmp_path / "csrc"))
    monkeypatch.setitem(ops._OPS, TINY.name, ops._OpState(TINY))
    monkeypatch.setenv("RLHF_OPS_LOCK_TIMEOUT", "0.3")
    with _holding(build_folder(TINY)):
        assert ops.load_op(TINY.name) is None
    error = ops._OPS[TINY.name].error
    assert "build.lock" in error and "RLHF_OPS_LOCK_TIMEOUT" in error


def test_a_failed_build_is_one_warning_and_the_compiler_output_stays_in_the_log(
    cache: Path, tmp_path: Path, compiler: None, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    csrc = _sources(tmp_path / "csrc")
    (csrc / "tiny" / "tiny.h").write_text("#define ANSWER not_a_number\n")
    monkeypatch.setattr(op_build, "CSRC_DIR", csrc)
    monkeypatch.setitem(ops._OPS, TINY.name, ops._OpState(TINY))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("rlhf").addHandler(handler)
    try:
        assert ops.load_op(TINY.name) is None
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    (warning,) = [r.getMessage() for r in records]
    log_file = build_folder(TINY) / "build.log"
    assert "not_a_number" in warning and "error" in warning and str(log_file) in warning
    assert "PyTorch reference path" in warning
    assert "not_a_number" in log_file.read_text()
    terminal = capfd.readouterr()
    assert "not_a_number" not in terminal.out + terminal.err and "ninja" not in terminal.out + terminal.err
