"""Learning curves of an RL run, read back from its metrics.jsonl: held-out success and mean reward
against iterations and against wall-clock seconds.

    rlhf report runs/ppo          the curve as a table (an e2e run folder: its ppo/ stage)
    <output>/curves.png           drawn by `rlhf ppo` when it finishes (pip install 'rlhf[plots]')

The series: `eval/<name>` (each held-out reward function's mean greedy score, on the rows where an
evaluation ran) and `eval_reward` (their weighted sum), `score_mean` (the mean rollout reward, on
every PPO row), and the seconds of `elapsed_s`. Files written before `elapsed_s` existed get their
seconds from the phase times instead (`PHASE_SECONDS`), or none. matplotlib is optional: without
it `write_curves` says how to get it and draws nothing, and nothing here may fail a finished run:
an unreadable line is skipped and counted in one warning.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.engine.fileio import replace_file
from rlhf.errors import UserError
from rlhf.logging import get_logger

log = get_logger(__name__)

METRICS = "metrics.jsonl"
CURVES_PNG = "curves.png"
RL_STAGE = "ppo"
"""The stage of an e2e run folder that has a learning curve."""

EVAL_PREFIX = "eval/"
EVAL_TOTAL = "eval_reward"
REWARD = "score_mean"
ELAPSED = "elapsed_s"
PHASE_SECONDS = ("generation_s", "reward_s", "experience_s", "training_s")
"""One iteration's phase times: their running sum stands in for `elapsed_s` in older files."""

PLOTS_HINT = "pip install 'rlhf[plots]'"


@dataclass(frozen=True)
class CurvePoint:
    """One logged step: `evals` holds the eval keys of this step only (empty: no evaluation ran)."""

    step: int
    seconds: float | None
    score_mean: float | None
    evals: dict[str, float | None]


@dataclass(frozen=True)
class Curves:
    """A run's learning curve, one point per logged step in step order."""

    metrics_path: Path
    points: list[CurvePoint]
    eval_names: list[str]
    """`eval/<name>` keys in the order they first appear, then `eval_reward` where it was logged."""
    seconds_source: str | None
    """`elapsed_s`, `phase seconds` (the running sum of PHASE_SECONDS: an estimate) or None (step only)."""
    skipped_lines: int

    @property
    def is_empty(self) -> bool:
        return not any(p.score_mean is not None or p.evals for p in self.points)

    def reward_series(self) -> tuple[list[int], list[float | None], list[float]]:
        """(steps, seconds, score_mean) of the steps that logged a mean reward."""
        points = [p for p in self.points if p.score_mean is not None]
        return [p.step for p in points], [p.seconds for p in points], [float(p.score_mean or 0.0) for p in points]

    def eval_series(self, name: str) -> tuple[list[int], list[float | None], list[float]]:
        """(steps, seconds, value) of the evaluations that logged `name` as a number."""
        points = [p for p in self.points if p.evals.get(name) is not None]
        return [p.step for p in points], [p.seconds for p in points], [float(p.evals[name] or 0.0) for p in points]

    def table_evals(self) -> list[str]:
        """The eval columns worth a column: `eval_reward` only when it sums more than one function."""
        functions = [n for n in self.eval_names if n != EVAL_TOTAL]
        return self.eval_names if len(functions) > 1 else functions or self.eval_names


def _number(value: Any) -> float | None:
    """A finite number as float; None for null (a NaN that strict_json wrote), text, bools."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The JSON objects with an integer `step`, and the line numbers of the others: a run killed
    mid-append leaves a torn last line, and the curve of everything before it still counts."""
    rows, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        else:
            bad.append(number)
    return rows, bad


