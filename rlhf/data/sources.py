"""Load raw rows from local files, load_from_disk folders, folders of data files or hub names (a
config, a split, column renames); mix several datasets; split the rows between stages.

Every dataset is read the same way: `load_rows(spec, split=..., config=..., renames=...)` picks the
split (and config) where the dataset has them, renames columns (NEW <- OLD) before any format is
detected, and returns rows that say where they came from (`RawRow.where`: "spec (split test) row 3").
"""

from __future__ import annotations

import json
import math
import logging
import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import UserError, import_dependency
from rlhf.logging import get_logger
from rlhf.seeding import derive_seed

log = get_logger(__name__)

STAGE_INDEX = {"sft": 0, "reward": 1, "dpo": 1, "ppo": 2}
"""Which --data-split share each stage takes (dpo, a preference stage, the reward stage's)."""
DATA_FILE_TYPES = (".json", ".jsonl", ".parquet", ".csv")
SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")  # load_from_disk folders
TEXT_COLUMNS = ("prompt", "completion", "response", "chosen", "rejected", "text")
"""Columns the formats (rlhf/data/formats.py) read as text: a number there (a CSV column of
answers, "completion": 4) is read as its text and counted, never refused."""
MESSAGE_COLUMNS = ("prompt", "completion", "response", "chosen", "rejected", "messages")
"""Columns that may hold chat messages, whose `content` is text: a number there is read likewise."""


@dataclass
class RawRow:
    """A row as stored, with where it came from (for error messages)."""

    data: dict[str, Any]
    source: str
    index: int
    split: str | None = None
    """The split the row was read from, where the dataset has named splits (None: a plain file)."""
    config: str | None = None
    """The dataset's config (subset), when one was asked for."""

    @property
    def dataset(self) -> str:
        """The dataset, its config and split: `org/name (config main, split test)`."""
        return dataset_label(self.source, self.split, self.config)

    @property
    def where(self) -> str:
        return f"{self.dataset} row {self.index}"


def dataset_label(spec: str, split: str | None, config: str | None = None) -> str:
    parts = [f"config {config}" if config else "", f"split {split}" if split else ""]
    named = ", ".join(p for p in parts if p)
    return f"{spec} ({named})" if named else spec


def read_text_file(path: Path) -> str:
    """The file as UTF-8 text, or one UserError naming the line of the first byte that is not
    UTF-8 (a decoder error alone names neither the file nor the line)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror}); check the path and its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                        "save the file as UTF-8 or fix that row") from None


def _json_lines(path: Path, text: str) -> list[Any]:
    """One JSON value per line. Lines end at "\n" (or "\r\n") only: `str.splitlines` also splits at
    U+2028/U+2029 and U+0085, which a JSON string may hold as they are."""
    rows = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {line_no}: not valid JSON ({exc.msg}); fix or remove the line") from None
    return rows


def _read_json(path: Path) -> list[Any] | dict[str, list[Any]]:
    """A .jsonl file's lines; a .json file's list, its object of splits ({"train": [...], "test":
    [...]}: every value a list), its one object (a row), or its JSON lines."""
    text = read_text_file(path)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if text.lstrip().startswith("["):
                raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            data = None  # JSON lines (several objects) in a .json file
        if isinstance(data, list):
            return data
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            return data
        if isinstance(data, dict):
            return [data]  # one row
    return _json_lines(path, text)


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """`datasets` logs an ERROR line before raising on a bad file; the UserError raised from the
    exception says it once."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _read_failure(path: Path, kind: str, exc: Exception) -> UserError:
    """One line for a file `datasets` could not read; a byte that is not UTF-8 named by its line."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        read_text_file(path)  # raises the UserError naming the line
    return UserError(f"{path}: could not read as {kind}: {_first_line(exc)}")


def _number_text(value: Any) -> str | None:
    """The text of an int or a finite float (a bool is not a number here), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return str(value) if isinstance(value, int) or math.isfinite(value) else None


def _log_read_as_text(label: str, counts: Mapping[str, int]) -> None:
    for column, n in counts.items():
        log.info("%s: %d values of column %s were numbers, read as text", label, n, column)


