"""Learning curves (rlhf/curves.py): curves.png from a metrics.jsonl, the table of `rlhf report
RUN_DIR` (a stage folder or an e2e run folder), a torn line skipped and counted, the phase-time
fallback for files without elapsed_s, no matplotlib -> no figure and no error, and a real PPO run
drawing its curves.png when it finishes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf.cli import cli, main
from rlhf.curves import CURVES_PNG, curve_table, learning_curves, write_curves
from tests.conftest import write_jsonl
from tests.test_critic_free import ANSWER_REWARD, grpo_args

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def ppo_rows() -> list[dict]:
    """Step 0: the starting model's evaluation alone; steps 1-4: iterations, evaluated at 2 and 4."""
    rows: list[dict] = [{"step": 0, "stage": "ppo", "eval/a": 0.25, "eval/b": 0.5, "eval_reward": 0.75, "eval_s": 0.1}]
    for step in range(1, 5):
        row = {"step": step, "stage": "ppo", "score_mean": 0.1 * step, "elapsed_s": 2.0 * step, "generation_s": 1.0}
        if step % 2 == 0:
            row.update({"eval/a": 0.25 + 0.1 * step, "eval/b": 0.5, "eval_reward": 0.75 + 0.1 * step, "eval_s": 0.1})
        rows.append(row)
    return rows


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "ppo"
    folder.mkdir()
    write_jsonl(folder / "metrics.jsonl", ppo_rows())
    return folder


def check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 0 and image.shape[1] > 0


def test_write_curves_draws_a_png_atomically(run_dir: Path) -> None:
    path = write_curves(run_dir)
    assert path == run_dir / CURVES_PNG
    check_png(path)
    assert sorted(p.name for p in run_dir.iterdir()) == [CURVES_PNG, "metrics.jsonl"]  # no .tmp left


def test_the_table_has_a_row_per_step_and_marks_unevaluated_steps(run_dir: Path) -> None:
    rows = curve_table(learning_curves(run_dir))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert list(rows[0]) == ["step", "seconds", "score_mean", "eval/a", "eval/b", "eval_reward"]
    assert rows[0] == {"step": 0, "seconds": 0.0, "score_mean": None, "eval/a": 0.25, "eval/b": 0.5,
                       "eval_reward": 0.75}
    assert rows[1] == {"step": 1, "seconds": 2.0, "score_mean": 0.1, "eval/a": None, "eval/b": None,
                       "eval_reward": None}
    assert rows[4]["eval/a"] == pytest.approx(0.65) and rows[4]["seconds"] == 8.0
    assert rows[4]["score_mean"] == pytest.approx(0.4)


def test_one_eval_function_gets_no_eval_reward_column(tmp_path: Path) -> None:
    rows = [{"step": 1, "score_mean": 0.5, "eval/a": 0.2, "eval_reward": 0.2}]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    assert curve_table(learning_curves(tmp_path)) == [{"step": 1, "seconds": None, "score_mean": 0.5, "eval/a": 0.2}]


def test_without_elapsed_s_seconds_are_the_running_sum_of_phase_times(tmp_path: Path) -> None:
    phases = {"generation_s": 1.0, "reward_s": 0.5, "experience_s": 0.25, "training_s": 0.25}
    # --log-interval 2: step 2 stands for iterations 1 and 2
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 2, "score_mean": 0.1, **phases},
                                             {"step": 3, "score_mean": 0.2, **phases}])
    curves = learning_curves(tmp_path)
    assert [p.seconds for p in curves.points] == [4.0, 6.0] and curves.seconds_source == "phase seconds"
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "score_mean": 0.1}])
    assert learning_curves(tmp_path).points[0].seconds is None


def test_a_torn_line_is_skipped_and_counted(run_dir: Path, log_records) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "score_me')
    curves = learning_curves(run_dir)
    assert curves.skipped_lines == 1 and [p.step for p in curves.points] == [0, 1, 2, 3, 4]
    assert any("1 unreadable line skipped (line 6)" in r.getMessage() for r in log_records)
    assert write_curves(run_dir) is not None


def test_report_run_dir_prints_the_table(run_dir: Path) -> None:
    write_curves(run_dir)
    result = CliRunner().invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["step", "seconds", "mean", "reward", "eval/a", "eval/b", "eval_reward"]
    assert lines[1].split() == ["0", "0.0", "-", "0.2500", "0.5000", "0.7500"]
    assert lines[2].split() == ["1", "2.0", "0.1000", "-", "-", "-"]
    assert lines[5].split() == ["4", "8.0", "0.4000", "0.6500", "0.5000", "1.1500"]
    assert lines[-1] == f"curves: {run_dir / CURVES_PNG}"
    as_json = CliRunner().invoke(cli, ["report", str(run_dir), "--json"])
    assert [json.loads(line) for line in as_json.output.splitlines()] == curve_table(learning_curves(run_dir))


def test_report_of_an_e2e_folder_names_its_ppo_stage(run_dir: Path) -> None:
    result = CliRunner().invoke(cli, ["report", str(run_dir.parent)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == f"{run_dir.parent}: an e2e run folder; its RL stage ppo/ is reported"
    assert "curves:" not in result.output  # none drawn


@pytest.mark.parametrize("make", ["missing", "empty", "sft"])
def test_report_of_a_folder_without_an_rl_curve_is_one_line(tmp_path: Path, capsys, make: str) -> None:
    folder = tmp_path / "run"
    if make != "missing":
        folder.mkdir()
    if make == "sft":
        write_jsonl(folder / "metrics.jsonl", [{"step": 1, "stage": "sft", "loss": 2.0}])
    with pytest.raises(SystemExit) as exc:
        main(["report", str(folder)])
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(folder) in err[0], err
    assert "ppo --output folder or an e2e run folder" in err[0]


def test_without_matplotlib_no_figure_and_no_error(run_dir: Path, monkeypatch, log_records) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it raises ImportError
    assert write_curves(run_dir) is None
    assert not (run_dir / CURVES_PNG).exists()
    assert [r.getMessage() for r in log_records] == ["curves.png skipped: pip install 'rlhf[plots]'"]


@pytest.mark.usefixtures("one_thread")
def test_a_ppo_run_draws_its_curves_when_it_finishes(tiny_model_dirs, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"bcd{i}", "answer": "ab"[i % 2]} for i in range(16)])
    rewards = tmp_path / "answer_reward.py"
    rewards.write_text(ANSWER_REWARD)
    out = tmp_path / "grpo"
    main([*grpo_args(tiny_model_dirs["llama"], prompts, rewards, out, "--advantage-estimator", "grpo",
                     "--max-steps", "2"), "--generation-batch-size", "8", "--samples-per-prompt", "4",
          "--micro-batch-size", "8", "--max-new-tokens", "4"])
    check_png(out / CURVES_PNG)
    assert [p.step for p in learning_curves(out).points] == [1, 2]