def _merged_by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, in step order: a step logged twice (an evaluation apart from its
    iteration's row) is one point of the curve."""
    merged: dict[int, dict[str, Any]] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return [merged[step] for step in sorted(merged)]


def _seconds(rows: list[dict[str, Any]]) -> tuple[list[float | None], str | None]:
    """Each row's seconds since training started, and where they came from. The phase-time sum
    counts a logged iteration once per iteration since the previous logged row (--log-interval > 1
    logs every Nth): exact when every iteration is logged, an estimate otherwise."""
    if any(_number(r.get(ELAPSED)) is not None for r in rows):
        return [0.0 if r["step"] == 0 else _number(r.get(ELAPSED)) for r in rows], ELAPSED
    if not any(any(_number(r.get(k)) is not None for k in PHASE_SECONDS) for r in rows):
        return [None] * len(rows), None
    seconds: list[float | None] = []
    total, previous_step = 0.0, 0
    for row in rows:
        phases = [_number(row.get(k)) for k in PHASE_SECONDS]
        if any(p is not None for p in phases):
            total += sum(p or 0.0 for p in phases) * max(row["step"] - previous_step, 1)
            previous_step = row["step"]
        seconds.append(total)
    return seconds, "phase seconds"


def _eval_names(rows: list[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(k for r in rows for k in r if k.startswith(EVAL_PREFIX)))
    return names + ([EVAL_TOTAL] if any(EVAL_TOTAL in r for r in rows) else [])


def learning_curves(run_dir: str | Path) -> Curves:
    """The learning curve of the stage folder `run_dir` (its metrics.jsonl must exist: see
    `find_rl_stage` for the folder a user names)."""
    path = Path(run_dir) / METRICS
    rows, bad = read_rows(path)
    if bad:
        log.warning("%s: %d unreadable line%s skipped (line %s)", path, len(bad), "" if len(bad) == 1 else "s",
                    ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""))
    rows = _merged_by_step(rows)
    seconds, source = _seconds(rows)
    names = _eval_names(rows)
    points = [CurvePoint(step=r["step"], seconds=s, score_mean=_number(r.get(REWARD)),
                         evals={n: _number(r[n]) for n in names if n in r})
              for r, s in zip(rows, seconds)]
    return Curves(metrics_path=path, points=points, eval_names=names, seconds_source=source, skipped_lines=len(bad))


def find_rl_stage(run_dir: str | Path) -> tuple[Path, str | None]:
    """The stage folder to report for `run_dir` (a stage's --output, or an e2e run folder: its
    ppo/), and a note naming the stage when it was an e2e folder; one UserError line otherwise."""
    folder = Path(run_dir)
    if (folder / METRICS).is_file():
        return folder, None
    if (folder / RL_STAGE / METRICS).is_file():
        return folder / RL_STAGE, f"{folder}: an e2e run folder; its RL stage {RL_STAGE}/ is reported"
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder; pass a ppo --output folder or an e2e run folder")
    if (folder / RL_STAGE).is_dir():
        raise UserError(f"{folder}: its {RL_STAGE}/ stage has logged nothing yet (no {RL_STAGE}/{METRICS}); "
                        "report it once its first iteration is logged")
    raise UserError(f"{folder}: has no {METRICS} (nor {RL_STAGE}/{METRICS}); pass a ppo --output folder or an "
                    "e2e run folder")


def curve_table(curves: Curves) -> list[dict[str, int | float | None]]:
    """One row per logged step: step, seconds, score_mean, and each eval column (None where no
    evaluation ran at that step, or its value was not a number)."""
    evals = curves.table_evals()
    return [{"step": p.step, "seconds": p.seconds, REWARD: p.score_mean, **{n: p.evals.get(n) for n in evals}}
            for p in curves.points]


def _cell(key: str, value: int | float | None) -> str:
    if value is None:
        return "-"
    if key == "step":
        return str(value)
    return f"{value:.1f}" if key == "seconds" else f"{value:.4f}"


def format_table(rows: list[dict[str, int | float | None]]) -> list[str]:
    """The rows as aligned text lines under a header; `-` marks a step with no value there."""
    if not rows:
        return []
    headers = {k: "mean reward" if k == REWARD else k for k in rows[0]}
    cells = [[_cell(k, row[k]) for k in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers.values())]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers.values(), widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return lines


def _plot_modules() -> tuple[Any, Any] | None:
    """matplotlib's Figure and Agg canvas, or None when it is not installed (an optional
    dependency: the figure API, never pyplot, so no global backend is switched in the process)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional dependency: rlhf[plots]
        from matplotlib.figure import Figure  # optional dependency: rlhf[plots]
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def _draw_panel(ax: Any, curves: Curves, names: list[str], by_seconds: bool, ylabel: str) -> None:
    """One panel: each named series (REWARD or eval keys) against steps or seconds."""
    drawn = False
    for name in names:
        steps, seconds, values = curves.reward_series() if name == REWARD else curves.eval_series(name)
        xs = seconds if by_seconds else steps
        pairs = [(x, v) for x, v in zip(xs, values) if x is not None]
        if pairs:
            ax.plot(*zip(*pairs), marker="o" if name != REWARD else None, markersize=3,
                    label="mean reward" if name == REWARD else name)
            drawn = True
    if not drawn:
        what = "no wall-clock seconds in metrics.jsonl" if by_seconds and curves.seconds_source is None else (
            "no mean reward logged" if REWARD in names else "no held-out evaluation (--eval-data)")
        ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes)
    elif len(names) > 1:
        ax.legend(fontsize="small")
    source = "" if curves.seconds_source in (None, ELAPSED) else f" ({curves.seconds_source}, estimate)"
    ax.set_xlabel(f"seconds{source}" if by_seconds else "step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def write_curves(run_dir: str | Path) -> Path | None:
    """Draw `run_dir`/curves.png from its metrics.jsonl (held-out success and mean reward, each
    against steps and seconds), written atomically; None, with one info line, when matplotlib is
    missing or there is no curve to draw."""
    modules = _plot_modules()
    if modules is None:
        log.info("curves.png skipped: %s", PLOTS_HINT)
        return None
    curves = learning_curves(run_dir)
    if curves.is_empty:
        log.info("curves.png skipped: %s has no %s or %s* rows", curves.metrics_path, REWARD, EVAL_PREFIX)
        return None
    figure_class, canvas_class = modules
    figure = figure_class(figsize=(11, 7.5), layout="constrained")
    canvas_class(figure)
    axes = figure.subplots(2, 2, sharey="row")
    evals = curves.table_evals()
    for column, by_seconds in enumerate((False, True)):
        _draw_panel(axes[0][column], curves, evals, by_seconds, "held-out score")
        _draw_panel(axes[1][column], curves, [REWARD], by_seconds, "mean reward (score_mean)")
    figure.suptitle(f"{curves.metrics_path.parent.name}: learning curves")
    path = Path(run_dir) / CURVES_PNG
    tmp = path.with_name(path.name + ".tmp")
    try:
        figure.savefig(tmp, format="png", dpi=100)
        replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("learning curves: %s", path)
    return path
