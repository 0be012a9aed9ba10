"""`--resume` never loses or misstates work: a finished run is left untouched, a broken `latest`
falls back to the newest complete checkpoint, rows of steps that run again are dropped, and a
config change is refused (except the fields documented as safe in `RESUME_SAFE_FIELDS`).

Resume also validates what it reads: a checkpoint that does not load (a truncated shard, random
bytes in `.metadata`, another model's shapes) is named and the one before it used; a torn last
metrics line is dropped and counted; the config is compared with the one inside the checkpoint;
and a crafted pickle (a `__reduce__` that writes a marker file) runs nothing.

Tiny Llama SFT runs (a few seconds each); one finished run with checkpoints at steps 2, 4, 6 is
built once per module and copied by each test.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlhf.cli import main
from rlhf.engine.checkpoint import METADATA, Checkpointer, checkpoint_step, is_complete
from rlhf.engine.safe_unpickle import SafeLoadPlanner, UnsafeCheckpoint, read_host_state
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


# ------------------------------------------------------------- what resume reads


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture(scope="module")
def other_model_dcp(sft_data, tmp_path_factory, one_thread) -> Path:
    """A step-2 checkpoint of a wider model (hidden size 64, not 32) trained on the same data."""
    from rlhf.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("other")
    model = save_tiny_model(root / "model", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    main(sft_args(model, sft_data, root / "run", *ARGS, "--max-steps", "2", "--save-interval", "2"))
    return root / "run" / "checkpoints" / "step_00000002"


def damage(checkpoint: Path, how: str, other: Path) -> None:
    if how == "truncated-shard":
        shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif how == "metadata-random-bytes":
        (checkpoint / METADATA).write_bytes(random.Random(0).randbytes(4096))
    else:  # another model's shards and index under this run's host state
        for path in [*checkpoint.glob("*.distcp"), checkpoint / METADATA]:
            path.unlink()
        for path in [*other.glob("*.distcp"), other / METADATA]:
            shutil.copy(path, checkpoint / path.name)


@pytest.mark.parametrize("how", ["truncated-shard", "metadata-random-bytes", "other-model"])
def test_a_checkpoint_that_does_not_load_is_named_and_the_one_before_it_used(
        how, finished, other_model_dcp, tiny_model_dirs, sft_data, tmp_path, rlhf_log):
    run = cut_back(finished, tmp_path / "run", latest="step_00000006")
    damage(run / "checkpoints" / "step_00000006", how, other_model_dcp)
    main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    named = logged(rlhf_log, "cannot be loaded")
    assert len(named) == 1 and "step_00000006" in named[0] and "earlier checkpoint, step_00000004" in named[0], named
    assert "\n" not in named[0]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    assert train_losses(run) == pytest.approx(train_losses(finished), abs=1e-6)
    x, y = load_file(finished / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_when_no_checkpoint_loads_the_run_stops_in_one_line(finished, other_model_dcp, tiny_model_dirs, sft_data,
                                                            tmp_path, capsys):
    run = cut_back(finished, tmp_path / "run", latest="step_00000006")
    for step, how in ((2, "other-model"), (4, "truncated-shard"), (6, "metadata-random-bytes")):
        damage(run / "checkpoints" / f"step_{step:08d}", how, other_model_dcp)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no checkpoint in" in errors[0], errors
    assert all(f"step_{s:08d}" in errors[0] for s in (2, 4, 6)), errors
    assert not (run / "model").exists() and not (run / "DONE").exists()


def test_a_torn_last_line_is_dropped_and_counted(finished, tiny_model_dirs, sft_data, tmp_path, rlhf_log):
    run = cut_back(finished, tmp_path / "run", latest="step_00000004")
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 7, "lo')  # killed mid-append
    (run / "samples.jsonl").write_text('{"step": 1, "table": "samples"}\n{"step": 2, "tab')
    main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    assert len(logged(rlhf_log, "metrics.jsonl: 1 unreadable row dropped (line 7")) == 1
    assert len(logged(rlhf_log, "samples.jsonl: 1 unreadable row dropped (line 2")) == 1
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    assert train_losses(run) == pytest.approx(train_losses(finished), abs=1e-6)
    assert (run / "samples.jsonl").read_text() == '{"step": 1, "table": "samples"}\n'


@pytest.mark.parametrize("config_yaml", ["edited", "deleted"])
def test_the_config_check_reads_the_checkpoint_not_config_yaml(config_yaml, finished, tiny_model_dirs, sft_data,
                                                               tmp_path, capsys):
    """`--resume --lr 1.0` after config.yaml was edited to say lr 1.0, or deleted, is still caught."""
    run = cut_back(finished, tmp_path / "run", latest="step_00000004")
    config = run / "config.yaml"
    if config_yaml == "edited":
        data = yaml.safe_load(config.read_text())
        data["engine"]["lr"] = 1.0  # as if the run had been started with --lr 1.0
        config.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        config.unlink()
    before = snapshot(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED, "--lr", "1.0"), "--resume"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--lr 0.003 -> 1.0" in err, err
    assert "the config saved in checkpoints/step_00000004" in err, err
    assert snapshot(run) == before


def test_a_checkpoint_without_a_saved_config_loads_and_is_checked_against_config_yaml(
        finished, tiny_model_dirs, sft_data, tmp_path, capsys):
    """Checkpoints written before the config was saved in them (the same torch.save host state
    without "config") load with weights_only=True; their run is checked against config.yaml."""
    run = cut_back(finished, tmp_path / "run", latest="step_00000004")
    for checkpoint in (run / "checkpoints").glob("step_*"):
        host = read_host_state(checkpoint / "host_rank0.pt")
        del host["config"]
        torch.save(host, checkpoint / "host_rank0.pt")
    with pytest.raises(SystemExit) as exc:
        main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED, "--lr", "1e-2"), "--resume"])
    assert exc.value.code == 2 and "differs from its config.yaml: --lr 0.003 -> 0.01" in capsys.readouterr().err
    main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    assert train_losses(run) == pytest.approx(train_losses(finished), abs=1e-6)


class WritesMarker:
    """Unpickled, it runs `touch <marker>`: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["host_rank0.pt", "host_rank0.pt-plain-pickle", ".metadata"])
