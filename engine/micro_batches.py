"""Micro-batches of the batched forwards without the padding they can drop.

A rollout batch is as wide as its longest prompt plus its longest response; responses that stop
at EOS early leave most of that width padding. A causal model's outputs at a column do not depend
on later columns, and left-padding columns are masked out (positions come from the mask), so a
micro-batch can drop the columns that are padding in all of its rows and give the same results.
For inference-only forwards (reference, reward, critic values, old log-probs) the rows are first
sorted by length, so each micro-batch holds rows of similar length and drops the most; the
number of micro-batches stays ceil(rows / size), the same on every rank (FSDP's collectives run
once per forward on each rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["MAX_PACK_TOKENS", "budget_partition", "column_span", "forward_in_micro_batches", "forward_tokens",
           "length_sorted_micro_batches", "micro_batch_weights", "padded_tokens", "real_spans",
           "token_budget_micro_batches"]

MAX_PACK_TOKENS = 4096
"""Most tokens one packed forward runs (engine/packing.py): its mask is [N, N] bytes (16 MiB at 4096)."""


def column_span(attention_mask: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the columns holding a real token in some row (the whole width when none does)."""
    used = attention_mask.bool().any(dim=0).nonzero()
    if used.numel() == 0:
        return 0, attention_mask.shape[1]
    return int(used[0]), int(used[-1]) + 1


def length_sorted_micro_batches(attention_mask: torch.Tensor, size: int, sort: bool = True) -> list[torch.Tensor]:
    """Row indices of ceil(rows / size) micro-batches of at most `size` rows; with `sort`, rows
    ordered by their real length (stable), else in order."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    rows = attention_mask.shape[0]
    order = (torch.argsort(attention_mask.sum(dim=-1), stable=True) if sort
             else torch.arange(rows, device=attention_mask.device))
    return [order[i : i + size] for i in range(0, rows, size)]


def forward_in_micro_batches(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], sequences: torch.Tensor,
                             attention_mask: torch.Tensor, size: int, sort: bool = True) -> torch.Tensor:
    """fn over micro-batches with their all-padding columns dropped, reassembled in row order.

    fn(sequences, attention_mask, lo) gets a micro-batch's columns lo..hi-1 and returns either
    [b] (one value per row) or [b, w] whose column j is the trimmed input's column j (w = hi - lo,
    values) or j + 1 of ... up to w - 1 (log-probs: [b, hi - lo - 1], position j scoring the next
    column). The result is [B] or [B, T - (hi - lo - w)] with 0 in the dropped columns.
    """
    batch, width = sequences.shape
    out: torch.Tensor | None = None
    for rows in length_sorted_micro_batches(attention_mask, size, sort):
        seq, mask = sequences[rows], attention_mask[rows]
        lo, hi = column_span(mask)
        part = fn(seq[:, lo:hi], mask[:, lo:hi], lo)
        if out is None:
            shape = (batch,) if part.dim() == 1 else (batch, width - (hi - lo - part.shape[1]))
            out = torch.zeros(shape, dtype=part.dtype, device=part.device)
        if part.dim() == 1:
            out[rows] = part
        else:
            out[rows, lo : lo + part.shape[1]] = part
    assert out is not None
    return out


def real_spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(first real column, number of real tokens) of each row, or None when some row's real tokens
    are not one contiguous run of columns."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    starts = torch.where(lengths > 0, real.int().argmax(dim=1), torch.zeros_like(lengths))
    columns = torch.arange(real.shape[1], device=real.device)
    inside = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    if not torch.equal(inside, real):
        return None
    return starts.tolist(), lengths.tolist()


def forward_tokens(real: int, padded: int, packs: bool, one_forward: bool = True) -> int:
    """The tokens a forward over rows of `real` real and `padded` padded tokens runs: `real` where
    it runs packed (`packs`: the model packs and the rows' real tokens are runs; fewer than
    `padded`; at most MAX_PACK_TOKENS for `one_forward`), else `padded`."""
    if packs and real < padded and (real <= MAX_PACK_TOKENS or not one_forward):
        return real
    return padded


def padded_tokens(attention_mask: torch.Tensor) -> int:
    """What a forward over these rows costs: rows x the width of their non-padding columns."""
    lo, hi = column_span(attention_mask)
    return attention_mask.shape[0] * (hi - lo)


def budget_partition(order: list[int], cost: Callable[[list[int]], int], budget: int,
                     at_least: int = 1) -> list[list[int]]:
    """Consecutive runs of `order` whose cost (e.g. padded tokens) stays within `budget`; an item
    over the budget alone is a run of its own. Runs are halved (the costliest first) until there
    are `at_least` of them, so that every rank can run the same number of forwards."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    if at_least > len(order):
        raise ValueError(f"cannot make {at_least} micro-batches of {len(order)} rows")
    parts: list[list[int]] = []
    current: list[int] = []
    for item in order:
        if current and cost(current + [item]) > budget:
            parts.append(current)
            current = []
        current.append(item)
    if current:
        parts.append(current)
    while len(parts) < at_least:
        largest = max(range(len(parts)), key=lambda i: (len(parts[i]) > 1, cost(parts[i])))
        items = parts.pop(largest)
        parts[largest:largest] = [items[: len(items) // 2], items[len(items) // 2 :]]
    return parts


def token_budget_micro_batches(attention_mask: torch.Tensor, budget: int, at_least: int = 1) -> list[torch.Tensor]:
    """Row indices of micro-batches of rows of similar length (sorted, longest first) whose padded
    size (rows x trimmed width) stays within `budget` tokens (DeepSpeed's / verl's dynamic batch
    size), at least `at_least` of them (`budget_partition`). Packed forwards: `packed_micro_batches`."""
    order = torch.argsort(attention_mask.sum(dim=-1), descending=True, stable=True).tolist()
    parts = budget_partition(order, lambda rows: padded_tokens(attention_mask[rows]), budget, at_least)
    return [torch.tensor(p, dtype=torch.long, device=attention_mask.device) for p in parts]


def micro_batch_weights(counts: list[float], global_count: float, world_size: int) -> list[float]:
    """Loss weights that make a step's gradient independent of how its rows are cut into
    micro-batches and ranks: micro-batch k's mean (over its `counts[k]` tokens, or rows for a
    sequence-level mean) is weighted by its share of the global minibatch's `global_count`, times
    the number of micro-batches (the engine divides by it) and the world size (FSDP averages over
    ranks). The sum of the weighted means is then the mean over the whole minibatch."""
    n = len(counts)
    return [n * world_size * c / global_count if global_count > 0 else 0.0 for c in counts]
