"""Padding-free forwards: the real tokens of several rows packed end to end into one sequence.

    logprobs = packed_logprobs(model, sequences, attention_mask, response_start, budget=4096)
    values = packed_values(value_model, sequences, attention_mask, budget=4096)   # scores: packed_scores

Rows of a rollout batch are [left-padded prompt | response | right padding]; a padded forward
runs every row to the batch's (or micro-batch's) width. Here each row's real tokens (one
contiguous run of columns) are laid end to end into packs of at most `budget` tokens (first fit,
longest rows first), positions restarting at 0 for each row and a block-diagonal causal mask
keeping the rows apart, so a forward runs only real tokens (the fused attention kernel reads such
a mask as one span of keys per query: nothing is computed across rows). The LM head runs only at
the positions that score columns response_start.. . The log-probs are those of the padded
forward up to float rounding (tests/test_packing.py).

Applies to decoder-only models whose positions come from `position_ids` (RoPE: the Llama, Qwen2
and Mistral families); OPT derives positions from the attention mask and GPT-2 checkpoints
differ in how they take a 4D mask, so they keep the padded forward (`packing_unsupported_reason`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rlhf.engine.logprobs import entropy_from_logits_chunked, selective_log_softmax

__all__ = ["MAX_PACK_TOKENS", "PACKED_FAMILIES", "forward_tokens", "pack_rows", "packed_logprobs", "packed_scores", "packed_values",
           "packing_unsupported_reason", "packs_fewer_tokens", "real_spans"]

MAX_PACK_TOKENS = 4096
"""Largest pack the callers ask for: its mask is [N, N] bytes (16 MiB at 4096)."""

PACKED_FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Model types (config.model_type) whose packed forward equals the padded one."""