def test_a_crafted_pickle_runs_nothing_and_stops_the_run_in_one_line(where, finished, tiny_model_dirs, sft_data,
                                                                     tmp_path, capsys):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(WritesMarker(marker)))  # the premise: unpickled freely, it runs
    assert marker.exists()
    marker.unlink()
    run = cut_back(finished, tmp_path / "run", latest="step_00000006")
    for checkpoint in (run / "checkpoints").glob("step_*"):
        if where == "host_rank0.pt":
            torch.save({"rng": WritesMarker(marker), "engines": {}, "loop": {}, "world_size": 1},
                       checkpoint / "host_rank0.pt")
        else:  # a plain pickle (torch.save's legacy format is one, protocol 2)
            (checkpoint / where.split("-")[0]).write_bytes(pickle.dumps(WritesMarker(marker), protocol=2))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "names posix.system" in errors[0] and "no checkpoint in" in errors[0], errors
    assert not marker.exists()


def test_a_crafted_non_tensor_item_in_a_shard_runs_nothing(tmp_path):
    """DCP's own planner reads a shard's non-tensor items with torch.load(weights_only=False)."""
    marker = tmp_path / "marker"
    item = io.BytesIO()
    torch.save(WritesMarker(marker), item)
    item.seek(0)
    read_item = SimpleNamespace(dest_index=SimpleNamespace(fqn="sft.optim.param_groups"))
    with pytest.raises(UnsafeCheckpoint, match="names posix.system"):
        SafeLoadPlanner().load_bytes(read_item, item)
    assert not marker.exists()


@pytest.mark.slow  # two 2-rank runs: about a minute on 2 cores
def test_two_ranks_agree_on_a_checkpoint_one_rank_cannot_load(tiny_model_dirs, sft_data, tmp_path):
    """Rank 1's shard of the newest checkpoint is truncated: both ranks fall back to the one
    before it together (no hang, one line for the job) and the resumed run is the uninterrupted one."""
    full, run = tmp_path / "full", tmp_path / "run"
    done = run_cli(sft_args(tiny_model_dirs["llama"], sft_data, full, *CHECKPOINTED), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    cut_back(full, run, latest="step_00000006")
    shard = run / "checkpoints" / "step_00000006" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    resumed = run_cli([*sft_args(tiny_model_dirs["llama"], sft_data, run, *CHECKPOINTED), "--resume"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    named = [line for line in resumed.stderr.splitlines() if "cannot be loaded" in line]
    assert len(named) == 1 and "step_00000006" in named[0] and "step_00000004" in named[0], resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr and "error:" not in resumed.stderr, resumed.stderr[-3000:]
    assert train_losses(run) == pytest.approx(train_losses(full), abs=1e-6)
