"""glibc malloc settings for training on the CPU.

Every step allocates and frees the same large tensors (activations, logits over the vocabulary,
gradients, FSDP2's reduce-scatter buffers). glibc serves blocks above its mmap threshold with a
fresh mmap and returns them to the kernel on free, so each step faults their pages in again and
the kernel zeroes them: on SmolLM2-135M PPO (2 cores) that was a third of the process's time in
the kernel (an embedding-sized gradient copy took 240 ms, a 14 MB concatenation 20 ms). Serving
every block from the heap (no mmap: M_MMAP_MAX 0; glibc still falls back to mmap when the heap
cannot grow) with a high trim threshold keeps freed blocks for the next step. Measured there
(training phase, 2 timed iterations): 8.4-8.6 s as glibc comes, 7.1-7.3 s with this set when the
engine starts, 6.4-6.5 s when set before Python allocates anything (`MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=2147483647` in the environment); no change on a tiny model whose tensors
are small. Memory stays mapped at its peak instead of being returned
between steps (up to 2 GiB of free heap top is kept). A
MALLOC_* variable in the environment (the user's own tuning, read by glibc at start) leaves
everything as it is.

`populate_heap()`, called after every step of a stage (PPO: at the end of every iteration's
training phase, whose time and peak memory it counts in), faults in at once
the heap pages reserved but never touched: the whole heap the first time, then what it grew by
since (Linux 5.14+'s MADV_POPULATE_WRITE). The heap reaches about its size in the first step, but
later steps land their tensors on pages of it the first did not touch: on the 4-layer tiny Llama
of scripts/bench_ppo.py at 256 new tokens, PPO iterations 2-5 took 4-15 thousand page faults each (10-100 ms of a 2 s
iteration in the kernel, one trap per 4 KiB page) and none after; populated, iteration 2 on
takes none, for one 70 ms call after the first (~4 us a page against ~13 us a trap) and ~70 MB
more resident at once. A heap that grows later costs one more trap per page only in the step
it grows in (on SmolLM2-135M PPO it grows through iteration 2, so there it changes nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time

from rlhf.logging import get_logger

log = get_logger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
PROC_MAPS = "/proc/self/maps"
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # the largest a C int (mallopt's argument) holds
TOP_PAD = 256 * 2**20

_tuned = False
_libc: ctypes.CDLL | None = None
_populated_end = 0
_populate_refused = False


def tune_glibc_malloc() -> bool:
    """Set the thresholds above once per process (Linux glibc only); True when they are set."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    global _libc
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    _libc = libc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    libc.sbrk.argtypes, libc.sbrk.restype = [ctypes.c_ssize_t], ctypes.c_size_t
    _tuned = all(mallopt(option, value) == 1 for option, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
    log.debug("glibc malloc thresholds %s", "set" if _tuned else "not set")
    return _tuned


def heap_span() -> tuple[int, int] | None:
    """[start, end) of the process's brk heap (glibc's main arena), from /proc/self/maps."""
    try:
        with open(PROC_MAPS) as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    start, end = (int(x, 16) for x in line.split()[0].split("-"))
                    return start, end
    except OSError:
        return None
    return None


def _heap_end() -> int:
    """The heap's end as /proc/self/maps shows it: the program break (sbrk(0)) rounded up to a page."""
    assert _libc is not None
    page = os.sysconf("SC_PAGE_SIZE")
    return (_libc.sbrk(0) + page - 1) // page * page


def populate_heap() -> int:
    """Fault in the heap's pages not yet resident (see the module docstring): the bytes of the
    heap it covered (0: nothing new, or the malloc settings are not this module's, or the kernel
    cannot)."""
    global _populated_end, _populate_refused
    if not _tuned or _populate_refused:
        return 0
    if _heap_end() == _populated_end:
        return 0  # the heap has not moved: no /proc/self/maps read (a PPO iteration on a tiny model is ~15 ms)
    span = heap_span()
    if span is None:
        return 0
    _populated_end = min(_populated_end, span[1])  # a trimmed heap's pages above its end went back
    if span[1] == _populated_end:
        return 0
    start = max(span[0], _populated_end)
    started = time.perf_counter()
    if _libc.madvise(start, span[1] - start, MADV_POPULATE_WRITE) != 0:
        log.debug("MADV_POPULATE_WRITE refused (kernel before 5.14?): heap pages fault in as touched")
        _populate_refused = True
        return 0
    _populated_end = span[1]
    log.debug("heap populated: %d MiB in %.1f ms", (span[1] - start) >> 20, (time.perf_counter() - started) * 1e3)
    return span[1] - start


__all__ = ["heap_span", "populate_heap", "tune_glibc_malloc"]
