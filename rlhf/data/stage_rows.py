"""A stage's rows, from --data specs to tokenized train and eval rows: the one path sft, reward
and ppo share (load -> this stage's --data-split share -> parse -> tokenize -> eval rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.config import DataConfig
from rlhf.data.formats import ParsedRow, parse_row
from rlhf.data.sources import eval_holdout, load_rows, stage_share
from rlhf.data.tokenization import TokenizeStats
from rlhf.errors import UserError

Tokenize = Callable[[list[ParsedRow]], tuple[list[Any], TokenizeStats]]
"""Parsed rows -> (the stage's tokenized rows, the counts of what was kept, truncated, dropped)."""


@dataclass
class StageRows:
    """What a stage trains and evaluates on, and the counts saved in its summary.json."""

    train: list[Any]
    eval: list[Any] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def tokenize_specs(specs: Sequence[str], tokenize: Tokenize, label: str) -> tuple[list[Any], TokenizeStats]:
    """Every row of `specs` parsed and tokenized, with the counts logged under `label`."""
    rows, stats = tokenize([parse_row(r) for spec in specs for r in load_rows(spec)])
    stats.log(label)
    return rows, stats


DATA_FORMATS = "one or more json/jsonl/parquet/csv files, saved folders or hub names"


def load_stage_rows(
    data: DataConfig, stage: str, seed: int, tokenize: Tokenize, empty: str, required: str = DATA_FORMATS,
    holdout: bool = True,
) -> StageRows:
    """This stage's share of every --data source, tokenized, plus its eval rows.

    `required` completes the error when --data is missing ("--data is required: <required>"),
    `empty` the one when no row survives tokenization ("--data <specs>: <empty>"). Eval rows are
    --eval-data when given, else an --eval-split holdout of the training rows; `holdout=False`
    (PPO, which has no eval loss) takes neither.
    """
    if not data.data:
        raise UserError(f"--data is required: {required}")
    raw = stage_share([row for spec in data.data for row in load_rows(spec)], data.data_split, stage, seed)
    rows, stats = tokenize([parse_row(r) for r in raw])
    stats.log(f"{stage} data")
    if not rows:
        raise UserError(f"--data {' '.join(data.data)}: {empty}")
    if not holdout:
        return StageRows(rows, [], stats.as_dict())
    if data.eval_data:
        held_out, _ = tokenize_specs(data.eval_data, tokenize, f"{stage} eval data")
        return StageRows(rows, held_out, stats.as_dict())
    train, held_out = eval_holdout(rows, data.eval_split, seed)
    return StageRows(train, held_out, stats.as_dict())


__all__ = ["StageRows", "Tokenize", "load_stage_rows", "tokenize_specs"]
