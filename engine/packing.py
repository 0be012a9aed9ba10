"""Padding-free forwards: the real tokens of several rows packed end to end into one sequence.

    logprobs = packed_logprobs(model, sequences, attention_mask, response_start, budget=4096)
    logprobs = packed_logprobs(model, ..., shared_prefix=response_start)   # sampled groups' prompts shared
    values = packed_values(value_model, sequences, attention_mask, budget=4096)   # scores: packed_scores

Rows of a rollout batch are [left-padded prompt | response | right padding]; a padded forward
runs every row to the batch's (or micro-batch's) width. Here each row's real tokens (one
contiguous run of columns) are laid end to end into packs of at most `budget` tokens (first fit,
longest first), positions restarting at 0 for each row and a mask keeping the rows apart, so a
forward runs only real tokens. The LM head runs only at the positions that score columns
response_start.. . The log-probs are those of the padded forward up to float rounding
(tests/test_packing.py).

Rows of a sampled group (the same first `shared_prefix` columns: one prompt) are packed as one
unit that runs their prompt once: [prompt | response 1 | response 2 | ...]. The mask follows each
token's own row: a prompt token sees the prompt up to itself, a response token the prompt and its
own response up to itself. The fused attention kernels read such a row as two runs of keys and
skip the whole score tiles between them that no query of a block sees (the other responses), so
nothing is computed across rows. The prompt's last position scores every response's first token.

Applies to decoder-only models whose positions come from `position_ids` (RoPE: the Llama, Qwen2
and Mistral families) and whose attention is the fused CPU kernels (float32, --fused-layers), the
ones that skip what a pack's mask hides: SDPA (a GPU, bf16, --compile) would compute every pair
of the [N, N] mask, more than the padding saved. OPT derives positions from the attention mask
and GPT-2 checkpoints differ in how they take a 4D mask. The others keep the padded forward
(`packing_unsupported_reason` says why; `log_packing` logs it once per run).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rlhf.engine.backends.registry import backend_for
from rlhf.engine.logprobs import entropy_from_logits_chunked, selective_log_softmax
from rlhf.engine.micro_batches import (
    MAX_PACK_TOKENS, budget_partition, forward_tokens, padded_tokens, real_spans, token_budget_micro_batches,
)
from rlhf.engine.prompt_sharing import prompt_groups
from rlhf.logging import get_logger

log = get_logger(__name__)

__all__ = ["MAX_PACK_TOKENS", "PACKED_FAMILIES", "log_packing", "pack_rows", "pack_units", "packed_logprobs",
           "packed_micro_batches", "packed_scores", "packed_tokens", "packed_values", "packing_unsupported_reason",
           "packs_fewer_tokens"]

PACKED_FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Model types (config.model_type) whose packed forward equals the padded one."""


def packing_unsupported_reason(model: nn.Module, device: torch.device | None = None) -> str | None:
    """Why `model` cannot run packed forwards (computing on `device` when given: with offload its
    weights live on the CPU while it computes elsewhere), or None when it can."""
    device = device or next(model.parameters()).device
    backend = backend_for(device)
    if hasattr(model, "peft_config"):
        return "a LoRA (peft) model: its forward is not checked with packed inputs"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PACKED_FAMILIES:
        return f"model type {model_type!r} is not one of {sorted(PACKED_FAMILIES)}"
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {model.config._attn_implementation!r} takes no 4D boolean mask"
    if not backend.runs_packed_attention(model):
        # SDPA (GPU, bf16, --compile) computes every pair of an [N, N] mask: over a pack of short
        # rows that is more attention than the padding it saves (a GPU would want varlen flash
        # attention, not wired yet).
        return (f"its attention on {device.type} is not one that skips what a pack's mask hides (the CPU backend's "
                "fused kernels: float32, --cpu-fused-layers)")
    return None


def log_packing(reasons: dict[str, str | None]) -> None:
    """One log line: which models' forwards can run packed (reason None) and why the others cannot."""
    log.info("packed forwards (--pack-sequences): %s",
             "; ".join(f"{name} {'yes' if why is None else f'no: {why}'}" for name, why in reasons.items()))


