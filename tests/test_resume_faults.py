"""`--resume` never loses or misstates work: a finished run is left untouched, a broken `latest`
falls back to the newest complete checkpoint, rows of steps that run again are dropped, and a
config change is refused (except the fields documented as safe in `RESUME_SAFE_FIELDS`).

Tiny Llama SFT runs (a few seconds each); one finished run with checkpoints at steps 2, 4, 6 is
built once per module and copied by each test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlhf.cli import main
from rlhf.engine.checkpoint import METADATA, Checkpointer, checkpoint_step, is_complete
from tests.conftest import read_metrics, run_cli, train_losses

ARGS = ["--max-steps", "6", "--lr", "3e-3", "--report-to", "none", "--optimizer-impl", "torch",
        "--lr-scheduler", "constant", "--dtype", "fp32", "--micro-batch-size", "8"]
CHECKPOINTED = [*ARGS, "--save-interval", "2", "--keep-checkpoints", "3"]


def sft_args(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--output", str(output), *extra]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and modification time: equal snapshots mean nothing was rewritten."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cut_back(run: Path, copy: Path, latest: str) -> Path:
    """A copy of a finished run as if killed before its export: no model, summary or DONE."""
    shutil.copytree(run, copy)
    for name in ("model", "DONE", "summary.json"):
        path = copy / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (copy / "checkpoints" / "latest").write_text(latest)
    return copy


@pytest.fixture(scope="module")
def finished(tiny_model_dirs, sft_data, tmp_path_factory, one_thread) -> Path:
    """A finished 6-step run with checkpoints after steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("resume") / "full"
    main(sft_args(tiny_model_dirs["llama"], sft_data, out, *CHECKPOINTED))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{s:08d}" for s in (2, 4, 6)]
    return out


def test_resume_on_a_finished_run_says_so_and_changes_nothing(finished, tiny_model_dirs, sft_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    done = run_cli([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "already finished" in line]
    assert len(lines) == 1 and str(run) in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert snapshot(run) == before


def test_broken_latest_resumes_from_the_newest_complete_checkpoint(finished, tiny_model_dirs, sft_data, tmp_path):
    # Killed during step 6's save (its DCP index missing), with `latest` naming a step that is gone.
    run = cut_back(finished, tmp_path / "run", latest="step_00000009")
    (run / "checkpoints" / "step_00000006" / METADATA).unlink()
    rows = read_metrics(run)
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "before": True}) + "\n" for r in rows))
    main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    rows = read_metrics(run)
    # Rows up to step 4 are the killed run's (kept: the run did not start over), 5-6 are new.
    assert [(r["step"], r.get("before", False)) for r in rows] == [(1, True), (2, True), (3, True), (4, True),
                                                                   (5, False), (6, False)]
    assert train_losses(run) == pytest.approx(train_losses(finished), abs=1e-6)
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    assert [checkpoint_step(p) for p in checkpoints] == [2, 4, 6] and all(is_complete(p) for p in checkpoints)
    assert (run / "checkpoints" / "latest").read_text() == "step_00000006"
    x, y = load_file(finished / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert json.loads((run / "summary.json").read_text())["train_loss"] == pytest.approx(train_losses(finished)[-1])


def test_killed_before_the_first_checkpoint_then_resumed_logs_each_step_once(tiny_model_dirs, sft_data, tmp_path,
                                                                             one_thread):
    run = tmp_path / "run"
    main(sft_args(tiny_model_dirs["llama"], sft_data, run, *ARGS, "--max-steps", "3"))
    first = train_losses(run)
    for name in ("model", "DONE", "summary.json"):  # killed after step 3's row, before the export
        path = run / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (run / "samples.jsonl").write_text("".join(json.dumps({"step": s, "table": "samples"}) + "\n" for s in (1, 2)))
    main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *ARGS, "--max-steps", "3"), "--resume"])
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert train_losses(run) == pytest.approx(first, abs=1e-6)
    assert (run / "samples.jsonl").read_text() == ""
    assert (run / "DONE").is_file()