def numbers_as_text(rows: Sequence[dict[str, Any]], label: str) -> None:
    """Numbers in `TEXT_COLUMNS` (and in the content of chat messages) replaced by their text, in
    place; one log line per column says how many."""
    counts: Counter[str] = Counter()
    for data in rows:
        for column in TEXT_COLUMNS:
            text = _number_text(data.get(column))
            if text is not None:
                data[column] = text
                counts[repr(column)] += 1
        for column in MESSAGE_COLUMNS:
            messages = data.get(column)
            for message in messages if isinstance(messages, list) else ():
                text = _number_text(message.get("content")) if isinstance(message, dict) else None
                if text is not None:
                    message["content"] = text
                    counts[f"{column!r} (message content)"] += 1
    _log_read_as_text(label, counts)


def _text_columns(renames: Mapping[str, str] | None) -> set[str]:
    """The columns of a file that become `TEXT_COLUMNS` once `renames` ({NEW: OLD}) is applied."""
    renames = renames or {}
    olds = set(renames.values())
    return {renames[c] if c in renames else c for c in TEXT_COLUMNS if c in renames or c not in olds}


def _csv_rows(datasets: Any, path: Path, text_columns: set[str]) -> list[Any]:
    """A CSV file's rows; a text column that `datasets` infers as numbers (a column of answers) is
    read again as strings, so its values are the file's text exactly ("007", "1.50")."""
    dataset = datasets.load_dataset("csv", data_files=str(path), split="train")
    numeric = [name for name, feature in dataset.features.items() if name in text_columns
               and str(getattr(feature, "dtype", "")).startswith(("int", "uint", "float"))]
    if not numeric:
        return list(dataset)
    features = dataset.features.copy()
    for name in numeric:
        features[name] = datasets.Value("string")
    dataset = datasets.load_dataset("csv", data_files=str(path), split="train", features=features)
    _log_read_as_text(str(path), {repr(name): sum(v is not None for v in dataset[name]) for name in numeric})
    return list(dataset)


def _flag(split_flag: str | None) -> str:
    return f" ({split_flag})" if split_flag else ""


def _pick_split(splits: Mapping[str, Any], label: str, split: str, split_flag: str | None) -> Any:
    if split not in splits:
        raise UserError(f"{label}: no split {split!r}{_flag(split_flag)}; its splits: {', '.join(splits)}")
    return splits[split]


def _file_rows(path: Path, split: str, config: str | None, split_flag: str | None,
               text_columns: set[str]) -> tuple[list[Any], str | None]:
    """A single file's rows of `split`, and the split's name where the file names its splits (a
    .json object of splits); any other file holds only the split "train". `text_columns`: the
    columns read as text (`_csv_rows`)."""
    suffix = path.suffix.lower()
    if suffix not in DATA_FILE_TYPES:
        raise UserError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl, .parquet or .csv")
    if config is not None:
        raise UserError(f"{path}: a single file has no configs (--data-config {config}); drop --data-config, "
                        "or give a folder or hub dataset that defines it")
    if suffix in (".json", ".jsonl"):
        data = _read_json(path)
        if isinstance(data, dict):
            return _pick_split(data, str(path), split, split_flag), split
        rows: list[Any] = data
    else:
        datasets = import_dependency("datasets", f"{path}: reading {suffix[1:]}")
        try:
            with _quiet_datasets():
                rows = (_csv_rows(datasets, path, text_columns) if suffix == ".csv"
                        else list(datasets.load_dataset(suffix[1:], data_files=str(path), split="train")))
        except Exception as exc:  # datasets raises many types for bad files
            raise _read_failure(path, suffix[1:], exc) from None
    if split != "train":
        raise UserError(f"{path}: a single file holds only the split 'train', not {split!r}{_flag(split_flag)}; give "
                        f"a folder or hub dataset with that split, or a .json file of {{\"{split}\": [...]}}")
    return rows, None


def _saved_rows(path: Path, split: str, config: str | None, split_flag: str | None) -> tuple[list[Any], str | None]:
    """A `save_to_disk` folder's rows: a DatasetDict's split, or a saved Dataset's (its one split)."""
    datasets = import_dependency("datasets", f"{path}: reading a saved dataset folder")
    if config is not None:
        raise UserError(f"{path}: a save_to_disk folder has no configs (--data-config {config}); drop --data-config")
    try:
        with _quiet_datasets():
            dataset = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: could not load the saved dataset: {_first_line(exc)}") from None
    if isinstance(dataset, datasets.DatasetDict):
        return list(_pick_split(dataset, str(path), split, split_flag)), split
    # One split: the one it was made from (load_dataset(..., split=...)), else "train". Only that
    # name, so that a train and a test split can never both be these rows.
    name = str(dataset.split) if dataset.split else "train"
    if split != name:
        raise UserError(f"{path}: a saved Dataset holds only the split {name!r}, not {split!r}{_flag(split_flag)}; "
                        f"ask for {name!r}, or save a DatasetDict with both splits")
    return list(dataset), None if name == "train" else name