def packs_fewer_tokens(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, padded_tokens: int,
                       shared_prefix: int = 0, one_forward: bool = True, budget: int = MAX_PACK_TOKENS) -> bool:
    """A packed forward over these rows applies and pays: the model packs, each row's real tokens
    are one run, the packs (of `budget` tokens) run fewer tokens than the `padded_tokens` the
    padded forward would (`packed_tokens`: rows sharing their first `shared_prefix` columns run
    them once) and (`one_forward`: a trained model's micro-batch is one forward on every rank) at
    most MAX_PACK_TOKENS."""
    if packing_unsupported_reason(model, attention_mask.device) is not None or real_spans(attention_mask) is None:
        return False
    real = packed_tokens(sequences, attention_mask, shared_prefix, budget)
    return forward_tokens(real, padded_tokens, packs=True, one_forward=one_forward) < padded_tokens


@dataclass(frozen=True)
class PackUnit:
    """Rows packed together: one row, or rows sharing their prompt (`prompt` real tokens, run once)."""

    rows: tuple[int, ...]
    tokens: int
    prompt: int = 0


def pack_units(sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0,
               budget: int = MAX_PACK_TOKENS) -> list[PackUnit]:
    """The rows with real tokens as pack units: rows that share their first `shared_prefix`
    columns (ids and mask) and hold real tokens there are one unit (their prompt once, then each
    row's response), cut in row order into units of at most `budget` tokens (a row alone may be
    longer); other rows are units of their own. A ValueError where a row's real tokens are not one run."""
    spans = real_spans(attention_mask)
    if spans is None:
        raise ValueError("packing: a row's real tokens are not one contiguous run of columns")
    starts, lengths = spans
    groups = prompt_groups(sequences, attention_mask, shared_prefix)
    members: dict[int, list[int]] = {}
    units: list[PackUnit] = []
    for row in range(len(lengths)):
        if lengths[row] > 0 and groups is not None and min(shared_prefix - starts[row], lengths[row]) >= 1:
            members.setdefault(int(groups[2][row]), []).append(row)
        elif lengths[row] > 0:
            units.append(PackUnit((row,), lengths[row]))
    for rows in members.values():
        prompt = min(shared_prefix - starts[rows[0]], min(lengths[r] for r in rows))
        unit: list[int] = []
        for row in rows:
            if unit and prompt + sum(lengths[r] - prompt for r in [*unit, row]) > budget:
                units.append(_group_unit(unit, lengths, prompt))
                unit = []
            unit.append(row)
        units.append(_group_unit(unit, lengths, prompt))
    return units


def _group_unit(rows: list[int], lengths: list[int], prompt: int) -> PackUnit:
    """Rows of one prompt as a unit (one row alone: a plain row's unit)."""
    if len(rows) == 1:
        return PackUnit((rows[0],), lengths[rows[0]])
    return PackUnit(tuple(rows), prompt + sum(lengths[r] - prompt for r in rows), prompt)


def packed_tokens(sequences: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int = 0,
                  budget: int = MAX_PACK_TOKENS) -> int:
    """The tokens packed forwards over these rows run (`pack_units`)."""
    return sum(unit.tokens for unit in pack_units(sequences, attention_mask, shared_prefix, budget))


