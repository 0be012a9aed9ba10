"""The output contract of every stage (DESIGN.md):

    <output>/model/  config.yaml  metrics.jsonl  summary.json  checkpoints/  DONE

DONE is written last and atomically; a folder holding a run is never overwritten without --resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhf.config import save_config
from rlhf.errors import UserError

DONE = "DONE"


def is_done(output: str | Path) -> bool:
    return (Path(output) / DONE).is_file()


def prepare_output(output: str | Path, resume: bool) -> Path:
    """Create the output folder; refuse to reuse one that holds a run unless resuming."""
    if not str(output):
        raise UserError("--output is required: the folder this stage writes to")
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output {path}: exists and is not a folder")
    holds_run = path.is_dir() and any((path / n).exists() for n in ("metrics.jsonl", "checkpoints", "model", DONE))
    if holds_run and not resume:
        raise UserError(
            f"--output {path}: already holds a run; pass --resume to continue it, or choose another --output"
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_config(output: Path, config: Any) -> None:
    tmp = output / "config.yaml.tmp"
    save_config(config, tmp)
    os.replace(tmp, output / "config.yaml")


def write_summary(output: Path, summary: dict[str, Any]) -> None:
    write_json_atomic(output / "summary.json", summary)


def read_summary(output: str | Path) -> dict[str, Any]:
    path = Path(output) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def mark_done(output: Path) -> None:
    tmp = output / f"{DONE}.tmp"
    tmp.write_text("ok\n")
    os.replace(tmp, output / DONE)