def packing_unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot run packed forwards, or None when it can."""
    if hasattr(model, "peft_config"):
        return "a LoRA (peft) model: its forward is not checked with packed inputs"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PACKED_FAMILIES:
        return f"model type {model_type!r} is not one of {sorted(PACKED_FAMILIES)}"
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {model.config._attn_implementation!r} takes no 4D boolean mask"
    return None


def packs_fewer_tokens(model: nn.Module, attention_mask: torch.Tensor, padded_tokens: int,
                       one_forward: bool = True) -> bool:
    """A packed forward over these rows applies and pays: the model packs, each row's real tokens
    are one run, fewer than the `padded_tokens` the padded forward would run, and (`one_forward`:
    a trained model's micro-batch is one forward on every rank) at most MAX_PACK_TOKENS of them."""
    if packing_unsupported_reason(model) is not None or real_spans(attention_mask) is None:
        return False
    real = int(attention_mask.sum())
    return forward_tokens(real, padded_tokens, packs=True, one_forward=one_forward) < padded_tokens


def forward_tokens(real: int, padded: int, packs: bool, one_forward: bool = True) -> int:
    """The tokens a forward over rows of `real` real and `padded` padded tokens runs: `real` where
    it runs packed (`packs`: the model packs and the rows' real tokens are runs; fewer than
    `padded`; at most MAX_PACK_TOKENS for `one_forward`), else `padded`."""
    if packs and real < padded and (real <= MAX_PACK_TOKENS or not one_forward):
        return real
    return padded


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


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows into packs whose lengths sum to at most `budget` (a longer row is a pack of its own):
    first fit, longest rows first; rows without tokens are left out."""
    if budget < 1:
        raise ValueError(f"pack budget must be >= 1 token, got {budget}")
    packs: list[list[int]] = []
    room: list[int] = []
    for row in sorted((r for r in range(len(lengths)) if lengths[r] > 0), key=lambda r: -lengths[r]):
        fit = next((i for i, free in enumerate(room) if free >= lengths[row]), None)
        if fit is None:
            packs.append([row])
            room.append(budget - lengths[row])
        else:
            packs[fit].append(row)
            room[fit] -= lengths[row]
    return packs


def _block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[1, 1, N, N] boolean: each position sees the earlier positions of its own row, N = sum(lengths)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device))
    total = segment.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return (causal & (segment[:, None] == segment[None, :]))[None, None]


def _pack_inputs(sequences: torch.Tensor, starts: list[int], lengths: list[int],
                 pack: list[int]) -> dict[str, torch.Tensor]:
    """A pack's forward arguments: its rows' real tokens end to end [1, N], positions restarting at
    0 for each row, and the block-diagonal causal mask [1, 1, N, N]."""
    device = sequences.device
    return {"input_ids": torch.cat([sequences[r, starts[r] : starts[r] + lengths[r]] for r in pack])[None],
            "position_ids": torch.cat([torch.arange(lengths[r], device=device) for r in pack])[None],
            "attention_mask": _block_causal_mask([lengths[r] for r in pack], device)}


def packed_logprobs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_start: int,
                    budget: int, with_entropy: bool = False,
                    columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each next token [B, T-1], position t scoring column t + 1; with `with_entropy`
    the entropy of each of those positions' distributions, else None) of a causal LM from forwards
    over packs of the rows' real tokens (one forward per pack: a budget of at least the rows' real
    tokens is one forward). Positions before response_start - 1, and those that score padding, are
    0. `columns` ([B, T] bool) scores those columns instead (SFT: the supervised ones; a row's first
    real token is never scored). Differentiable. Rows whose real tokens are not contiguous are a
    ValueError (the caller keeps the padded forward for them)."""
    spans = real_spans(attention_mask)
    if spans is None:
        raise ValueError("packed_logprobs: a row's real tokens are not one contiguous run of columns")
    starts, lengths = spans
    batch, width = sequences.shape
    out = torch.zeros(batch, width - 1, dtype=torch.float32, device=sequences.device)
    entropy = torch.zeros_like(out) if with_entropy else None
    for pack in pack_rows(lengths, budget):
        keep, targets, rows, cols = [], [], [], []
        offset = 0
        for row in pack:
            start, n = starts[row], lengths[row]
            # Column j (a real token at or after response_start, not the row's first) is scored by
            # the position before it: pack position offset + (j - 1 - start).
            first = min(max(start + 1, response_start), start + n)
            scored = torch.arange(first, start + n, device=sequences.device)
            if columns is not None:
                scored = torch.arange(start + 1, start + n, device=sequences.device)
                scored = scored[columns[row, start + 1 : start + n]]
            keep.append(offset + scored - 1 - start)
            targets.append(sequences[row, scored])
            rows.append(torch.full_like(scored, row))
            cols.append(scored - 1)
            offset += n
        index = torch.cat(keep)
        scores_nothing = index.numel() == 0
        logits = model(**_pack_inputs(sequences, starts, lengths, pack),
                       logits_to_keep=index.new_zeros(1) if scores_nothing else index, use_cache=False).logits[0]
        if scores_nothing:  # still a forward with a graph, as the padded path's (sharded ranks run as many)
            out = out + 0.0 * logits.float().sum()
            continue
        where = (torch.cat(rows), torch.cat(cols))
        out = out.index_put(where, selective_log_softmax(logits, torch.cat(targets)).float())
        if entropy is not None:
            entropy = entropy.index_put(where, entropy_from_logits_chunked(logits).float())
    return out, entropy


def _value_pack_forwards(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int,
                         caller: str) -> Iterator[tuple[list[int], list[int], list[int], torch.Tensor]]:
    """(pack rows, first real column of every row, real tokens of every row, the value model's
    values [N] over the pack's tokens) for each pack of the rows' real tokens."""
    spans = real_spans(attention_mask)
    if spans is None:
        raise ValueError(f"{caller}: a row's real tokens are not one contiguous run of columns")
    starts, lengths = spans
    for pack in pack_rows(lengths, budget):
        yield pack, starts, lengths, model(**_pack_inputs(sequences, starts, lengths, pack))[0]


def packed_values(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int) -> torch.Tensor:
    """Per-token values [B, T] (float32) of a value model (`ValueModel`: forward(input_ids,
    attention_mask, position_ids) -> [B, T]) from forwards over packs of the rows' real tokens, as
    `packed_logprobs` packs them; positions outside the rows' real tokens are 0 (the padded
    forward's mean nothing). Differentiable; a ValueError where a row's real tokens are not one run."""
    out = torch.zeros(sequences.shape, dtype=torch.float32, device=sequences.device)
    for pack, starts, lengths, values in _value_pack_forwards(model, sequences, attention_mask, budget, "packed_values"):
        rows = torch.cat([torch.full((lengths[r],), r, device=sequences.device) for r in pack])
        cols = torch.cat([torch.arange(starts[r], starts[r] + lengths[r], device=sequences.device) for r in pack])
        out = out.index_put((rows, cols), values.float())
    return out


def packed_scores(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int) -> torch.Tensor:
    """Sequence scores [B] (float32) of a value / reward model, each row's value at its last real
    token (`ValueModel.score`), from forwards over packs of the rows' real tokens. Differentiable;
    a ValueError where a row has no real token or its real tokens are not one run."""
    if bool((attention_mask.sum(dim=1) == 0).any()):
        raise ValueError("packed_scores: a row has no real token to score")
    out = torch.zeros(sequences.shape[0], dtype=torch.float32, device=sequences.device)
    for pack, _, lengths, values in _value_pack_forwards(model, sequences, attention_mask, budget, "packed_scores"):
        last = torch.tensor([lengths[r] for r in pack], device=sequences.device).cumsum(0) - 1
        out = out.index_put((torch.tensor(pack, device=sequences.device),), values[last].float())
    return out
