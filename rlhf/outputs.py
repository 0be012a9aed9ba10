"""The output contract of every stage:

    <output>/model/  config.yaml  metrics.jsonl  summary.json  checkpoints/  DONE

DONE is written last and atomically; a folder holding a run is never overwritten without --resume.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from rlhf.config import TUNING_SECTIONS, leaf_fields, save_config, to_dict
from rlhf.engine.fileio import replace_file
from rlhf.errors import UserError
from rlhf.output_lock import lock_output

DONE = "DONE"


def is_done(output: str | Path) -> bool:
    return (Path(output) / DONE).is_file()


def prepare_output(output: str | Path, resume: bool) -> Path:
    """Create the output folder and take its lock (rlhf/output_lock.py; the caller releases it
    when it refuses the folder); refuse a folder another run holds, one that holds a run unless
    resuming, and one with a symlink out of it."""
    if not str(output):
        raise UserError("--output is required: the folder this stage writes to")
    path = create_folder(Path(output))
    lock_output(path)
    refuse_links_out(path)
    holds_run = any((path / n).exists() for n in ("metrics.jsonl", "checkpoints", "model", DONE))
    if holds_run and not resume:
        raise UserError(
            f"--output {path}: already holds a run; pass --resume to continue it, or choose another --output"
        )
    return path


def create_folder(path: Path, what: str = "--output") -> Path:
    """`path` as an existing folder (created with its parents); one line for a file there or a
    symlink to nothing (other errors, a read-only parent, are the CLI's one line for them)."""
    if path.is_symlink() and not path.exists():
        raise UserError(f"{what} {path}: a symbolic link to {os.readlink(path)}, which does not exist; create "
                        f"that folder, remove the link, or choose another {what}")
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a folder above it is a file or a link to nothing
        raise UserError(f"{what} {path}: cannot create the folder (a folder above it is a file or a symbolic link "
                        f"to nothing); choose another {what}") from None
    return path


def refuse_links_out(folder: Path, what: str = "--output") -> None:
    """One line for a symbolic link in `folder` (at any depth, not followed) that leads out of
    it: the run would write, or append, to wherever it points. Links that stay inside are kept."""
    root = os.path.realpath(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            link = Path(dirpath) / name
            if not link.is_symlink():
                continue
            target = os.path.realpath(link)
            if os.path.commonpath([root, target]) != root:
                raise UserError(f"{what} {folder}: {link.relative_to(folder)} is a symbolic link to "
                                f"{os.readlink(link)}, outside the folder; a run writes only inside its folder: "
                                "remove the link")


NON_FINITE = "non_finite"
"""The key listing which fields of a JSON object were NaN/inf (and are written as null)."""


def _finite_or_none(value: Any, path: str, flagged: list[str]) -> Any:
    """`value` with every NaN/inf float (nested too) replaced by None; their dotted paths appended
    to `flagged`. Scalar tensors and numpy numbers become Python numbers first."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        flagged.append(path)
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v, f"{path}.{k}" if path else str(k), flagged) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v, f"{path}.{i}" if path else str(i), flagged) for i, v in enumerate(value)]
    return value


def strict_json(data: Any, indent: int | None = None) -> str:
    """JSON that every parser reads: NaN/inf become null, and an object lists their fields under
    `non_finite` (e.g. {"loss": null, "non_finite": ["loss"]}); never a bare NaN or Infinity."""
    flagged: list[str] = []
    clean = _finite_or_none(data, "", flagged)
    if flagged and isinstance(clean, dict):
        earlier = clean.get(NON_FINITE)
        clean[NON_FINITE] = [*(earlier if isinstance(earlier, list) else []), *flagged]
    return json.dumps(clean, indent=indent, default=str, allow_nan=False)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(strict_json(data, indent=2) + "\n")
    replace_file(tmp, path)


def write_config(output: Path, config: Any) -> None:
    tmp = output / "config.yaml.tmp"
    save_config(config, tmp)
    replace_file(tmp, output / "config.yaml")


# The fields `--resume` may change. Every other field must equal the run's saved config (the one
# inside the checkpoint it resumes from, else config.yaml), since a resumed run must continue the
# run it resumes (same weights, data order and schedule); a changed one is refused with the list
# of changes. Each entry says why changing it is safe.
RESUME_SAFE_FIELDS: dict[str, str] = {
    "resume": "the flag asking for the resume itself",
    "output": "names the run's folder, which may be reached by another path (relative, moved)",
    "max_steps": "extends (or ends earlier) the run; the LR schedule follows the new total from the checkpoint on",
    "epochs": "as max_steps, counted in passes over the data",
    "save_interval": "says when resume checkpoints are written, not what is trained",
    "save_final_checkpoint": "says whether the last step writes a resume checkpoint, not what is trained",
    "keep_checkpoints": "how many old checkpoints to keep; the newest complete one always is",
    "log_interval": "how often metrics rows are written, not what is trained",
    "report_to": "where metrics are reported",
    "wandb_project": "where metrics are reported",
    "wandb_entity": "where metrics are reported",
    "wandb_group": "where metrics are reported",
    "wandb_init_timeout": "how long W&B may take to reach its server before it logs offline",
    "reward_timeout": "how long a reward function's call may take before the run stops, not what it returns",
    "max_zero_signal_iters": "when a warning is logged, not what is trained",
    "run_name": "the tracker's name for the run",
    "max_skipped_steps": "how many non-finite steps in a row stop the run; raising it lets a stopped run go on",
    "dist_timeout": "how long a collective may wait before the run stops, not what is trained",
    "compile": "how the layers run (torch.compile), not what they compute",
    "export_adapter": "what the finished run writes (adapter or merged model), not what is trained",
}


def read_saved_config(output: str | Path) -> dict[str, Any]:
    """The run's config.yaml as plain data; {} when the run never wrote one (killed that early)."""
    path = Path(output) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"{path}: not readable YAML ({first}); restore it or choose another --output") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a mapping of config fields; restore it or choose another --output")
    return data


def config_as_saved(config: Any) -> dict[str, Any]:
    """`config` as plain data, as config.yaml reads back (a YAML round trip): what a checkpoint
    stores and what `resume_config_changes` compares."""
    return yaml.safe_load(yaml.safe_dump(to_dict(config), sort_keys=False))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resume_config_changes(saved: dict[str, Any], config: Any) -> list[str]:
    """`--flag old -> new` for each field of `config` that differs from the run's saved config
    (`saved`: a checkpoint's, or config.yaml), outside RESUME_SAFE_FIELDS and the device backends'
    sections (TUNING_SECTIONS: how a device runs the models, not what they compute). Values are compared as
    config.yaml holds them (a YAML round trip); a field `saved` lacks (an older version's) is not
    compared."""
    current = config_as_saved(config)
    changes = []
    for info in leaf_fields(type(config)):
        if info.name in RESUME_SAFE_FIELDS or info.section in TUNING_SECTIONS:
            continue
        old_section = saved.get(info.section, {}) if info.section else saved
        new_section = current[info.section] if info.section else current
        if not isinstance(old_section, dict) or info.name not in old_section:
            continue
        if old_section[info.name] != new_section[info.name]:
            changes.append(f"{info.flag} {_short(old_section[info.name])} -> {_short(new_section[info.name])}")
    return changes


def write_summary(output: Path, summary: dict[str, Any]) -> None:
    write_json_atomic(output / "summary.json", summary)


def read_summary(output: str | Path) -> dict[str, Any]:
    path = Path(output) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def mark_done(output: Path) -> None:
    tmp = output / f"{DONE}.tmp"
    tmp.write_text("ok\n")
    replace_file(tmp, output / DONE)


def unmark_done(output: Path) -> None:
    """A finished run that `--resume` extends (a larger --max-steps or --epochs) is unfinished again
    until its new end: without DONE, an interruption leaves it resumable and e2e does not skip it."""
    (output / DONE).unlink(missing_ok=True)
