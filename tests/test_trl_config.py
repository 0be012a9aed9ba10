"""--trl-config: a TRL SFTConfig / RewardConfig / GRPOConfig file mapped by its meaning; unknown keys
in one warning, values that cannot be honoured refused in one line, the precedence, a GRPO run."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf.algorithms.losses import pairwise_reward_loss
from rlhf.cli import build_config, main
from rlhf.config import E2EConfig, PPOConfig, RewardConfig, SFTConfig, fields_by_name, to_dict
from rlhf.errors import UserError
from rlhf.models.loading import disable_dropout
from rlhf.stages import e2e
from rlhf.trl_config import TRL_KEYS, To, rule_for
from rlhf.trl_convert import ALL
from tests.conftest import REPO, write_jsonl
from tests.test_critic_free import ANSWER_REWARD

STAGES = {"sft": SFTConfig, "reward": RewardConfig, "grpo": PPOConfig}


def resolve(cls: type, trl: dict[str, Any], tmp_path: Path, world_size: int | None = None, **kwargs: Any) -> Any:
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(trl, sort_keys=False))
    return build_config(cls, {"trl_config": str(path), **kwargs}, "rlhf test", world_size=world_size)


def flat(config: Any) -> dict[str, Any]:
    """A config (or its saved config.yaml) with its sections flattened: field name -> value."""
    out: dict[str, Any] = {}
    for key, value in (config if isinstance(config, dict) else to_dict(config)).items():
        out.update(value) if isinstance(value, dict) else out.__setitem__(key, value)
    return out


# ---------------------------------------------------------------- each key's conversion

CONVERSIONS = [
    # model, data, output
    ("sft", {"model_name_or_path": "m"}, {"model": "m"}),
    ("reward", {"model_name_or_path": "m"}, {"model": "m"}),
    ("grpo", {"model_name_or_path": "m"}, {"actor": "m"}),
    ("grpo", {"reward_model_name_or_path": "rm"}, {"reward": "rm"}),
    ("grpo", {"reward_funcs": ["my_lib.rewards.fn", "r.py:f", "sort", "accuracy_reward"]},
     {"reward_fn": ["my_lib.rewards:fn", "r.py:f", "sort", "trl.rewards:accuracy_reward"]}),
    ("grpo", {"reward_weights": [1.0, 0.5]}, {"reward_weights": [1.0, 0.5]}),
    ("sft", {"dataset_name": "trl-lib/Capybara", "dataset_config": "main", "dataset_train_split": "train_sft"},
     {"data": ["trl-lib/Capybara"], "data_config": "main", "data_train_split": "train_sft"}),
    ("sft", {"output_dir": "runs/x"}, {"output": "runs/x"}),
    # batch, length, optimizer
    ("sft", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8},
     {"micro_batch_size": 2, "grad_accum": 8, "train_batch_size": None}),
    ("reward", {"per_device_train_batch_size": 16}, {"micro_batch_size": 16, "grad_accum": None}),
    ("sft", {"num_train_epochs": 3.0}, {"epochs": 3}),
    ("sft", {"max_steps": 500}, {"max_steps": 500}),
    ("sft", {"learning_rate": 2e-5, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.999,
             "adam_epsilon": 1e-6, "max_grad_norm": 0.5},
     {"lr": 2e-5, "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.999, "adam_eps": 1e-6, "grad_clip": 0.5}),
    ("sft", {"optim": "adamw_torch"}, {"optimizer_impl": "torch"}),
    ("sft", {"optim": "adamw_torch_fused"}, {"optimizer_impl": "auto"}),
    ("sft", {"lr_scheduler_type": "linear", "warmup_steps": 10}, {"lr_scheduler": "linear", "warmup_steps": 10}),
    ("sft", {"lr_scheduler_type": "cosine", "warmup_steps": 0.1}, {"lr_scheduler": "cosine", "warmup_ratio": 0.1,
                                                                  "warmup_steps": 0}),
    ("sft", {"warmup_ratio": 0.05}, {"warmup_ratio": 0.05}),
    ("sft", {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 5},
     {"lr_scheduler": "constant", "warmup_steps": 5}),
    ("sft", {"lr_scheduler_type": "constant", "warmup_steps": 5}, {"lr_scheduler": "constant", "warmup_steps": 0}),
    ("sft", {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
     {"lr_scheduler": "cosine", "min_lr_ratio": 0.1}),
    ("sft", {"learning_rate": 1e-4, "lr_scheduler_type": "cosine_with_min_lr",
             "lr_scheduler_kwargs": '{"min_lr": 1e-5}'}, {"min_lr_ratio": pytest.approx(0.1)}),
    ("sft", {"bf16": True}, {"dtype": "bf16"}),
    ("sft", {"fp16": True, "bf16": False}, {"dtype": "fp16"}),
    ("sft", {"bf16": False}, {"dtype": "fp32"}),
    ("sft", {"fp16": False}, {"dtype": "auto"}),  # TRL: bf16 then; absent bf16 keeps ours
    ("sft", {"gradient_checkpointing": True, "torch_compile": True, "seed": 7, "ddp_timeout": 1800},
     {"gradient_checkpointing": True, "compile": True, "seed": 7, "dist_timeout": 1800.0}),
    # logging, evaluation, checkpoints
    ("sft", {"logging_steps": 10, "report_to": ["wandb", "tensorboard"], "run_name": "r"},
     {"log_interval": 10, "report_to": "wandb,tensorboard", "run_name": "r"}),
    ("sft", {"report_to": "all"}, {"report_to": "wandb,tensorboard"}),
    ("sft", {"report_to": "none"}, {"report_to": "none"}),
    ("sft", {"eval_strategy": "steps", "eval_steps": 50, "dataset_test_split": "test_sft"},
     {"eval_interval": 50, "data_test_split": "test_sft"}),
    ("reward", {"eval_strategy": "steps", "logging_steps": 20}, {"eval_interval": 20, "data_test_split": "test"}),
    ("sft", {"eval_strategy": "no", "eval_steps": 50}, {"eval_interval": 0, "data_test_split": None}),
    ("sft", {"save_steps": 100, "save_total_limit": 3}, {"save_interval": 100, "keep_checkpoints": 3}),
    ("sft", {"save_strategy": "no", "save_steps": 100}, {"save_interval": 0}),
    ("sft", {"resume_from_checkpoint": True}, {"resume": True}),
    # SFTConfig
    ("sft", {"max_length": 1024}, {"max_seq_len": 1024}),
    ("sft", {"chat_template_path": "t.jinja"}, {"chat_template": "t.jinja"}),
    ("sft", {"dataset_text_field": "content"}, {"data_columns": ["text=content"]}),
    ("sft", {"dataset_text_field": "text"}, {"data_columns": []}),
    ("sft", {"completion_only_loss": False}, {"train_on_prompt": True}),
    ("sft", {"completion_only_loss": True}, {"train_on_prompt": False}),
    ("sft", {"completion_only_loss": False, "assistant_only_loss": True},
     {"train_on_prompt": False, "train_last_turn_only": False}),
    ("sft", {"assistant_only_loss": False}, {"train_on_prompt": False}),
    ("sft", {"packing": True, "per_device_train_batch_size": 2, "max_length": 256},
     {"max_tokens_per_micro_batch": 512, "pack_sequences": True}),
    ("sft", {"padding_free": True}, {"max_tokens_per_micro_batch": 4 * 512}),
    ("sft", {"packing": False, "packing_strategy": "bfd"}, {"max_tokens_per_micro_batch": 0}),
    ("sft", {"loss_type": "nll"}, {}),
    # RewardConfig
    ("reward", {"max_length": 2048, "center_rewards_coefficient": 0.01, "disable_dropout": True},
     {"max_seq_len": 2048, "center_rewards_coef": 0.01, "disable_dropout": True}),
    # GRPOConfig: the objective
    ("grpo", {}, {"advantage_estimator": "grpo", "samples_per_prompt": 8, "loss_aggregation": "auto", "kl_coef": 0.05}),
    ("grpo", {"scale_rewards": "none"}, {"advantage_estimator": "dr_grpo"}),
    ("grpo", {"scale_rewards": False}, {"advantage_estimator": "dr_grpo"}),
    ("grpo", {"scale_rewards": True}, {"advantage_estimator": "grpo"}),
    ("grpo", {"loss_type": "grpo"}, {"loss_aggregation": "seq-mean-token-mean"}),
    ("grpo", {"loss_type": "dr_grpo"}, {"loss_aggregation": "seq-mean-token-sum-norm"}),
    ("grpo", {"loss_type": "dapo"}, {"loss_aggregation": "token-mean"}),
    ("grpo", {"loss_type": "bnpo"}, {"loss_aggregation": "token-mean"}),
    ("grpo", {"num_generations": 4, "beta": 0.0, "epsilon": 0.3, "epsilon_high": 0.28,
              "importance_sampling_level": "sequence", "entropy_coef": 0.01, "num_iterations": 3},
     {"samples_per_prompt": 4, "kl_coef": 0.0, "clip_range": 0.3, "clip_range_high": 0.28,
      "importance_ratio": "sequence", "entropy_coef": 0.01, "ppo_epochs": 3}),
    ("grpo", {"beta": 0.04, "use_bias_correction_kl": False}, {"kl_coef": 0.04}),
    ("grpo", {"beta": 0.0, "use_bias_correction_kl": True}, {"kl_coef": 0.0}),
    # GRPOConfig: generation
    ("grpo", {"max_prompt_length": 64, "max_completion_length": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 50},
     {"max_prompt_len": 64, "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 50}),
    ("grpo", {"repetition_penalty": 1.0, "mask_truncated_completions": False, "min_p": None, "generation_kwargs": {}},
     {}),
    ("grpo", {"log_completions": True, "logging_steps": 3}, {"sample_log_interval": 3, "log_interval": 3}),
    ("grpo", {"log_completions": False}, {"sample_log_interval": 0}),
    # GRPO batch arithmetic: one generation feeds num_iterations x steps_per_generation / grad_accum steps
    ("grpo", {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 4},
     {"micro_batch_size": 4, "grad_accum": 2, "generation_batch_size": 16, "train_batch_size": None}),
    ("grpo", {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
     {"generation_batch_size": 8, "grad_accum": 2}),
    ("grpo", {"per_device_train_batch_size": 4}, {"generation_batch_size": 4, "grad_accum": 1}),
    # a config TRL saved holds both
    ("grpo", {"per_device_train_batch_size": 4, "steps_per_generation": 2, "generation_batch_size": 8},
     {"generation_batch_size": 8}),
    ("grpo", {"per_device_train_batch_size": 4, "steps_per_generation": 4, "num_iterations": 2, "max_steps": 80,
              "logging_steps": 10, "save_steps": 16},
     {"generation_batch_size": 16, "max_steps": 10, "log_interval": 2, "save_interval": 2}),
    ("grpo", {"max_steps": 20}, {"max_steps": 20}),  # no batch keys: one optimizer step per iteration
    # PEFT
    ("sft", {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
             "lora_target_modules": ["q_proj", "v_proj"]},
     {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.05, "lora_target_modules": ["q_proj", "v_proj"]}),
    ("grpo", {"use_peft": True, "lora_target_modules": "all-linear"},
     {"lora_rank": 16, "lora_target_modules": ["all-linear"]}),
    ("sft", {"use_peft": False, "lora_r": 8}, {"lora_rank": 0}),
    # null is an unset key
    ("sft", {"learning_rate": None, "save_total_limit": None, "eval_steps": None}, {"lr": 1e-5, "keep_checkpoints": 2}),
]


@pytest.mark.parametrize("stage, trl, expected", CONVERSIONS)
def test_each_key_converts_to_its_meaning_here(stage, trl, expected, tmp_path):
    values = flat(resolve(STAGES[stage], trl, tmp_path))
    assert {k: values[k] for k in expected} == expected


def test_generation_batch_size_counts_completions_over_all_processes(tmp_path):
    trl = {"per_device_train_batch_size": 4, "generation_batch_size": 32, "gradient_accumulation_steps": 2}
    assert flat(resolve(PPOConfig, trl, tmp_path, world_size=2))["generation_batch_size"] == 16  # 4 steps per rank
    assert flat(resolve(PPOConfig, trl, tmp_path, world_size=1))["generation_batch_size"] == 32
    with pytest.raises(UserError, match=r"generation_batch_size: 32 must be a multiple of .* = 4 x 16"):
        resolve(PPOConfig, trl, tmp_path, world_size=16)


def test_every_key_is_documented_and_every_field_exists():
    doc = (REPO / "docs" / "trl-config.md").read_text()
    missing = [key for key in TRL_KEYS if f"`{key}`" not in doc]
    assert not missing, f"docs/trl-config.md lacks {missing}"
    for key, rules in TRL_KEYS.items():
        for stage in ALL:
            rule = rule_for(rules, stage)
            if isinstance(rule, To):
                name = rule.field if isinstance(rule.field, str) else rule.field[stage]
                assert name in fields_by_name(STAGES[stage]), f"{key} -> {name} is no field of {stage}"


# ---------------------------------------------------------------- warned and refused


def test_keys_with_no_meaning_here_are_one_warning(tmp_path, log_records):
    trl = {"use_vllm": True, "vllm_mode": "server", "push_to_hub": True, "hub_model_id": "me/m",
           "dataloader_num_workers": 4, "logging_dir": "logs", "learning_rat": 1e-3, "lora_r": 8,
           "learning_rate": 1e-6}
    config = resolve(PPOConfig, trl, tmp_path)
    assert config.engine.lr == 1e-6 and config.lora.lora_rank == 0
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING and "trl.yaml" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].endswith("use_vllm, vllm_mode, push_to_hub, hub_model_id, dataloader_num_workers, "
                                "logging_dir, learning_rat, lora_r (use_peft is false)")
    assert "rlhf ppo" in warnings[0]


def test_keys_of_another_trainer_are_warned(tmp_path, log_records):
    resolve(SFTConfig, {"beta": 0.1, "num_generations": 4, "packing": True}, tmp_path)
    (warning,) = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    assert warning.endswith(": beta, num_generations")


REFUSED = [
    ("grpo", {"repetition_penalty": 1.1}, "repetition_penalty: 1.1 is not supported"),
    ("grpo", {"loss_type": "cispo"}, "loss_type: 'cispo' is not supported; use one of grpo, dr_grpo, dapo, bnpo"),
    ("grpo", {"scale_rewards": "batch"}, "scale_rewards: 'batch' (the batch std) is not supported"),
    ("grpo", {"mask_truncated_completions": True}, "mask_truncated_completions: True is not supported; set false"),
    ("grpo", {"min_p": 0.1}, "min_p: 0.1 is not supported"),
    ("grpo", {"beta": 0.04, "use_bias_correction_kl": True}, "use_bias_correction_kl: True with beta > 0"),
    ("grpo", {"sync_ref_model": True}, "sync_ref_model: True is not supported"),
    ("grpo", {"max_completion_length": None}, "max_completion_length: None (unbounded completions)"),
    ("grpo", {"reward_funcs": ["get_soft_overlong_punishment"]}, "use overlong_buffer and overlong_penalty"),
    ("grpo", {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "steps_per_generation": 2},
     "steps_per_generation: 2 gives 2 micro-batches per generation, not a multiple of gradient_accumulation_steps 4"),
    ("grpo", {"steps_per_generation": 2, "generation_batch_size": 16},
     "generation_batch_size: 16 and steps_per_generation: 2 disagree for 1 process(es) of "
     "per_device_train_batch_size 4"),
    ("grpo", {"per_device_train_batch_size": 4, "steps_per_generation": 4, "max_steps": 10},
     "max_steps: 10 optimizer steps are not whole generations (each feeds 4 optimizer steps"),
    ("sft", {"packing": True, "packing_strategy": "wrapped"}, "packing_strategy: 'wrapped' cuts sequences"),
    ("sft", {"max_length": None}, "max_length: None (no truncation) is not supported"),
    ("sft", {"loss_type": "dft"}, "loss_type: 'dft' is not supported; use nll"),
    ("sft", {"truncation_mode": "keep_end"}, "truncation_mode: 'keep_end' is not supported"),
    ("sft", {"optim": "adafactor"}, "optim: 'adafactor' is not supported: rlhf trains with AdamW"),
    ("sft", {"lr_scheduler_type": "polynomial"}, "lr_scheduler_type: 'polynomial' is not supported"),
    ("sft", {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1}}, "only 0.5"),
    ("sft", {"bf16": True, "fp16": True}, "bf16: True and fp16: true are both enabled"),
    ("sft", {"report_to": "mlflow"}, "report_to: 'mlflow' names mlflow, which is not supported"),
    ("sft", {"num_train_epochs": 2.5}, "num_train_epochs: 2.5 is a fraction of an epoch"),
    ("sft", {"logging_steps": 0.1}, "logging_steps: 0.1 is a fraction of the training steps"),
    ("sft", {"save_strategy": "epoch"}, "save_strategy: 'epoch' is not supported"),
    ("sft", {"eval_strategy": "epoch"}, "eval_strategy: 'epoch' is not supported"),
    ("sft", {"resume_from_checkpoint": "runs/x/checkpoint-500"}, "names a checkpoint"),
    ("sft", {"chat_template_path": "HuggingFaceTB/SmolLM2-135M"}, "is not a .jinja file"),
    ("sft", {"use_peft": True, "use_dora": True}, "use_dora: True is not supported"),
    ("sft", {"load_in_4bit": True}, "load_in_4bit: True is not supported"),
    ("sft", {"model_revision": "v2"}, "model_revision: 'v2' is not supported"),
    ("sft", {"deepspeed": {"zero_optimization": {"stage": 3}}}, "deepspeed: {'zero_optimization'"),
    ("reward", {"eos_token": "<|end|>"}, "eos_token: '<|end|>' is not supported"),
    ("sft", {"learning_rate": -1.0}, "trl.yaml: learning_rate: -1.0 must be > 0"),
    ("grpo", {"num_generations": 1}, "samples_per_prompt: 1 must be >= 2 with advantage_estimator grpo"),
]


@pytest.mark.parametrize("stage, trl, message", REFUSED)
def test_values_that_cannot_be_honoured_are_refused(stage, trl, message, tmp_path):
    with pytest.raises(UserError) as exc:
        resolve(STAGES[stage], trl, tmp_path)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    if "must be >= 2" not in message:  # the rule between fields names the command, not the file
        assert str(exc.value).startswith(f"{tmp_path / 'trl.yaml'}: ")


def test_a_saved_configs_masked_tokens_are_unset(tmp_path):
    config = resolve(SFTConfig, {"eos_token": "<EOS_TOKEN>", "pad_token": "<PAD_TOKEN>", "hub_token": "<HUB_TOKEN>"},
                     tmp_path)  # TrainingArguments.to_dict() writes *_token values so
    assert config.data.max_seq_len == 512


TRL_PYTHON = os.environ.get("TRL_PYTHON")  # a python with trl (e.g. /path/to/trl-venv/bin/python)
DUMP = """
import json, sys
from trl import GRPOConfig, RewardConfig, SFTConfig
for name, cls in (("sft", SFTConfig), ("reward", RewardConfig), ("grpo", GRPOConfig)):
    config = cls(output_dir=sys.argv[1] + "/" + name, use_cpu=True, learning_rate=3e-5, num_train_epochs=2,
                 per_device_train_batch_size=4, gradient_accumulation_steps=2, lr_scheduler_type="cosine")
    open(f"{sys.argv[1]}/{name}.json", "w").write(json.dumps(config.to_dict(), default=str))
