"""Small pieces of the PPO stage: prompts, micro-batch weights, the critic's values, phase timers."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhf.config import PPOConfig
from rlhf.data.formats import Message, ParsedRow
from rlhf.data.stage_rows import load_stage_rows
from rlhf.data.tokenization import TokenizeStats, tokenize_prompts
from rlhf.engine.config import EngineConfig
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.prompt_sharing import response_prefix


@dataclass(frozen=True)
class MicroWeight:
    """A micro-batch's loss weights: for token-level means and for sequence-level means
    (`micro_batch_weights`; 1.0 each with micro-batches of a fixed number of rows)."""

    tokens: float
    rows: float


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO's ratio must compare the same function: no dropout in actor or critic (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def engine_config_for(config: PPOConfig, zero_stage: int | None, lr: float | None) -> EngineConfig:
    """The shared engine config with the actor's or critic's own ZeRO stage and learning rate."""
    cfg = copy.deepcopy(config.engine)
    if zero_stage is not None:
        cfg.zero_stage = zero_stage
    if lr is not None:
        cfg.lr = lr
    return cfg


@dataclass
class Prompts:
    """Tokenized prompts plus their chat messages (a reward model with another tokenizer renders
    them again; rule-based rewards and sample tables read the last user turn)."""

    ids: list[list[int]]
    messages: list[list[Message]]
    fields: list[dict[str, Any]]
    stats: dict[str, int]
    conversational: list[bool]
    """Each prompt came as chat messages (TRL's conversational rows: its reward functions get messages)."""


def load_prompts(config: PPOConfig, tokenizer: Any, tools: list[dict[str, Any]] | None = None
                 ) -> tuple[Prompts, Prompts | None]:
    """This stage's share of --data as generation prompts of at most --max-prompt-len tokens, and
    the held-out prompts (--eval-data, --data-test-split or an --eval-split holdout; None without).
    `tools`: the schemas of the tools the policy may call, rendered into every prompt."""

    def tokenize(parsed: list[ParsedRow]) -> tuple[list[tuple[list[int], list[Message], dict, bool]], TokenizeStats]:
        ids, stats = tokenize_prompts(parsed, tokenizer, config.max_prompt_len, tools)
        return [(i, parsed[k].generation_prompt, parsed[k].fields, parsed[k].conversational)
                for i, k in zip(ids, stats.kept_indices)], stats

    data = config.data
    rows = load_stage_rows(
        data, "ppo", config.engine.seed, tokenize,
        holdout=bool(data.eval_data or data.eval_split > 0 or data.data_test_split is not None),
        required="prompts (or any rows with a prompt) as json/jsonl/parquet/csv",
        empty=f"no prompts of at most {config.max_prompt_len} tokens",
    )
    eval_stats = {k: v for k, v in rows.stats.items() if k.startswith("eval_")}
    held_out = prompts_of(rows.eval, eval_stats) if rows.eval else None
    return prompts_of(rows.train, rows.stats), held_out


def prompts_of(rows: list[tuple[list[int], list[Message], dict, bool]], stats: dict[str, int]) -> Prompts:
    """`Prompts` from tokenized rows (ids, generation prompt, fields, conversational)."""
    return Prompts([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], stats, [r[3] for r in rows])


def critic_values(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The critic's values [B, T], with the positions generation gave the tokens."""
    return critic(sequences, attention_mask, position_ids=position_ids_from_mask(attention_mask))


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block to seconds[key]."""
    start = time.perf_counter()
    yield
    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start


def experience_response_start(shifted_action_mask: torch.Tensor) -> int:
    """The first response column of an experience's rows: its action mask is shifted (position t
    scores token t + 1), so its first response position is one less (0: no response column)."""
    shifted = response_prefix(shifted_action_mask)
    return shifted + 1 if shifted else 0