def _selection_problem(datasets: Any, name: str, split: str, config: str | None,
                       split_flag: str | None) -> str | None:
    """Why `load_dataset(name, config, split)` failed when the config or split is unknown (naming
    the ones there are), else None."""
    with _quiet_datasets():
        try:
            configs = list(datasets.get_dataset_config_names(name))
        except Exception:
            configs = []
        if config is not None and configs and config not in configs:
            return f"no config {config!r} (--data-config); its configs: {', '.join(configs)}"
        try:
            splits = list(datasets.get_dataset_split_names(name, config))
        except Exception:
            splits = []
    if not splits and config is None and len(configs) > 1:
        return f"it has configs {', '.join(configs)}; pick one with --data-config NAME"
    if splits and split not in splits:
        return f"no split {split!r}{_flag(split_flag)}; its splits: {', '.join(splits)}"
    return None


def _loaded_rows(name: str, split: str, config: str | None, split_flag: str | None, hub: bool) -> list[Any]:
    """`load_dataset(name, config, split=split)` of a folder of data files (a README.md's `configs:`
    included) or a hub name, as rows."""
    what = "loading a hub dataset" if hub else "reading a dataset folder"
    datasets = import_dependency("datasets", f"{name}: {what}")
    try:
        with _quiet_datasets():
            return list(datasets.load_dataset(name, name=config, split=split))
    except Exception as exc:  # datasets raises many types (unknown split or config, no data files, network)
        label = dataset_label(name, None, config)
        problem = _selection_problem(datasets, name, split, config, split_flag)
        if problem:
            raise UserError(f"{label}: {problem}") from None
        if hub:
            raise UserError(f"{label}: not a local file or folder, and loading it from the hub failed "
                            f"({_first_line(exc)})") from None
        raise UserError(f"{label}: folder holds no dataset ({_first_line(exc)})") from None


def rename_columns(row: dict[str, Any], renames: Mapping[str, str], where: str) -> dict[str, Any]:
    """`row` with each OLD column renamed NEW (`renames` is {NEW: OLD}; all at once, so two names may
    swap); a missing OLD column or a NEW one that exists and is not itself renamed is an error."""
    olds = set(renames.values())
    for new, old in renames.items():
        if old not in row:
            raise UserError(f"{where}: --data-columns {new}={old}: no column {old!r}; its columns: {', '.join(row)}")
        if new in row and new not in olds:
            raise UserError(f"{where}: --data-columns {new}={old}: it already has a column {new!r}; rename that "
                            f"one too (e.g. {new}_orig={new}) or choose another name")
    renamed = {key: value for key, value in row.items() if key not in olds}
    renamed.update({new: row[old] for new, old in renames.items()})
    return renamed


def load_rows(spec: str, split: str = "train", config: str | None = None, renames: Mapping[str, str] | None = None,
              split_flag: str | None = None) -> list[RawRow]:
    """The rows of one split of a dataset: a json/jsonl/parquet/csv file, a save_to_disk folder, a
    folder of data files or a hub name; `config` its config, `renames` {NEW: OLD} column renames
    applied before anything reads a row. `split_flag` is the flag errors name for the split.
    Numbers in text columns are read as their text (`numbers_as_text`)."""
    path = Path(spec).expanduser()
    if path.is_file():
        rows, named_split = _file_rows(path, split, config, split_flag, _text_columns(renames))
    elif path.is_dir():
        if any((path / f).exists() for f in SAVED_DATASET_FILES):
            rows, named_split = _saved_rows(path, split, config, split_flag)
        else:
            rows, named_split = _loaded_rows(str(path), split, config, split_flag, hub=False), split
    elif spec.startswith((".", "/", "~")) or Path(spec).suffix in DATA_FILE_TYPES:
        raise UserError(f"{spec}: file or folder not found")
    else:
        rows, named_split = _loaded_rows(spec, split, config, split_flag, hub=True), split
    out = []
    for i, data in enumerate(rows):
        row = RawRow(data, spec, i, named_split, config)
        if not isinstance(data, dict):
            raise UserError(f"{row.where}: expected an object with named fields, got {type(data).__name__}")
        if renames:
            row.data = rename_columns(data, renames, row.where)
        out.append(row)
    label = dataset_label(spec, named_split, config)
    if not out:
        raise UserError(f"{label}: no rows")
    log.info("loaded %d rows from %s", len(out), label)
    numbers_as_text([row.data for row in out], label)
    return out