"""


@pytest.mark.skipif(importlib.util.find_spec("trl") is None and not TRL_PYTHON,
                    reason="needs trl here (pip install trl) or TRL_PYTHON naming a python with trl")
def test_configs_saved_by_trl_itself_import(tmp_path, log_records):
    """TRL's own to_dict() of each config (every key, post-init values: both GRPO batch keys filled in)."""
    python = sys.executable if importlib.util.find_spec("trl") is not None else str(TRL_PYTHON)
    subprocess.run([python, "-c", DUMP, str(tmp_path)], check=True, capture_output=True, timeout=300)
    for name, cls in (("sft", SFTConfig), ("reward", RewardConfig), ("grpo", PPOConfig)):
        config = build_config(cls, {"trl_config": str(tmp_path / f"{name}.json")}, f"rlhf {name}", world_size=1)
        engine = config.engine
        assert (engine.lr, engine.micro_batch_size, engine.grad_accum, config.epochs) == (3e-5, 4, 2, 2)
        assert engine.lr_scheduler == "cosine" and engine.dtype == "bf16" and engine.gradient_checkpointing
        assert config.output == str(tmp_path / name) and config.tracking.log_interval == 10
    assert config.generation_batch_size == 8 and config.samples_per_prompt == 8 and config.kl_coef == 0.0
    assert config.max_new_tokens == 512 and config.loss_aggregation == "token-mean"  # TRL's dapo
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING and "json" in r.getMessage()]
    assert len(warnings) == 3 and all("push_to_hub" in w for w in warnings)