def packed_micro_batches(sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int, shared_prefix: int = 0,
                         at_least: int = 1) -> list[torch.Tensor]:
    """Row indices of micro-batches whose forwards run at most `budget` tokens packed (`pack_units`:
    each sampled group's prompt once per micro-batch; where that is over MAX_PACK_TOKENS, their
    padded forward's), a group's rows together (groups, then rows, longest first), at least
    `at_least` of them (`budget_partition`, as `token_budget_micro_batches` cuts padded rows)."""
    spans = real_spans(attention_mask)
    if spans is None:
        return token_budget_micro_batches(attention_mask, budget, at_least)
    starts, lengths = spans
    groups = prompt_groups(sequences, attention_mask, shared_prefix)
    prompt = [0] * len(lengths)
    key = [-1 - row for row in range(len(lengths))]  # a row's group, else a key of its own
    for row in range(len(lengths)):
        shared = min(shared_prefix - starts[row], lengths[row])
        if groups is not None and shared >= 1:
            prompt[row], key[row] = shared, int(groups[2][row])
    group_tokens: dict[int, int] = {}
    for row in range(len(lengths)):
        group_tokens[key[row]] = group_tokens.get(key[row], prompt[row]) + lengths[row] - prompt[row]

    def cost(rows: list[int]) -> int:
        packed = sum(lengths[r] - prompt[r] for r in rows) + sum({key[r]: prompt[r] for r in rows}.values())
        if packed <= MAX_PACK_TOKENS:  # one pack; the padded forward (every row whole) never runs fewer
            return packed
        return padded_tokens(attention_mask[rows])

    order = sorted(range(len(lengths)), key=lambda r: (-group_tokens[key[r]], key[r], -lengths[r], r))
    parts = budget_partition(order, cost, budget, at_least)
    return [torch.tensor(p, dtype=torch.long, device=attention_mask.device) for p in parts]


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Items (rows, units) into packs whose lengths sum to at most `budget` (a longer item is a
    pack of its own): first fit, longest first; items without tokens are left out."""
    if budget < 1:
        raise ValueError(f"pack budget must be >= 1 token, got {budget}")
    packs: list[list[int]] = []
    room: list[int] = []
    for item in sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i]):
        fit = next((i for i, free in enumerate(room) if free >= lengths[item]), None)
        if fit is None:
            packs.append([item])
            room.append(budget - lengths[item])
        else:
            packs[fit].append(item)
            room[fit] -= lengths[item]
    return packs


@dataclass
class _PackLayout:
    """One pack's forward arguments and where each of its rows' real tokens sit in it."""

    inputs: dict[str, torch.Tensor]
    where: dict[int, torch.Tensor]  # row -> pack index of each of its real tokens, in column order
    starts: list[int]  # every row's first real column


def _pack_layout(sequences: torch.Tensor, starts: list[int], lengths: list[int], units: list[PackUnit]) -> _PackLayout:
    """The units' tokens end to end [1, N] (a group: [prompt | each row's response]), positions as
    in each row, and the mask [1, 1, N, N]: a token sees the tokens of its own row (a group's
    prompt belongs to all of its rows) at positions up to its own."""
    device = sequences.device
    segments: list[tuple[torch.Tensor, int, int]] = []  # (tokens, first position, branch)
    where: dict[int, torch.Tensor] = {}
    offset = 0
    for unit in units:
        head = unit.rows[0]
        start = starts[head]
        if unit.prompt == 0:  # one row; branch 0 is seen by the whole unit
            segments.append((sequences[head, start : start + lengths[head]], 0, 0))
            where[head] = torch.arange(offset, offset + unit.tokens, device=device)
        else:  # the group's prompt (branch 0), then row i's response (branch i + 1, seen by row i only)
            segments.append((sequences[head, start : start + unit.prompt], 0, 0))
            prompt_at = torch.arange(offset, offset + unit.prompt, device=device)
            at = offset + unit.prompt
            for i, row in enumerate(unit.rows):
                segments.append((sequences[row, start + unit.prompt : start + lengths[row]], unit.prompt, i + 1))
                where[row] = torch.cat([prompt_at, torch.arange(at, at + lengths[row] - unit.prompt, device=device)])
                at += lengths[row] - unit.prompt
        offset += unit.tokens
    pos = torch.cat([torch.arange(p, p + t.numel(), device=device) for t, p, _ in segments])
    branch = torch.cat([torch.full((t.numel(),), b, device=device) for t, _, b in segments])
    mask = torch.zeros(offset, offset, dtype=torch.bool, device=device)
    begin = 0
    for unit in units:  # block diagonal: a unit's tokens see only tokens of their unit
        end = begin + unit.tokens
        if unit.prompt == 0:
            mask[begin:end, begin:end] = torch.ones(unit.tokens, unit.tokens, dtype=torch.bool, device=device).tril()
        else:
            p, b = pos[begin:end], branch[begin:end]
            mask[begin:end, begin:end] = (p[None, :] <= p[:, None]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
        begin = end
    return _PackLayout({"input_ids": torch.cat([t for t, _, _ in segments])[None], "position_ids": pos[None],
                        "attention_mask": mask[None, None]}, where, starts)


def _packs(sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int,
           shared_prefix: int = 0) -> Iterator[_PackLayout]:
    """The layouts of the packs of at most `budget` tokens the rows' units make (`pack_units`)."""
    units = pack_units(sequences, attention_mask, shared_prefix, budget)
    starts, lengths = real_spans(attention_mask)  # type: ignore[misc]  (pack_units checked the runs)
    for pack in pack_rows([unit.tokens for unit in units], budget):
        yield _pack_layout(sequences, starts, lengths, [units[i] for i in pack])