def mix_rows(datasets: Sequence[list[RawRow]], weights: Sequence[float], seed: int) -> tuple[list[RawRow], int]:
    """A seeded mix of `datasets` in the shares `weights`, and how many rows it left out.

    Without replacement: as many rows as the shares allow, so the dataset that runs out first
    (fewest rows for its share) gives all its rows and bounds the total; each dataset gives a
    seeded sample of its rows, kept in their order, the datasets in order. The log names what
    each gave and left out.
    """
    if len(weights) != len(datasets):
        raise UserError(f"--data-mix: {len(weights)} weights for {len(datasets)} --data datasets; give one weight "
                        "per --data, in order")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise UserError(f"--data-mix: {','.join(f'{w:g}' for w in weights)} must all be positive numbers")
    shares = [w / sum(weights) for w in weights]
    total = min(len(rows) / share for rows, share in zip(datasets, shares))
    mixed: list[RawRow] = []
    report, left_out = [], 0
    for i, (rows, share) in enumerate(zip(datasets, shares)):
        take = min(len(rows), round(total * share))
        picked = sorted(random.Random(derive_seed(seed, "data_mix", i)).sample(range(len(rows)), take))
        mixed += [rows[j] for j in picked]
        left_out += len(rows) - take
        report.append(f"{rows[0].dataset if rows else '?'} gave {take} of {len(rows)} ({len(rows) - take} left out)")
    log.info("data mix %s: %d rows; %s", ",".join(f"{w:g}" for w in weights), len(mixed), "; ".join(report))
    return mixed, left_out


def parse_split(data_split: str) -> list[float]:
    """'2,4,4' -> [0.2, 0.4, 0.4]."""
    try:
        weights = [float(w) for w in data_split.split(",")]
    except ValueError:
        raise UserError(f"--data-split {data_split!r}: expected three comma-separated numbers like 2,4,4") from None
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"--data-split {data_split!r}: expected three non-negative weights (sft,reward,ppo) like 2,4,4")
    total = sum(weights)
    return [w / total for w in weights]


def stage_share(rows: list[RawRow], data_split: str | None, stage: str, seed: int) -> list[RawRow]:
    """This stage's disjoint, seeded part of `rows` under `data_split` (all rows when None)."""
    if not data_split:
        return rows
    fractions = parse_split(data_split)
    order = list(range(len(rows)))
    # The same shuffle in every stage (same seed, same purpose), so the shares stay disjoint.
    random.Random(derive_seed(seed, "data_split")).shuffle(order)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    idx = STAGE_INDEX[stage]
    lo, hi = round(bounds[idx] * len(rows)), round(bounds[idx + 1] * len(rows))
    share = [rows[i] for i in sorted(order[lo:hi])]
    if not share:
        raise UserError(f"--data-split {data_split}: the {stage} stage gets no rows out of {len(rows)}")
    log.info("data split %s: %s stage takes %d of %d rows", data_split, stage, len(share), len(rows))
    return share


def eval_holdout(items: list[Any], eval_split: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Split items into (train, eval) with a seeded `eval_split` fraction held out."""
    if eval_split <= 0:
        return items, []
    if eval_split >= 1:
        raise UserError(f"--eval-split {eval_split}: must be a fraction below 1")
    order = list(range(len(items)))
    random.Random(derive_seed(seed, "eval_holdout")).shuffle(order)
    n_eval = max(1, round(eval_split * len(items)))
    eval_idx = set(order[:n_eval])
    train = [x for i, x in enumerate(items) if i not in eval_idx]
    held = [x for i, x in enumerate(items) if i in eval_idx]
    if not train:
        raise UserError(f"--eval-split {eval_split}: leaves no training rows")
    return train, held