def test_a_refusal_is_one_error_line_from_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("grpo.yaml").write_text("repetition_penalty: 1.2\n")
    with pytest.raises(SystemExit) as exc:
        main(["ppo", "--trl-config", "grpo.yaml"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: grpo.yaml: repetition_penalty: 1.2 is not supported (rlhf ppo always generates with "
                     "the actor's own sampler, without a repetition penalty); set 1.0"]


# ---------------------------------------------------------------- precedence


def test_trl_config_is_below_config_and_flags(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 0.002\nmax_new_tokens: 16\n")
    trl = {"learning_rate": 0.001, "max_completion_length": 8, "temperature": 0.5, "beta": 0.2}
    config = resolve(PPOConfig, trl, tmp_path, config_file=str(tmp_path / "c.yaml"), temperature=0.9,
                     advantage_estimator="rloo")
    assert config.engine.lr == 0.002 and config.max_new_tokens == 16  # --config over the TRL file
    assert config.temperature == 0.9 and config.advantage_estimator == "rloo"  # flags over both
    assert config.kl_coef == 0.2  # the TRL file over the defaults


def test_trl_config_is_above_deepspeed_config(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                                                  "gradient_clipping": 0.3}))
    config = resolve(SFTConfig, {"learning_rate": 1e-4, "per_device_train_batch_size": 8}, tmp_path,
                     deepspeed_config=str(tmp_path / "ds.json"))
    assert config.engine.lr == 1e-4 and config.engine.micro_batch_size == 8  # TRL over ds_config
    assert config.engine.grad_accum == 4 and config.engine.grad_clip == 0.3  # ds_config's, the TRL file silent


def test_the_trl_files_deepspeed_key_is_the_ds_layer(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"gradient_clipping": 0.3, "optimizer": {"params": {"lr": 3e-4}}}))
    config = resolve(SFTConfig, {"deepspeed": str(tmp_path / "ds.json"), "learning_rate": 1e-4}, tmp_path)
    assert config.engine.grad_clip == 0.3 and config.engine.lr == 1e-4
    with pytest.raises(UserError, match="both name a DeepSpeed config; keep one"):
        resolve(SFTConfig, {"deepspeed": str(tmp_path / "ds.json")}, tmp_path,
                deepspeed_config=str(tmp_path / "ds.json"))


