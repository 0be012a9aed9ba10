"""A reduced `rlhf e2e`: the three stages chain, markers are written, and a re-run skips finished
stages and resumes an interrupted one from its checkpoint."""

from __future__ import annotations

import json
import shutil

from rlhf.cli import main
from tests.conftest import read_metrics

SMALL = [
    "--tiny-hidden-size", "32", "--tiny-layers", "2", "--n-sft", "256", "--n-pairs", "256", "--n-prompts", "64",
    "--n-eval-pairs", "32", "--n-eval-prompts", "16", "--report-to", "none",
    "--sft.epochs", "1", "--sft.micro-batch-size", "32",
    "--reward.epochs", "1", "--reward.micro-batch-size", "32",
    "--ppo.max-steps", "2", "--ppo.save-interval", "1", "--ppo.generation-batch-size", "16",
    "--ppo.micro-batch-size", "16", "--ppo.max-new-tokens", "8", "--ppo.keep-checkpoints", "3",
]


def test_reduced_e2e_chains_marks_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    main(["e2e", "--output", str(out), *SMALL])
    printed = capsys.readouterr().out
    assert "e2e summary" in printed and "ppo_task_success" in printed
    for stage in ("sft", "reward", "ppo"):
        assert (out / stage / "DONE").is_file(), stage
        assert (out / stage / "model" / "config.json").is_file(), stage
    # each stage's model fed the next
    import yaml

    assert yaml.safe_load((out / "reward" / "config.yaml").read_text())["model"] == str(out / "sft" / "model")
    ppo_cfg = yaml.safe_load((out / "ppo" / "config.yaml").read_text())
    assert ppo_cfg["actor"] == str(out / "sft" / "model") and ppo_cfg["reward"] == str(out / "reward" / "model")
    summary = json.loads((out / "summary.json").read_text())
    for key in ("rm_eval_accuracy", "sft_task_success", "ppo_task_success", "sft_seconds", "reward_seconds",
                "ppo_seconds", "total_seconds"):
        assert key in summary, key
    assert 0.0 <= summary["sft_task_success"] <= 1.0
    groups = {yaml.safe_load((out / s / "config.yaml").read_text())["tracking"]["wandb_group"] for s in ("sft", "reward", "ppo")}
    assert len(groups) == 1 and None not in groups
    first_ppo_rows = read_metrics(out / "ppo")

    # Interrupt PPO after iteration 1: drop its outputs and its last checkpoint.
    ppo = out / "ppo"
    for name in ("DONE", "model", "critic", "summary.json"):
        path = ppo / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(ppo / "checkpoints" / "step_00000002")
    (ppo / "checkpoints" / "latest").write_text("step_00000001")
    sft_mtime = (out / "sft" / "DONE").stat().st_mtime
    main(["e2e", "--output", str(out), *SMALL])
    assert (out / "sft" / "DONE").stat().st_mtime == sft_mtime  # skipped
    assert (ppo / "DONE").is_file()
    rows = read_metrics(ppo)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["score_mean"] == first_ppo_rows[1]["score_mean"]  # the resumed iteration is the same


def test_prefixed_flags_are_parsed_and_checked():
    import pytest

    from rlhf.errors import UserError
    from rlhf.stages.e2e import parse_prefixed_flags

    assert parse_prefixed_flags(["--ppo.kl-coef", "0.1", "--ppo.greedy", "--sft.lr=1e-3", "--ppo.no-whiten-advantages"]) == {
        "ppo": {"kl-coef": "0.1", "greedy": "true", "whiten-advantages": "false"}, "sft": {"lr": "1e-3"}}
    with pytest.raises(UserError, match="stage options are given as"):
        parse_prefixed_flags(["--bogus", "1"])
