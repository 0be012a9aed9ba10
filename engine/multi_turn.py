"""Multi-turn rollouts, token in and token out: the model's turns and what answers them, as ids.

    out = generate_turns(model, input_ids, attention_mask, params, generator, respond,
                         samples_per_prompt=8)

Each round generates (engine/generation.py) for the rows still going; then `respond(turns)` says,
per row, whether it is done (None) or how it goes on (`TurnEnd`): how many of the turn's sampled
tokens to keep (a tool call's end: tokens sampled after it are not part of the trajectory) and the
token ids to append (a tool response, rendered by the caller). The next round prefills each row's
whole context again, the prompt's ids followed by every kept and appended id: nothing is decoded
and encoded again, so the sequence trained on is exactly what was sampled plus what was appended.
The first round samples each prompt's group from one prefill (`samples_per_prompt`).

The output has the layout of `generate`'s: [B, P + max_new_tokens], left-padded prompts, the
response region from column P, where `action_mask` holds on sampled tokens only (the appended ones
are context, never actions) and `logprobs` on those columns. `max_new_tokens` bounds the whole
response region, sampled and appended together; a row that reaches it ends unfinished, an
appended response cut to fit included (`TurnsOutput.cut_appends` counts those).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from rlhf.engine.generation import GenerationOutput, generate
from rlhf.engine.sampling import SamplingParams


@dataclass(frozen=True)
class TurnEnd:
    """How a row goes on after its turn: keep the first `keep` sampled tokens, append `append`."""

    keep: int
    append: list[int]


@dataclass(frozen=True)
class Turn:
    """One row's turn as `respond` sees it."""

    row: int
    tokens: list[int]
    """The ids sampled in this turn (up to and including an EOS)."""
    ended_with_eos: bool
    remaining: int
    """Response tokens the row has left after this turn."""


Respond = Callable[[list[Turn]], "list[TurnEnd | None]"]


@dataclass
class TurnsOutput(GenerationOutput):
    """`GenerationOutput` of a multi-turn rollout, with its turn counts."""

    turns: torch.Tensor | None = None
    """[B] int64: model turns of each row."""
    cut_appends: int = 0
    """Appended responses cut short by max_new_tokens."""


@dataclass
class _Row:
    prompt: list[int]
    ids: list[int]
    sampled: list[bool]
    logprobs: list[float]
    turns: int = 0
    finished: bool = False


def _turn_tokens(out: GenerationOutput, i: int) -> tuple[list[int], list[float]]:
    """Row i's sampled ids of a round and their log-probs."""
    start = out.prompt_length
    mask = out.action_mask[i, start:]
    ids = out.sequences[i, start:][mask].tolist()
    logprobs = out.logprobs[i, start:][mask].tolist() if out.logprobs is not None else [0.0] * len(ids)
    return ids, logprobs


@torch.no_grad()
def generate_turns(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None, respond: Respond, samples_per_prompt: int | torch.Tensor = 1,
    fast: bool | Literal["auto"] = "auto",
) -> TurnsOutput:
    """Rounds of generation, each row answered by `respond` until it is done or out of tokens."""
    out = generate(model, input_ids, attention_mask, params, generator, fast, samples_per_prompt)
    width = out.prompt_length
    prompt_mask = out.attention_mask[:, :width].bool().cpu()
    prompts = out.sequences[:, :width].cpu()
    rows = [_Row(p[m].tolist(), [], [], []) for p, m in zip(prompts, prompt_mask)]
    active = list(range(len(rows)))
    budget, cut_appends = params.max_new_tokens, 0
    finished = out.finished.cpu().tolist()
    while active:
        turns = []
        for k, i in enumerate(active):
            ids, logprobs = _turn_tokens(out, k)
            room = budget - len(rows[i].ids)
            ended = bool(finished[k]) and len(ids) <= room
            ids, logprobs = ids[:room], logprobs[:room]
            rows[i].ids += ids
            rows[i].sampled += [True] * len(ids)
            rows[i].logprobs += logprobs
            rows[i].turns += 1
            turns.append(Turn(i, ids, ended, budget - len(rows[i].ids)))
        ends = respond(turns)
        going = []
        for turn, end in zip(turns, ends, strict=True):
            row = rows[turn.row]
            if end is None:
                row.finished = turn.ended_with_eos
                continue
            dropped = len(turn.tokens) - end.keep
            if dropped:
                del row.ids[-dropped:], row.sampled[-dropped:], row.logprobs[-dropped:]
            room = budget - len(row.ids)
            cut_appends += len(end.append) > room
            row.ids += end.append[:room]
            row.sampled += [False] * len(end.append[:room])
            row.logprobs += [0.0] * len(end.append[:room])
            if len(end.append) < room:
                going.append(turn.row)
        active = going
        if active:
            out, finished = _next_round(model, rows, active, params, generator, fast, budget)
    return _assemble(rows, width, params, out.sequences.device, attention_mask.dtype, cut_appends)


def _next_round(model: nn.Module, rows: list[_Row], active: list[int], params: SamplingParams,
                generator: torch.Generator | None, fast: bool | Literal["auto"], budget: int
                ) -> tuple[GenerationOutput, list[bool]]:
    """One more turn of the `active` rows, each prefilled from its whole context."""
    device = next(model.parameters()).device
    contexts = [rows[i].prompt + rows[i].ids for i in active]
    longest = max(map(len, contexts))
    ids = torch.full((len(contexts), longest), params.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), longest), dtype=torch.long)
    for k, context in enumerate(contexts):
        ids[k, longest - len(context):] = torch.tensor(context, dtype=torch.long)
        mask[k, longest - len(context):] = 1
    room = max(budget - len(rows[i].ids) for i in active)
    round_params = replace(params, max_new_tokens=room, min_new_tokens=0)
    out = generate(model, ids.to(device), mask.to(device), round_params, generator, fast)
    return out, out.finished.cpu().tolist()


def _assemble(rows: list[_Row], width: int, params: SamplingParams, device: torch.device,
              mask_dtype: torch.dtype, cut_appends: int) -> TurnsOutput:
    """The rows in `generate`'s layout: prompts left-padded to `width`, responses from there on."""
    batch, total = len(rows), width + params.max_new_tokens
    sequences = torch.full((batch, total), params.pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, total), dtype=mask_dtype)
    action = torch.zeros((batch, total), dtype=torch.bool)
    logprobs = torch.zeros((batch, total), dtype=torch.float32)
    for i, row in enumerate(rows):
        p, n = len(row.prompt), len(row.ids)
        sequences[i, width - p : width] = torch.tensor(row.prompt, dtype=torch.long)
        attention[i, width - p : width + n] = 1
        if n:
            sequences[i, width : width + n] = torch.tensor(row.ids, dtype=torch.long)
            action[i, width : width + n] = torch.tensor(row.sampled)
            logprobs[i, width : width + n] = torch.tensor(row.logprobs)
    finished = torch.tensor([r.finished for r in rows], dtype=torch.bool)
    turns = torch.tensor([r.turns for r in rows], dtype=torch.long)
    return TurnsOutput(sequences.to(device), attention.to(device), action.to(device), width, finished.to(device),
                       logprobs.to(device), turns=turns, cut_appends=cut_appends)


__all__ = ["Respond", "Turn", "TurnEnd", "TurnsOutput", "generate_turns"]
