"""Rendered examples -> token ids, with prompt masking and counted truncation/drops."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlhf.data.formats import ParsedRow, render_prompt, render_response
from rlhf.logging import get_logger

log = get_logger(__name__)

IGNORE_INDEX = -100


@dataclass
class TokenizeStats:
    """What happened to rows on their way to token ids; logged, and saved in summary.json."""

    kept: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    kept_indices: list[int] = field(default_factory=list)
    """Positions (in the input rows) of the rows that were kept, in order."""

    def log(self, what: str) -> None:
        dropped = sum(self.dropped.values())
        log.info(
            "%s: %d kept, %d truncated to max_seq_len, %d dropped%s", what, self.kept, self.truncated, dropped,
            f" ({', '.join(f'{k}: {v}' for k, v in self.dropped.items())})" if dropped else "",
        )

    def as_dict(self) -> dict[str, int]:
        return {"kept": self.kept, "truncated": self.truncated, "dropped": sum(self.dropped.values()),
                **{"dropped_" + "".join(c if c.isalnum() else "_" for c in k): v for k, v in self.dropped.items()}}


def encode_prompt(text: str, tokenizer: Any) -> list[int]:
    """Prompt ids with the tokenizer's BOS, unless the rendered text already starts with it."""
    bos = tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=add_special)["input_ids"]


def encode_continuation(text: str, tokenizer: Any) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_sft(
    rows: list[ParsedRow], tokenizer: Any, max_seq_len: int, train_on_prompt: bool = False
) -> tuple[list[dict[str, list[int]]], TokenizeStats]:
    """input_ids and labels (prompt tokens = IGNORE_INDEX unless train_on_prompt)."""
    stats = TokenizeStats()
    out = []
    for row in rows:
        if row.response is None:
            stats.dropped["no response"] += 1
            continue
        prompt = encode_prompt(render_prompt(row.prompt, tokenizer), tokenizer)
        response = encode_continuation(render_response(row.prompt, row.response, tokenizer), tokenizer)
        if len(prompt) >= max_seq_len:
            stats.dropped["prompt longer than max_seq_len"] += 1
            continue
        if len(prompt) + len(response) > max_seq_len:
            response = response[: max_seq_len - len(prompt)]
            stats.truncated += 1
        ids = prompt + response
        labels = ids.copy() if train_on_prompt else [IGNORE_INDEX] * len(prompt) + response
        out.append({"input_ids": ids, "labels": labels})
        stats.kept += 1
    return out, stats


def tokenize_pairs(
    rows: list[ParsedRow], tokenizer: Any, max_seq_len: int
) -> tuple[list[dict[str, Any]], TokenizeStats]:
    """chosen_ids / rejected_ids (prompt + response each) and an optional margin."""
    stats = TokenizeStats()
    out = []
    for row in rows:
        if row.chosen is None or row.rejected is None:
            stats.dropped["no chosen/rejected pair"] += 1
            continue
        if row.chosen == row.rejected:
            stats.dropped["chosen equals rejected"] += 1
            continue
        prompt = encode_prompt(render_prompt(row.prompt, tokenizer), tokenizer)
        if len(prompt) >= max_seq_len:
            stats.dropped["prompt longer than max_seq_len"] += 1
            continue
        pair: dict[str, Any] = {}
        truncated = False
        for key, text in (("chosen_ids", row.chosen), ("rejected_ids", row.rejected)):
            response = encode_continuation(render_response(row.prompt, text, tokenizer), tokenizer)
            if len(prompt) + len(response) > max_seq_len:
                response = response[: max_seq_len - len(prompt)]
                truncated = True
            pair[key] = prompt + response
        if pair["chosen_ids"] == pair["rejected_ids"]:
            stats.dropped["identical after truncation"] += 1
            continue
        pair["margin"] = row.margin if row.margin is not None else 0.0
        stats.truncated += int(truncated)
        stats.kept += 1
        out.append(pair)
    return out, stats


def tokenize_prompts(
    rows: list[ParsedRow], tokenizer: Any, max_prompt_len: int
) -> tuple[list[list[int]], TokenizeStats]:
    """Prompt ids for generation; prompts over max_prompt_len are dropped and counted."""
    stats = TokenizeStats()
    out = []
    for i, row in enumerate(rows):
        ids = encode_prompt(render_prompt(row.prompt, tokenizer), tokenizer)
        if len(ids) > max_prompt_len:
            stats.dropped["prompt longer than max_prompt_len"] += 1
            continue
        out.append(ids)
        stats.kept += 1
        stats.kept_indices.append(i)
    return out, stats
