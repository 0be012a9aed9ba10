"""Each config value is checked once, where its field is defined: a bad flag, config-file key or
ds_config key stops the command with one `error:` line naming the source and the rule, before any
work; rules between fields are checked once after every source is applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.cli import build_config, main
from rlhf.config import (
    E2EConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    coerce,
    leaf_fields,
    parse_value,
)
from rlhf.engine.config import Bounds, Dtype, ZeroStage
from rlhf.errors import UserError
from rlhf.stages.e2e import resolve_stage_configs, stage_configs

CONFIGS = [SFTConfig, RewardConfig, PPOConfig, E2EConfig]


def error_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the real CLI entry; it must exit with code 2 and print exactly one line, `error: ...`."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


BAD_FLAGS = [
    (["sft", "--zero-stage", "5"], "Invalid value for '--zero-stage': '5' is not one of '0', '1', '2', '3'"),
    (["ppo", "--actor-zero-stage", "4"], "Invalid value for '--actor-zero-stage'"),
    (["sft", "--lr", "nan"], "--lr: nan must be a finite number"),
    (["sft", "--lr", "inf"], "--lr: inf must be a finite number"),
    (["sft", "--lr", "0"], "--lr: 0.0 must be > 0"),
    (["ppo", "--kl-coef", "-1"], "--kl-coef: -1.0 must be >= 0"),
    (["ppo", "--top-p", "2"], "--top-p: 2.0 must be in (0, 1]"),
    (["ppo", "--gamma", "1.5"], "--gamma: 1.5 must be in [0, 1]"),
    (["ppo", "--ema-decay", "1"], "--ema-decay: 1.0 must be in [0, 1)"),
    (["ppo", "--inference-tp-size", "0"], "--inference-tp-size: 0 must be >= 1"),
    (["sft", "--micro-batch-size", "0"], "--micro-batch-size: 0 must be >= 1"),
    (["sft", "--train-batch-size", "-8"], "--train-batch-size: -8 must be >= 1"),
    (["sft", "--adam-beta2", "1"], "--adam-beta2: 1.0 must be in [0, 1)"),
    (["sft", "--warmup-ratio", "2"], "--warmup-ratio: 2.0 must be in [0, 1]"),
    (["sft", "--eval-split", "1.5"], "--eval-split: 1.5 must be in [0, 1)"),
    (["sft", "--data-split", "2,4"], "--data-split: '2,4' must be three non-negative numbers"),
    (["sft", "--data-split", "0,0,0"], "with a positive sum"),
    (["sft", "--log-interval", "0"], "--log-interval: 0 must be >= 1"),
    (["reward", "--value-head-init-std", "-0.1"], "--value-head-init-std: -0.1 must be >= 0"),
    (["e2e", "--wrong-fraction", "1.5"], "--wrong-fraction: 1.5 must be in [0, 1]"),
    (["e2e", "--ppo.kl-coef", "-1"], "--ppo.kl-coef: -1.0 must be >= 0"),
    (["e2e", "--sft.zero-stage", "5"], "--sft.zero-stage: '5' is not one of 0, 1, 2, 3"),
    (["e2e", "--reward.eval-split", "nan"], "--reward.eval-split: nan must be a finite number"),
    # rules between fields, checked once after every source
    (["sft", "--zero-stage", "0", "--offload"], "rlhf sft: offload: true must be used with zero_stage 1, 2 or 3"),
    (["ppo", "--temperature", "0"], "rlhf ppo: temperature: 0 must be > 0 when sampling"),
    (["ppo", "--min-new-tokens", "9", "--max-new-tokens", "8"], "min_new_tokens: 9 must be <= max_new_tokens (8)"),
    (["ppo", "--ptx-data", "x.jsonl"], "ptx_coef: 0.0 must be > 0 with ptx_data"),
    (["e2e", "--ppo.temperature", "0"], "rlhf e2e [ppo]: temperature: 0 must be > 0 when sampling"),
]


@pytest.mark.parametrize("args, message", BAD_FLAGS)
def test_bad_flag_is_one_error_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in error_line(args, capsys)
    assert not list(tmp_path.iterdir())  # nothing was written: the check comes before any work


BAD_FILE_VALUES = [
    ("engine:\n  lr: -1\n", "c.yaml: engine.lr: -1.0 must be > 0"),
    ("zero_stage: 5\n", "c.yaml: zero_stage: 5 is not one of 0, 1, 2, 3"),
    ("zero_stage: true\n", "c.yaml: zero_stage: True is not one of 0, 1, 2, 3"),
    ("eval_split: .nan\n", "c.yaml: eval_split: nan must be a finite number"),
    ("data:\n  max_seq_len: 0\n", "c.yaml: data.max_seq_len: 0 must be >= 2"),
    ("data_split: 2,4\n", "c.yaml: data_split: '2,4' must be three non-negative numbers"),
    ("micro_batch_size: 2.5\n", "c.yaml: micro_batch_size: expected int, got 2.5"),
    ("grad_clip: true\n", "c.yaml: grad_clip: expected float, got True"),
    ("tracking:\n  log_interval: 0\n", "c.yaml: tracking.log_interval: 0 must be >= 1"),
]


@pytest.mark.parametrize("text, message", BAD_FILE_VALUES)
def test_bad_config_file_value_is_one_error_line(text, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(text)
    assert message in error_line(["sft", "--config", "c.yaml"], capsys)


def test_bad_e2e_config_file_section_names_the_section(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("e2e.yaml").write_text("n_sft: 10\nppo:\n  top_p: 0\n")
    assert "e2e.yaml [ppo]: top_p: 0.0 must be in (0, 1]" in error_line(["e2e", "--config", "e2e.yaml"], capsys)
    Path("e2e.yaml").write_text("n_sft: 0\n")
    assert "e2e.yaml: n_sft: 0 must be >= 1" in error_line(["e2e", "--config", "e2e.yaml"], capsys)


BAD_DS_VALUES = [
    ("sft", {"optimizer": {"params": {"lr": -1}}}, "ds.json: optimizer.params.lr: -1.0 must be > 0"),
    ("sft", {"optimizer": {"params": {"betas": [0.9, 1.5]}}}, "ds.json: optimizer.params.betas: 1.5 must be in [0, 1)"),
    ("sft", {"train_micro_batch_size_per_gpu": 0}, "ds.json: train_micro_batch_size_per_gpu: 0 must be >= 1"),
    ("sft", {"gradient_clipping": -1}, "ds.json: gradient_clipping: -1.0 must be >= 0"),
    ("sft", {"zero_optimization": {"stage": 5}}, "ds.json: zero_optimization.stage: 5 is not a ZeRO stage"),
    ("sft", {"zero_optimization": {"stage": True}}, "ds.json: zero_optimization.stage: True is not a ZeRO stage"),
    ("sft", {"fp16": {"enabled": True, "hysteresis": 0}}, "ds.json: fp16.hysteresis: 0 must be >= 1"),
    ("sft", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
     "ds.json: scheduler.params.warmup_num_steps: -5 must be >= 0"),
    ("ppo", {"hybrid_engine": {"inference_tp_size": 0}}, "ds.json: hybrid_engine.inference_tp_size: 0 must be >= 1"),
    ("e2e", {"optimizer": {"params": {"eps": float("nan")}}}, "ds.json: optimizer.params.eps: nan must be a finite number"),
]


@pytest.mark.parametrize("command, ds, message", BAD_DS_VALUES)
def test_bad_ds_config_value_is_one_error_line(command, ds, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ds.json").write_text(json.dumps(ds))
    assert message in error_line([command, "--deepspeed-config", "ds.json"], capsys)


# ---------------------------------------------------------------- the rules themselves


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_numeric_field_declares_a_rule_and_its_default_passes(cls):
    config = cls()
    for info in leaf_fields(cls):
        if info.base_type in (int, float):
            assert isinstance(info.rule, Bounds), f"{info.name} has no bounded(...) rule"
        assert parse_value(info, info.default, "default") == info.default
    if hasattr(config, "validate"):
        config.validate()


def test_e2e_stage_defaults_pass_the_rules(tmp_path):
    for config in stage_configs(E2EConfig(), tmp_path).values():
        for info in leaf_fields(type(config)):
            section = getattr(config, info.section) if info.section else config
            value = getattr(section, info.name)
            assert parse_value(info, value, info.name) == value
        config.validate()


def test_int_literals_take_cli_text_but_not_bools_or_floats():
    assert coerce("3", ZeroStage, "--zero-stage") == 3 and coerce(0, ZeroStage, "x") == 0
    assert type(coerce("3", ZeroStage, "--zero-stage")) is int
    for bad in (True, 3.0, "4", 4):
        with pytest.raises(UserError, match="is not one of 0, 1, 2, 3"):
            coerce(bad, ZeroStage, "x")
    assert coerce("bf16", Dtype, "--dtype") == "bf16"


@pytest.mark.parametrize("bounds, text", [
    (Bounds(gt=0), "> 0"), (Bounds(ge=1), ">= 1"), (Bounds(ge=0, le=1), "in [0, 1]"), (Bounds(ge=0, lt=1), "in [0, 1)"),
    (Bounds(gt=0, le=1), "in (0, 1]"), (Bounds(), "a finite number"),
])
def test_bounds_read_as_their_rule(bounds, text):
    assert bounds.text == text


# ---------------------------------------------------------------- one place for precedence


def test_stage_command_precedence_ds_file_flags(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"params": {"lr": 0.1, "weight_decay": 0.5}}, "gradient_clipping": 2.0,
                              "hybrid_engine": {"inference_tp_size": 2}}))
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("engine:\n  lr: 0.2\n  weight_decay: 0.25\n")
    cfg = build_config(PPOConfig, {"deepspeed_config": str(ds), "config_file": str(cfg_file), "lr": 0.3})
    assert (cfg.engine.lr, cfg.engine.weight_decay, cfg.engine.grad_clip) == (0.3, 0.25, 2.0)
    assert cfg.inference_tp_size == 2
    sft = build_config(SFTConfig, {"deepspeed_config": str(ds)})
    assert sft.engine.lr == 0.1 and not hasattr(sft, "inference_tp_size")


def test_e2e_stage_precedence_defaults_ds_sections_flags(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"params": {"lr": 0.1}}, "hybrid_engine": {"inference_tp_size": 2}}))
    stages = stage_configs(E2EConfig(), tmp_path)
    default_micro = stages["reward"].engine.micro_batch_size
    resolve_stage_configs(stages, str(ds), {"sft": {"engine": {"lr": 0.2}}, "ppo": {"kl_coef": 0.3}},
                          {"ppo": {"lr": "0.4", "whiten-advantages": "false"}}, "e2e.yaml")
    assert [stages[n].engine.lr for n in ("sft", "reward", "ppo")] == [0.2, 0.1, 0.4]
    assert stages["ppo"].kl_coef == 0.3 and stages["ppo"].inference_tp_size == 2
    assert stages["ppo"].whiten_advantages is False
    assert stages["reward"].engine.micro_batch_size == default_micro  # e2e defaults stay where nothing overrides
