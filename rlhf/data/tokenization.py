"""Rendered examples -> token ids, with the untrained pieces masked and truncation/drops counted.

Each piece of a rendering (rlhf/data/rendering.py) is tokenized on its own and the ids are
concatenated, so the boundary between prompt and response (and between trained turns and the
turns between them) is exact. The first piece gets the tokenizer's BOS unless its text already
starts with it. Each tokenize function first checks that the stage trains on the row's type
(`require_kind`): a row of another type is an error naming it, never a silent drop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlhf.data.formats import ParsedRow, require_kind
from rlhf.data.rendering import Piece, render_continuation, render_prompt, sft_pieces
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


def encode_pieces(pieces: list[Piece], tokenizer: Any) -> tuple[list[int], list[bool]]:
    """The pieces' ids end to end, and for each id whether its piece is trained."""
    ids: list[int] = []
    trained: list[bool] = []
    for i, piece in enumerate(pieces):
        piece_ids = (encode_prompt if i == 0 else encode_continuation)(piece.text, tokenizer)
        ids += piece_ids
        trained += [piece.trained] * len(piece_ids)
    return ids, trained


def tokenize_sft(
    rows: list[ParsedRow], tokenizer: Any, max_seq_len: int, train_on_prompt: bool = False,
    last_turn_only: bool = False, stage: str = "sft"
) -> tuple[list[dict[str, list[int]]], TokenizeStats]:
    """input_ids and labels: the trained pieces' ids, IGNORE_INDEX elsewhere (everything trained
    with `train_on_prompt`). A row whose first (prompt) piece fills max_seq_len is dropped; a longer
    one is cut at max_seq_len; both counted."""
    stats = TokenizeStats()
    out = []
    for k, row in enumerate(rows):
        where = row.where
        require_kind(row, "sft", where)
        pieces = sft_pieces(row, tokenizer, last_turn_only, where)
        if not any(p.trained for p in pieces):
            stats.dropped["no assistant turn"] += 1
            continue
        ids, trained = encode_pieces(pieces, tokenizer)
        first_trained = trained.index(True)
        if first_trained >= max_seq_len:
            stats.dropped["prompt longer than max_seq_len"] += 1
            continue
        if len(ids) > max_seq_len:
            ids, trained = ids[:max_seq_len], trained[:max_seq_len]
            stats.truncated += 1
        labels = ids.copy() if train_on_prompt else [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)]
        out.append({"input_ids": ids, "labels": labels})
        stats.kept += 1
        stats.kept_indices.append(k)
    return out, stats


def tokenize_pairs(
    rows: list[ParsedRow], tokenizer: Any, max_seq_len: int, stage: str = "reward"
) -> tuple[list[dict[str, Any]], TokenizeStats]:
    """chosen_ids / rejected_ids (prompt + response each), prompt_len (the shared prompt's ids, the
    first of both) and an optional margin."""
    stats = TokenizeStats()
    out = []
    for k, row in enumerate(rows):
        where = row.where
        require_kind(row, stage, where)
        assert row.chosen is not None and row.rejected is not None
        if row.chosen == row.rejected:
            stats.dropped["chosen equals rejected"] += 1
            continue
        prompt = encode_prompt(render_prompt(row.prompt, tokenizer, row.tools, where), tokenizer)
        if len(prompt) >= max_seq_len:
            stats.dropped["prompt longer than max_seq_len"] += 1
            continue
        pair: dict[str, Any] = {"prompt_len": len(prompt)}
        truncated = False
        for key, turns in (("chosen_ids", row.chosen), ("rejected_ids", row.rejected)):
            text = render_continuation(row.prompt, turns, tokenizer, row.tools, where)
            response = encode_continuation(text, tokenizer)
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
        stats.kept_indices.append(k)
        out.append(pair)
    return out, stats


def tokenize_prompts(
    rows: list[ParsedRow], tokenizer: Any, max_prompt_len: int, tools: list[dict[str, Any]] | None = None
) -> tuple[list[list[int]], TokenizeStats]:
    """Prompt ids for generation; prompts over max_prompt_len are dropped and counted. `tools`: the
    schemas of the tools the policy may call (rendered instead of a row's own `tools` column)."""
    stats = TokenizeStats()
    out = []
    for k, row in enumerate(rows):
        where = row.where
        require_kind(row, "ppo", where)
        prompt = row.generation_prompt
        assert prompt is not None
        ids = encode_prompt(render_prompt(prompt, tokenizer, tools or row.tools, where), tokenizer)
        if len(ids) > max_prompt_len:
            stats.dropped["prompt longer than max_prompt_len"] += 1
            continue
        out.append(ids)
        stats.kept += 1
        stats.kept_indices.append(k)
    return out, stats