def packed_logprobs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_start: int,
                    budget: int, with_entropy: bool = False, columns: torch.Tensor | None = None,
                    shared_prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each next token [B, T-1], position t scoring column t + 1; with `with_entropy`
    the entropy of each of those positions' distributions, else None) of a causal LM from forwards
    over packs of the rows' real tokens (one forward per pack: a budget of at least the rows' real
    tokens is one forward), pairs of rows that share their first `shared_prefix` columns running
    them once. Positions before response_start - 1, and those that score padding, are 0. `columns`
    ([B, T] bool) scores those columns instead (SFT: the supervised ones; a row's first real token
    is never scored). Differentiable. Rows whose real tokens are not contiguous are a ValueError
    (the caller keeps the padded forward for them)."""
    batch, width = sequences.shape
    device = sequences.device
    out = torch.zeros(batch, width - 1, dtype=torch.float32, device=device)
    entropy = torch.zeros_like(out) if with_entropy else None
    for layout in _packs(sequences, attention_mask, budget, shared_prefix):
        keep, targets, rows, cols = [], [], [], []
        for row, at in layout.where.items():
            start, n = layout.starts[row], at.numel()
            # Column j (a real token at or after response_start, not the row's first) is scored by
            # the position of column j - 1.
            if columns is None:
                scored = torch.arange(min(max(start + 1, response_start), start + n), start + n, device=device)
            else:
                scored = torch.arange(start + 1, start + n, device=device)
                scored = scored[columns[row, start + 1 : start + n]]
            keep.append(at[scored - 1 - start])
            targets.append(sequences[row, scored])
            rows.append(torch.full_like(scored, row))
            cols.append(scored - 1)
        index = torch.cat(keep)
        scores_nothing = index.numel() == 0
        logits = model(**layout.inputs, logits_to_keep=index.new_zeros(1) if scores_nothing else index,
                       use_cache=False).logits[0]
        if scores_nothing:  # still a forward with a graph, as the padded path's (sharded ranks run as many)
            out = out + 0.0 * logits.float().sum()
            continue
        where = (torch.cat(rows), torch.cat(cols))
        out = out.index_put(where, selective_log_softmax(logits, torch.cat(targets)).float())
        if entropy is not None:
            entropy = entropy.index_put(where, entropy_from_logits_chunked(logits).float())
    return out, entropy


def packed_values(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int,
                  shared_prefix: int = 0) -> torch.Tensor:
    """Per-token values [B, T] (float32) of a value model (`ValueModel`: forward(input_ids,
    attention_mask, position_ids) -> [B, T]) from forwards over packs of the rows' real tokens, as
    `packed_logprobs` packs them (a group's shared prompt run once: its values are every row's);
    positions outside the rows' real tokens are 0 (the padded forward's mean nothing).
    Differentiable; a ValueError where a row's real tokens are not one run."""
    out = torch.zeros(sequences.shape, dtype=torch.float32, device=sequences.device)
    for layout in _packs(sequences, attention_mask, budget, shared_prefix):
        values = model(**layout.inputs)[0]
        at = torch.cat(list(layout.where.values()))
        rows = torch.cat([torch.full_like(index, row) for row, index in layout.where.items()])
        cols = torch.cat([torch.arange(layout.starts[row], layout.starts[row] + index.numel(), device=index.device)
                          for row, index in layout.where.items()])
        out = out.index_put((rows, cols), values[at].float())
    return out


def packed_scores(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, budget: int,
                  shared_prefix: int = 0) -> torch.Tensor:
    """Sequence scores [B] (float32) of a value / reward model, each row's value at its last real
    token (`ValueModel.score`), from forwards over packs of the rows' real tokens (a group's shared
    prompt, first `shared_prefix` columns, run once). Differentiable; a ValueError where a row has
    no real token or its real tokens are not one run."""
    if bool((attention_mask.sum(dim=1) == 0).any()):
        raise ValueError("packed_scores: a row has no real token to score")
    out = torch.zeros(sequences.shape[0], dtype=torch.float32, device=sequences.device)
    for layout in _packs(sequences, attention_mask, budget, shared_prefix):
        values = model(**layout.inputs)[0]
        rows = list(layout.where)
        last = torch.stack([layout.where[row][-1] for row in rows])
        out = out.index_put((torch.tensor(rows, device=sequences.device),), values[last].float())
    return out