def test_e2e_stage_sections_take_a_trl_config(tmp_path, log_records):
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({"beta": 0.2, "output_dir": "elsewhere", "num_generations": 4}))
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"learning_rate": 3e-4}))
    cfg = E2EConfig(output=str(tmp_path / "run"))
    stages = e2e.stage_configs(cfg, tmp_path / "run")
    sections = {"ppo": {"trl_config": str(tmp_path / "grpo.yaml"), "top_p": 0.5}}
    e2e.resolve_stage_configs(stages, None, sections, {"sft": {"trl-config": str(tmp_path / "sft.yaml")}}, "e2e.yaml")
    ppo, sft = stages["ppo"], stages["sft"]
    assert ppo.kl_coef == 0.2 and ppo.samples_per_prompt == 4 and ppo.top_p == 0.5
    assert ppo.advantage_estimator == "grpo" and ppo.output == str(tmp_path / "run" / "ppo")  # e2e wires the output
    assert sft.engine.lr == 3e-4
    assert any("output_dir (rlhf e2e wires it)" in r.getMessage() for r in log_records)


# ---------------------------------------------------------------- the reward model's two new fields


def test_center_rewards_term_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.5]), torch.tensor([-1.0, 1.5])
    bt = (-math.log(1 / (1 + math.exp(-2.0))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    center = ((1.0 - 1.0) ** 2 + (0.5 + 1.5) ** 2) / 2
    loss, _ = pairwise_reward_loss(chosen, rejected, None, center_coef=0.01)
    assert float(loss) == pytest.approx(bt + 0.01 * center, rel=1e-6)
    assert float(pairwise_reward_loss(chosen, rejected)[0]) == pytest.approx(bt, rel=1e-6)


def test_disable_dropout_zeroes_every_dropout_layer():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1),
                                torch.nn.Sequential(torch.nn.Dropout(0.3)))
    disable_dropout(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]


