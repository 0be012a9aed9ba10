"""One iteration's rollouts and how they are laid out over ranks, prompt groups and sampling rounds.

The global batch of an iteration is a list of sample *slots* in group-major order: every prompt of
the iteration appears `samples_per_prompt` times in a row (its group), and the slots are cut into
contiguous pieces of `generation_batch_size` per rank, so rank r holds slots
[r * batch, (r + 1) * batch). A TP group generates the slots of its ranks together: consecutive
slots of one prompt become one unique prompt with a repeat count, prefilled once
(`generate(..., samples_per_prompt=counts)`). Groups may therefore span ranks; the group
estimators read the scores of the whole global batch (`global_scores`).

DAPO's dynamic sampling works on whole groups: after each round the groups whose rewards all tie
are dropped, the kept ones are gathered from every rank (`gather_rollouts`), and once enough are
kept (or the rounds run out, tied groups filling the rest) each rank takes its slice again
(`select_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch

from rlhf.data.formats import Message
from rlhf.engine.distributed import DistributedContext

T = TypeVar("T")


@dataclass
class Rollouts:
    """This rank's share of one iteration's generations and their scores."""

    sequences: torch.Tensor  # [B, T] prompt + response ids, left-padded prompts
    attention_mask: torch.Tensor  # [B, T]
    action_mask: torch.Tensor  # [B, T] response tokens
    ended_with_eos: torch.Tensor  # [B] bool
    prompts: list[list[Message]]  # each row's chat messages
    responses: list[str]  # each row's decoded response
    fields: list[dict[str, Any]]  # each row's other data columns (for reward functions)
    metrics: dict[str, float]  # rollout mode's (parity check, memory) and sampling's
    raw_scores: torch.Tensor | None = None  # [B] the weighted reward sources
    scores: torch.Tensor | None = None  # [B] shaped: missing-EOS and overlong penalties, clipped
    components: dict[str, torch.Tensor] | None = None  # [B] raw score of each reward source
    clipped: torch.Tensor | None = None  # [B] bool: --reward-clip cut the shaped score
    logprobs: torch.Tensor | None = None  # [B, T] float32: generation's log-prob of each response token, 0 elsewhere
    conversational: list[bool] | None = None  # each row's prompt came as chat messages (None: none did)
    extra: dict[str, list[Any]] | None = None  # the reward functions' log_extra columns, one value per row
    trajectories: list[list[Message]] | None = None  # a tool rollout's turns after each prompt
    environments: list[Any] | None = None  # a tool rollout's --environment instance of each row

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.action_mask.sum(-1)


def iteration_slots(prompt_indices: list[int], samples_per_prompt: int) -> list[int]:
    """The prompt index of every sample slot of an iteration, group-major."""
    return [p for p in prompt_indices for _ in range(samples_per_prompt)]


def unique_runs(slots: list[T]) -> tuple[list[T], list[int]]:
    """Consecutive equal slots (prompt indices, or prompts' ids) as (prompts, counts): the unique
    prompts a TP group prefills once."""
    prompts: list[T] = []
    counts: list[int] = []
    for p in slots:
        if prompts and prompts[-1] == p:
            counts[-1] += 1
        else:
            prompts.append(p)
            counts.append(1)
    return prompts, counts


def global_scores(scores: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Every rank's [B] scores as one [B * world] vector in slot order (rank r's at r * B)."""
    batch = scores.shape[0]
    full = torch.zeros(batch * ctx.world_size, dtype=torch.float64, device=scores.device)
    full[ctx.rank * batch : (ctx.rank + 1) * batch] = scores.double()
    return ctx.all_reduce_sum(full).to(scores.device)


def _pad_left_columns(t: torch.Tensor, columns: int, value: float) -> torch.Tensor:
    if columns == 0:
        return t
    pad = torch.full((t.shape[0], columns), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)


def merge_rollouts(parts: list[Rollouts], pad_token_id: int) -> Rollouts:
    """Rows of several rollouts in order; narrower prompts are left-padded to the widest."""
    width = max(p.sequences.shape[1] for p in parts)
    tensors: dict[str, Any] = {}
    for name, value in (("sequences", pad_token_id), ("attention_mask", 0), ("action_mask", False)):
        tensors[name] = torch.cat([_pad_left_columns(getattr(p, name), width - p.sequences.shape[1], value)
                                   for p in parts])
    merged = Rollouts(
        **tensors, ended_with_eos=torch.cat([p.ended_with_eos for p in parts]),
        prompts=[m for p in parts for m in p.prompts], responses=[r for p in parts for r in p.responses],
        fields=[f for p in parts for f in p.fields], metrics=dict(parts[0].metrics),
        conversational=[c for p in parts for c in (p.conversational or [False] * len(p))],
    )
    for name in ("raw_scores", "scores", "clipped"):
        if all(getattr(p, name) is not None for p in parts):
            setattr(merged, name, torch.cat([getattr(p, name) for p in parts]))
    if all(p.logprobs is not None for p in parts):
        merged.logprobs = torch.cat([_pad_left_columns(p.logprobs, width - p.sequences.shape[1], 0.0) for p in parts])
    for name in ("trajectories", "environments"):
        if all(getattr(p, name) is not None for p in parts):
            setattr(merged, name, [x for p in parts for x in getattr(p, name)])
    if all(p.components is not None for p in parts):
        merged.components = {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components}
    columns = dict.fromkeys(k for p in parts for k in (p.extra or {}))
    if columns:  # a column one part's functions did not log is None on its rows
        merged.extra = {k: [v for p in parts for v in (p.extra or {}).get(k, [None] * len(p))] for k in columns}
    return merged


def select_rows(rollouts: Rollouts, rows: list[int]) -> Rollouts:
    """The given rows of `rollouts`, in that order (columns that are padding on all of them are kept)."""
    index = torch.tensor(rows, dtype=torch.long, device=rollouts.sequences.device)
    picked: dict[str, Any] = {}
    for f in fields(rollouts):
        value = getattr(rollouts, f.name)
        if torch.is_tensor(value) and value.dim() > 0:
            picked[f.name] = value[index]
        elif isinstance(value, list):
            picked[f.name] = [value[i] for i in rows]
        elif isinstance(value, dict) and f.name == "components":
            picked[f.name] = {k: v[index] for k, v in value.items()}
        elif isinstance(value, dict) and f.name == "extra":
            picked[f.name] = {k: [v[i] for i in rows] for k, v in value.items()}
    return replace(rollouts, **picked)


def moved(rollouts: Rollouts, device: torch.device | str) -> Rollouts:
    """A copy whose tensors live on `device` (gather_rollouts sends CPU copies)."""
    moved_tensors: dict[str, Any] = {f.name: getattr(rollouts, f.name).to(device) for f in fields(rollouts)
                                     if torch.is_tensor(getattr(rollouts, f.name))}
    if rollouts.components is not None:
        moved_tensors["components"] = {k: v.to(device) for k, v in rollouts.components.items()}
    return replace(rollouts, **moved_tensors)


def gather_rollouts(rollouts: Rollouts, ctx: DistributedContext, pad_token_id: int) -> Rollouts:
    """Every rank's rollouts, in rank order (= slot order), on every rank."""
    if ctx.world_size == 1:
        return rollouts
    # Environments stay on their rank (they may not pickle): their rewards are in the scores already.
    parts = ctx.all_gather_object(replace(moved(rollouts, "cpu"), environments=None))
    return moved(merge_rollouts(parts, pad_token_id), rollouts.sequences.device)


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """The rows of the given groups, group-major."""
    return [g * group_size + j for g in groups for j in range(group_size)]


__all__ = [
    "Rollouts", "gather_rollouts", "global_scores", "group_rows", "iteration_slots", "merge_rollouts",
    "select_rows", "unique_runs",
]