def test_a_changed_config_is_refused_with_the_changed_fields(finished, tiny_model_dirs, sft_data, tmp_path, capsys):
    model = tiny_model_dirs["llama"]
    for run in (cut_back(finished, tmp_path / "cut", latest="step_00000004"), tmp_path / "done"):
        if not run.exists():
            shutil.copytree(finished, run)
        before = snapshot(run)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main([*sft_args(model, sft_data, run, *CHECKPOINTED, "--lr", "1e-2", "--micro-batch-size", "4",
                            "--seed", "7"), "--resume"])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: --resume"), err
        for change in ("--lr 0.003 -> 0.01", "--micro-batch-size 8 -> 4", "--seed 42 -> 7"):
            assert change in err, err
        assert snapshot(run) == before


def test_safe_changes_are_accepted_and_extend_a_finished_run(finished, tiny_model_dirs, sft_data, tmp_path):
    model = tiny_model_dirs["llama"]
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    # A larger --max-steps plus other fields documented as safe (checkpointing, tracking).
    main([*sft_args(model, sft_data, run, *CHECKPOINTED, "--max-steps", "8", "--save-interval", "4",
                    "--keep-checkpoints", "2", "--run-name", "longer"), "--resume"])
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert train_losses(run)[:6] == train_losses(finished)
    assert json.loads((run / "summary.json").read_text())["steps"] == 8 and (run / "DONE").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 8
    # A finished run that kept no checkpoint cannot be extended: refused, nothing changed.
    bare = tmp_path / "bare"
    shutil.copytree(finished, bare)
    shutil.rmtree(bare / "checkpoints")
    before = snapshot(bare)
    with pytest.raises(SystemExit) as exc:
        main([*sft_args(model, sft_data, bare, *CHECKPOINTED, "--max-steps", "8"), "--resume"])
    assert exc.value.code == 2 and snapshot(bare) == before


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    (path / "host_rank0.pt").write_bytes(b"host")
    if complete:
        (path / METADATA).write_bytes(b"index")
    return path


@pytest.mark.parametrize("latest", [None, "step_00000030", "step_00000025", "", "../x", b"\xff\xfe"])
def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, latest):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 25, complete=False)
    (root / "step_00000040.tmp").mkdir()  # an interrupted save
    if isinstance(latest, bytes):
        (root / "latest").write_bytes(latest)
    elif latest is not None:
        (root / "latest").write_text(latest)
    assert Checkpointer(root, ctx=None).latest() == root / "step_00000020"  # type: ignore[arg-type]
    (root / "latest").write_text("step_00000010")  # a complete checkpoint named by `latest` is honoured
    assert Checkpointer(root, ctx=None).latest() == root / "step_00000010"  # type: ignore[arg-type]
    assert Checkpointer(tmp_path / "none", ctx=None).latest() is None  # type: ignore[arg-type]


def test_pruning_keeps_every_checkpoint_a_resume_could_use(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 15, 20):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 12, complete=False)  # damaged: no resume can load it
    (root / "step_00000018.tmp").mkdir()
    (root / "step_00000003.old").mkdir()  # a deletion cut short
    # Resumed from step 15 (e.g. `latest` named it), step 16 just saved, keep 2: 15 and 16 stay,
    # 5 goes, and 20 (after the saved step) is left for the rerun to replace.
    _fake_checkpoint(root, 16)
    Checkpointer(root, ctx=None, keep=2)._prune(16)  # type: ignore[arg-type]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000015", "step_00000016", "step_00000020"]


def test_resume_on_a_finished_ppo_run_changes_nothing(tiny_model_dirs, tmp_path, one_thread):
    """PPO's summary (all of the last iteration's metrics) survives a --resume of the finished run."""
    (tmp_path / "length.py").write_text("def reward(prompt, response):\n    return float(len(response))\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    run = tmp_path / "ppo"
    args = ["ppo", "--actor", str(tiny_model_dirs["llama"]), "--reward-fn", f"{tmp_path / 'length.py'}:reward",
            "--advantage-estimator", "grpo", "--samples-per-prompt", "2", "--generation-batch-size", "4",
            "--max-new-tokens", "4", "--max-steps", "1", "--data", str(prompts), "--output", str(run),
            "--report-to", "none", "--optimizer-impl", "torch"]
    main(args)
    before = snapshot(run)
    with pytest.raises(SystemExit) as exc:
        main([*args, "--resume"])
    assert exc.value.code == 0 and snapshot(run) == before
