"""Decoding a CPU rollout's rows in groups, each group to its end, so that its KV cache and the
weights stay in the last-level cache from one step to the next.

    rows = rows_per_group(batch, weight_bytes, kv_bytes_per_row, last_level_cache_bytes())
    steps = decode_in_groups(decoder, loop, rows)       # each range decoded to its end, the same draws

A decode step reads every weight and each row's whole KV cache once. At the benchmark shape (the
4-layer tiny Llama of scripts/bench_ppo.py, 32 rows, 64-token prompts, 256 new tokens, float16 cache) that is 12.7 MB of packed
weights plus 25 MB of cache on the mean step, more than a 32 MB L3 keeps (a victim L3 of a shared
VM keeps a streamed set of ~16-20 MB), so every step reads both from DRAM. Decoded 8 rows at a
time, a group's step reads 12.7 + 6.3 MB, which mostly stays in the L3 across its steps: on a
Zen 4 EPYC (2 threads, `python scripts/bench_decode_step.py --kv-cache-dtype fp16 --batch B`)
a step of 8 rows costs 0.50 ms at 256 new tokens against 2.6-3.1 ms for 32 rows (0.38 against
1.65-1.97 at 64). The rollout is the same either way: generation.py draws every row's uniforms
from the generator in the order the one-group loop draws them, and the step's packed GEMM (the
only projections the automatic choice groups) computes a row the same way whatever rows share
its step, so the logits are the same bits (over MKL, whose kernels change with the row count, a
requested grouping changes their last bits, as another batch size would).

The group is the largest multiple of 8 rows (the panel GEMM's row block; fewer rows run its
projections slower) whose weights plus mean-length caches take at most half the last-level cache,
else 8 rows where those fit in the cache at all; where even that does not fit (weights larger than
the cache: any model beyond a few million parameters), all rows decode together, as they do off
the CPU step.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import torch

from rlhf.engine.decode_loop import DecodeLoop, Decoder

GROUP_ROW_MULTIPLE = 8
"""Groups are multiples of this many rows: the decode step's panel GEMM takes rows in blocks of 8."""
CACHE_SHARE = 0.5
"""The share of the last-level cache a group's step may read and still find it there next step
(a streamed set larger than ~half a shared VM's L3 starts to miss)."""
_CACHE_INDEX = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(cache_dir: Path = _CACHE_INDEX) -> int | None:
    """The size of CPU 0's largest-level data or unified cache (Linux sysfs), None where unknown;
    this machine's (the default folder) is read once per process, as every rollout asks."""
    return _this_machine_cache_bytes() if cache_dir == _CACHE_INDEX else _read_cache_bytes(cache_dir)


@functools.cache
def _this_machine_cache_bytes() -> int | None:
    return _read_cache_bytes(_CACHE_INDEX)


def _read_cache_bytes(cache_dir: Path) -> int | None:
    best_level, best_size = 0, None
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level > best_level:
            best_level, best_size = level, size
    return best_size


def _parse_size(text: str) -> int:
    """sysfs cache sizes: '32768K', '2M', or bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def rows_per_group(batch: int, weight_bytes: int, kv_bytes_per_row: int, cache_bytes: int | None) -> int:
    """Rows each decode group runs (`batch`: one group).

    `weight_bytes`: what a step reads of the weights; `kv_bytes_per_row`: one row's KV cache at the
    rollout's mean length; `cache_bytes`: the last-level cache (None: unknown, one group)."""
    if batch <= GROUP_ROW_MULTIPLE or cache_bytes is None or cache_bytes <= 0:
        return batch
    if weight_bytes + batch * kv_bytes_per_row <= CACHE_SHARE * cache_bytes:
        return batch  # everything stays in the cache already
    fitting = int((CACHE_SHARE * cache_bytes - weight_bytes) // max(kv_bytes_per_row, 1))
    rows = fitting // GROUP_ROW_MULTIPLE * GROUP_ROW_MULTIPLE
    if rows >= GROUP_ROW_MULTIPLE:
        return min(rows, batch)
    if weight_bytes + GROUP_ROW_MULTIPLE * kv_bytes_per_row <= cache_bytes:
        return GROUP_ROW_MULTIPLE
    return batch


def row_groups(batch: int, rows: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most `rows` rows covering [0, batch), as even as whole rows allow."""
    if rows < 1:
        raise ValueError(f"row_groups: rows per group must be >= 1, got {rows}")
    count = -(-batch // rows)
    bounds = [batch * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class GroupedDecoder(Decoder, Protocol):
    """A decoder whose rows can decode in groups (the CPU decoder)."""

    def row_group(self, start: int, stop: int) -> Decoder:
        """A decoder over rows [start, stop) of this one's cache, at its length."""
        ...


def decode_in_groups(decoder: GroupedDecoder, loop: DecodeLoop, rows: int) -> int:
    """Decode ranges of `rows` rows one after the other, each to its end; -> the steps the one-group
    loop would have run. Every step's uniforms for the whole batch are drawn up front, in the
    order that loop draws them, and the generator is left where that loop leaves it (a draw per
    step it runs), so the tokens and everything sampled afterwards are the same."""
    batch, max_new, device = loop.batch, loop.params.max_new_tokens, loop.transcript.finished.device
    rng = loop.generator if loop.generator is not None else _default_generator(device)
    start_state = rng.get_state()
    uniforms = (torch.rand(max_new, batch, device=device, dtype=torch.float32, generator=loop.generator)
                if loop.params.do_sample else None)
    steps_run = 0
    for start, stop in row_groups(batch, rows):
        group_uniforms = None if uniforms is None else uniforms[:, start:stop]  # sliced once, not every step

        def draws(step: int, group_uniforms: torch.Tensor | None = group_uniforms) -> torch.Tensor | None:
            return None if group_uniforms is None else group_uniforms[step]

        steps_run = max(steps_run, loop.run_rows(decoder.row_group(start, stop), start, stop, draws))
    if uniforms is not None and steps_run < max_new:
        rng.set_state(start_state)
        torch.rand(steps_run * batch, device=device, dtype=torch.float32, generator=loop.generator)
    return steps_run


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator torch.rand draws from on `device` when given none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


__all__ = ["CACHE_SHARE", "GROUP_ROW_MULTIPLE", "decode_in_groups", "last_level_cache_bytes", "row_groups",
           "rows_per_group"]
