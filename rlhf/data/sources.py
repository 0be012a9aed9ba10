"""Load raw rows from local files, load_from_disk folders, or hub names; split them between stages."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import UserError, import_dependency
from rlhf.logging import get_logger
from rlhf.seeding import derive_seed

log = get_logger(__name__)

STAGE_INDEX = {"sft": 0, "reward": 1, "ppo": 2}


@dataclass
class RawRow:
    """A row as stored, with where it came from (for error messages)."""

    data: dict[str, Any]
    source: str
    index: int

    @property
    def where(self) -> str:
        return f"{self.source} row {self.index}"


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


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    text = read_text_file(path)
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not text.lstrip().startswith("[")):
        rows = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path} line {line_no}: not valid JSON ({exc.msg}); fix or remove the line") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("train"), list):
        data = data["train"]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of rows (or JSON lines)")
    return data


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


def _read_failure(path: Path, kind: str, exc: Exception) -> UserError:
    """One line for a file `datasets` could not read; a byte that is not UTF-8 named by its line."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        read_text_file(path)  # raises the UserError naming the line
    return UserError(f"{path}: could not read as {kind}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


def _dataset_rows(dataset: Any, spec: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise UserError(f"{spec}: dataset has splits {list(dataset)} but no 'train' split")
        dataset = dataset["train"]
    return [dict(r) for r in dataset]


def load_rows(spec: str) -> list[RawRow]:
    """All rows of one dataset spec: a json/jsonl/parquet/csv file, a saved folder, or a hub name."""
    path = Path(spec).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".json", ".jsonl"):
            rows = _read_json_rows(path)
        elif suffix in (".parquet", ".csv"):
            load_dataset = import_dependency("datasets", f"{path}: reading {suffix[1:]}").load_dataset

            try:
                with _quiet_datasets():
                    rows = _dataset_rows(load_dataset(suffix[1:], data_files=str(path), split="train"), spec)
            except Exception as exc:  # datasets raises many types for bad files
                raise _read_failure(path, suffix[1:], exc) from None
        else:
            raise UserError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl, .parquet or .csv")
    elif path.is_dir():
        datasets = import_dependency("datasets", f"{path}: reading a dataset folder")
        load_dataset, load_from_disk = datasets.load_dataset, datasets.load_from_disk

        if any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            rows = _dataset_rows(load_from_disk(str(path)), spec)
        else:
            try:
                rows = _dataset_rows(load_dataset(str(path), split="train"), spec)
            except Exception as exc:
                raise UserError(f"{path}: folder holds no dataset ({str(exc).splitlines()[0]})") from None
    elif spec.startswith((".", "/", "~")) or Path(spec).suffix in (".json", ".jsonl", ".parquet", ".csv"):
        raise UserError(f"{spec}: file or folder not found")
    else:
        load_dataset = import_dependency("datasets", f"{spec}: loading a hub dataset").load_dataset
        try:
            rows = _dataset_rows(load_dataset(spec, split="train"), spec)
        except Exception as exc:
            raise UserError(
                f"{spec}: not a local file or folder, and loading it from the hub failed "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{spec} row {i}: expected an object with named fields, got {type(row).__name__}")
        out.append(RawRow(row, spec, i))
    if not out:
        raise UserError(f"{spec}: no rows")
    log.info("loaded %d rows from %s", len(out), spec)
    return out


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
