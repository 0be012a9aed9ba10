"""Experiment tracking: metrics.jsonl always; W&B (offline without credentials, or when its server
cannot be reached within --wandb-init-timeout seconds) and TensorBoard."""

from __future__ import annotations

import errno
import json
import math
import netrc
import os
from pathlib import Path
from typing import Any

from rlhf.config import TrackingConfig
from rlhf.engine.fileio import replace_file
from rlhf.errors import UserError, first_line, import_dependency
from rlhf.logging import get_logger
from rlhf.outputs import strict_json

log = get_logger(__name__)

TRACKERS = ("wandb", "tensorboard", "none")


def parse_report_to(report_to: str) -> list[str]:
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    for n in names:
        if n not in TRACKERS:
            raise UserError(f"--report-to {report_to!r}: unknown tracker {n!r}; use wandb, tensorboard or none")
    return [n for n in names if n != "none"]


def wandb_mode() -> str:
    """WANDB_MODE if set; else online when an API key is configured, offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def init_wandb(wandb: Any, init_timeout: float, **kwargs: Any) -> tuple[Any, str]:
    """`wandb.init(**kwargs)` in `wandb_mode()` and that mode. An online run that fails to start
    within `init_timeout` seconds (no network, a wrong WANDB_BASE_URL, a rejected key: W&B's own
    wait is 90 s, then a traceback) starts offline instead, with one warning: training never
    fails for want of the tracker, and `wandb sync` uploads the run later."""
    mode = wandb_mode()
    if mode != "online":
        return wandb.init(mode=mode, **kwargs), mode
    try:
        return wandb.init(mode=mode, settings=wandb.Settings(init_timeout=init_timeout), **kwargs), mode
    except Exception as exc:  # wandb's CommError, UsageError, AuthenticationError, ...
        reason = f"{type(exc).__name__}: {first_line(exc)}"
    run = wandb.init(mode="offline", **kwargs)
    folder = Path(run.dir).parent
    log.warning("W&B: no online run within %g s (--wandb-init-timeout; %s); logging offline to %s instead, "
                "`wandb sync %s` uploads it later", init_timeout, reason[:200], folder, folder)
    return run, "offline"


def _jsonable(value: Any) -> Any:
    """A tensor or numpy scalar as a Python number; NaN/inf stay floats until `strict_json` writes
    them as null (flagged under "non_finite") or the trackers drop them."""
    if hasattr(value, "item"):
        value = value.item()
    return value


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class MetricsFile:
    """Appends one JSON object per logged step to metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> int:
        """On resume: drop rows logged after `step` (they will be logged again); returns how many.
        A line that is not a JSON object (the torn last line a kill mid-append leaves) is dropped
        too, counted in a warning with its line numbers."""
        if not self.path.is_file():
            return 0
        kept, dropped, torn = [], 0, []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                torn.append(number)
            elif row.get("step", 0) > step:
                dropped += 1
            else:
                kept.append(line)
        if torn:
            log.warning("resume: %s: %d unreadable row%s dropped (line %s; the torn write a killed run leaves)",
                        self.path.name, len(torn), "" if len(torn) == 1 else "s", ", ".join(map(str, torn[:10])))
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.unlink(missing_ok=True)  # never written through a link left at the temporary name
        tmp.write_text("".join(f"{k}\n" for k in kept))
        replace_file(tmp, self.path)
        return dropped

    def write(self, row: dict[str, Any]) -> None:
        with open_append(self.path) as f:
            f.write(strict_json({k: _jsonable(v) for k, v in row.items()}) + "\n")


def open_append(path: Path) -> Any:
    """`path` opened for appending text, refusing (one line) to follow a symbolic link there: a
    link placed in the output folder would make the run write outside it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UserError(f"{path}: is a symbolic link (to {os.readlink(path)}); a run writes only inside its "
                        "output folder: remove the link") from None
    return os.fdopen(fd, "a")


class Tracker:
    """One stage's trackers. Only rank 0 writes; other ranks' calls are no-ops."""

    def __init__(
        self, output: Path, stage: str, config: TrackingConfig, full_config: dict[str, Any], is_main: bool
    ) -> None:
        self.stage = stage
        self.is_main = is_main
        self.config = config
        self.metrics = MetricsFile(output / "metrics.jsonl")
        self._wandb: Any = None
        self._tb: Any = None
        if not is_main:
            return
        names = parse_report_to(config.report_to)
        run_name = config.run_name or f"{stage}-{output.resolve().name}"
        if "wandb" in names:
            wandb = import_dependency("wandb", "--report-to wandb",
                                      instead="--report-to none (metrics.jsonl is written either way)")
            self._wandb, mode = init_wandb(
                wandb, config.wandb_init_timeout, project=config.wandb_project, entity=config.wandb_entity,
                name=run_name, group=config.wandb_group, job_type=stage, config=full_config, dir=str(output),
                reinit="finish_previous",
            )
            log.info("W&B run %s (%s mode) in %s", run_name, mode, self._wandb.dir)
        if "tensorboard" in names:
            try:  # the optional tensorboard package ([tensorboard] extra), for --report-to tensorboard only
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
            self._tb = SummaryWriter(log_dir=str(output / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.is_main:
            return
        row = {"step": step, "stage": self.stage, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.metrics.write(row)
        numeric = {f"{self.stage}/{k}": v for k, v in row.items() if _finite_number(v) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Sample generations etc.: a W&B table (and a JSON line in samples.jsonl)."""
        if not self.is_main:
            return
        with open_append(self.metrics.path.parent / "samples.jsonl") as f:
            for r in rows:
                f.write(strict_json({"step": step, "table": name, **dict(zip(columns, r))}) + "\n")
        if self._wandb is not None:
            import wandb  # loaded by __init__ for --report-to wandb (seconds to import: no other run loads it)

            self._wandb.log({f"{self.stage}/{name}": wandb.Table(columns=columns, data=rows)}, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.is_main and self._wandb is not None:
            for k, v in values.items():
                v = _jsonable(v)
                self._wandb.summary[k] = None if isinstance(v, float) and not math.isfinite(v) else v

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
