"""A stage's rows, from --data specs to tokenized train and eval rows: the one path sft, reward
and ppo share.

    load each --data dataset's --data-train-split (its --data-config, columns renamed by --data-columns)
    -> mix them by --data-mix (all rows, concatenated, without it)
    -> this stage's --data-split share
    -> parse -> tokenize
    -> eval rows: each dataset's --data-test-split, else --eval-data, else an --eval-split holdout

Mixing comes before the --data-split share, and is seeded by the run's seed alone, so every stage
of a run mixes the same rows and the shares stay disjoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.config import DataConfig
from rlhf.data.formats import ParsedRow, parse_row
from rlhf.data.sources import RawRow, eval_holdout, load_rows, mix_rows, stage_share
from rlhf.data.tokenization import TokenizeStats
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

Tokenize = Callable[[list[ParsedRow]], tuple[list[Any], TokenizeStats]]
"""Parsed rows -> (the stage's tokenized rows, the counts of what was kept, truncated, dropped)."""


@dataclass
class StageRows:
    """What a stage trains and evaluates on, and the counts saved in its summary.json."""

    train: list[Any]
    eval: list[Any] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    """The training rows' counts (kept, truncated, dropped...), `mix_left_out` with --data-mix, and
    the eval rows' as eval_kept, eval_truncated, eval_dropped... when they come from a split or
    --eval-data."""


def tokenize_rows(raw: list[RawRow], tokenize: Tokenize, label: str) -> tuple[list[Any], TokenizeStats]:
    """`raw` parsed and tokenized, with the counts logged under `label`."""
    rows, stats = tokenize([parse_row(r) for r in raw])
    stats.log(label)
    return rows, stats


def tokenize_specs(specs: Sequence[str], tokenize: Tokenize, label: str,
                   renames: Mapping[str, str] | None = None) -> tuple[list[Any], TokenizeStats]:
    """Every row of `specs` (each dataset's split "train", columns renamed by `renames`) parsed and
    tokenized, with the counts logged under `label`."""
    return tokenize_rows([r for spec in specs for r in load_rows(spec, renames=renames)], tokenize, label)


DATA_FORMATS = "one or more json/jsonl/parquet/csv files, saved folders or hub names"


def training_rows(data: DataConfig, stage: str, seed: int) -> tuple[list[RawRow], dict[str, int]]:
    """This stage's raw training rows (every --data dataset's train split, mixed, then its
    --data-split share) and the count the mix left out."""
    renames = data.column_renames
    datasets = [load_rows(spec, data.data_train_split, data.data_config, renames, "--data-train-split")
                for spec in data.data]
    counts: dict[str, int] = {}
    if data.data_mix:
        raw, counts["mix_left_out"] = mix_rows(datasets, data.data_mix, seed)
    else:
        raw = [row for rows in datasets for row in rows]
    return stage_share(raw, data.data_split, stage, seed), counts


def eval_rows(data: DataConfig, stage: str, tokenize: Tokenize) -> tuple[list[Any], dict[str, int]] | None:
    """The eval rows that come from a dataset (--data-test-split of each --data, whole, or
    --eval-data) and their counts; None when there are none (an --eval-split holdout, or nothing)."""
    renames = data.column_renames
    if data.data_test_split is not None:
        if data.eval_split > 0:
            log.warning("--eval-split %g is unused: the eval set is the split %s of --data (--data-test-split)",
                        data.eval_split, data.data_test_split)
        raw = [row for spec in data.data
               for row in load_rows(spec, data.data_test_split, data.data_config, renames, "--data-test-split")]
        what = f"--data-test-split {data.data_test_split}"
    elif data.eval_data:
        raw = [row for spec in data.eval_data for row in load_rows(spec, renames=renames)]
        what = f"--eval-data {' '.join(data.eval_data)}"
    else:
        return None
    rows, stats = tokenize_rows(raw, tokenize, f"{stage} eval data")
    if not rows:
        raise UserError(f"{what}: no usable eval rows out of {len(raw)} (see the counts above)")
    return rows, {f"eval_{key}": value for key, value in stats.as_dict().items()}


def load_stage_rows(
    data: DataConfig, stage: str, seed: int, tokenize: Tokenize, empty: str, required: str = DATA_FORMATS,
    holdout: bool = True,
) -> StageRows:
    """This stage's share of every --data source, tokenized, plus its eval rows.

    `required` completes the error when --data is missing ("--data is required: <required>"),
    `empty` the one when no row survives tokenization ("--data <specs>: <empty>"). Eval rows are
    each --data dataset's --data-test-split when given, else --eval-data, else an --eval-split
    holdout of the training rows; `holdout=False` (PPO, which has no eval loss) takes none.
    """
    if not data.data:
        raise UserError(f"--data is required: {required}")
    raw, counts = training_rows(data, stage, seed)
    rows, stats = tokenize_rows(raw, tokenize, f"{stage} data")
    if not rows:
        raise UserError(f"--data {' '.join(data.data)}: {empty}")
    counts = {**stats.as_dict(), **counts}
    if not holdout:
        return StageRows(rows, [], counts)
    held = eval_rows(data, stage, tokenize)
    if held is not None:
        return StageRows(rows, held[0], {**counts, **held[1]})
    train, held_out = eval_holdout(rows, data.eval_split, seed)
    return StageRows(train, held_out, counts)


__all__ = ["StageRows", "Tokenize", "eval_rows", "load_stage_rows", "tokenize_rows", "tokenize_specs",
           "training_rows"]