# ---------------------------------------------------------------- a GRPO run from a GRPOConfig


@pytest.mark.usefixtures("one_thread")
def test_grpo_run_from_a_grpo_config_file(tiny_model_dirs, tmp_path, log_records):
    rows = [{"prompt": "bcd" * (i % 3 + 1), "answer": "ab"[i % 2]} for i in range(32)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    (tmp_path / "answer_reward.py").write_text(ANSWER_REWARD)
    out = tmp_path / "grpo"
    trl = {
        "model_name_or_path": str(tiny_model_dirs["llama"]), "dataset_name": str(prompts),
        "reward_funcs": [f"{tmp_path / 'answer_reward.py'}:contains_answer"], "output_dir": str(out),
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
        "num_generations": 4, "num_iterations": 2, "max_steps": 4,  # one generation feeds 2 x 4 / 2 = 4 steps
        "learning_rate": 1e-4, "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 1,
        "beta": 0.01, "use_bias_correction_kl": False, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "grpo",
        "max_completion_length": 6, "temperature": 0.9, "top_p": 0.95, "top_k": 20,
        "weight_decay": 0.01, "adam_beta2": 0.99, "max_grad_norm": 0.5, "seed": 7, "logging_steps": 1,
        "bf16": False, "gradient_checkpointing": False, "report_to": "none", "run_name": "from-trl",
        "use_vllm": False, "push_to_hub": False, "dataloader_num_workers": 2,
    }
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(trl, sort_keys=False))
    main(["ppo", "--trl-config", str(tmp_path / "grpo.yaml"), "--advantage-estimator", "grpo",
          "--optimizer-impl", "torch"])
    saved = flat(yaml.safe_load((out / "config.yaml").read_text()))
    expected = {
        "actor": str(tiny_model_dirs["llama"]), "data": [str(prompts)], "output": str(out),
        "reward_fn": [f"{tmp_path / 'answer_reward.py'}:contains_answer"], "advantage_estimator": "grpo",
        "micro_batch_size": 4, "grad_accum": 2, "generation_batch_size": 16, "samples_per_prompt": 4, "ppo_epochs": 2,
        "max_steps": 1, "lr": 1e-4, "lr_scheduler": "constant", "warmup_steps": 1, "kl_coef": 0.01,
        "clip_range": 0.2, "clip_range_high": 0.28, "loss_aggregation": "seq-mean-token-mean", "max_new_tokens": 6,
        "temperature": 0.9, "top_p": 0.95, "top_k": 20, "weight_decay": 0.01, "adam_beta2": 0.99, "grad_clip": 0.5,
        "seed": 7, "log_interval": 1, "dtype": "fp32", "gradient_checkpointing": False, "report_to": "none",
        "run_name": "from-trl", "optimizer_impl": "torch",
    }
    assert {k: saved[k] for k in expected} == expected
    # TRL's optimizer steps per generation: the experience in minibatches of micro x accum, ppo_epochs times
    minibatches = saved["generation_batch_size"] // (saved["micro_batch_size"] * saved["grad_accum"])
    assert saved["ppo_epochs"] * minibatches * saved["max_steps"] == trl["max_steps"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 1 and summary["samples_per_prompt"] == 4
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING and "grpo.yaml" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].endswith("use_vllm, push_to_hub, dataloader_num_workers")


@pytest.mark.parametrize("flag, says", [
    ("--num_generations", "TRL's num_generations is --samples-per-prompt here"),
    ("--num-generations", "TRL's num_generations is --samples-per-prompt here"),
    ("--learning_rate", "TRL's learning_rate is --lr here"),
    ("--packing", "it is a TRL config key: pass your TRL config file with --trl-config"),
])
def test_a_trl_flag_names_the_flag_that_means_it(flag: str, says: str, capsys: pytest.CaptureFixture) -> None:
    from rlhf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["ppo", flag, "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "--generation-batch-size" not in err, err
