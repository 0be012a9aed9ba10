"""Import a TRL trainer config (`--trl-config FILE`) into a stage's config.

The file is a TRL `SFTConfig` (rlhf sft), `RewardConfig` (rlhf reward) or `GRPOConfig` (rlhf ppo)
YAML or JSON in TRL's own key names, plus the keys TRL's CLI scripts read from the same YAML
(TrlParser): ModelConfig's model_name_or_path and PEFT keys, ScriptArguments' dataset_* keys, the
GRPO script's reward_funcs and reward_model_name_or_path. Precedence, lowest first: defaults <
--deepspeed-config < --trl-config < --config < flags (`rlhf.config_sources.resolve_config`).

`TRL_KEYS` is the whole mapping, read top to bottom. Each key is one of:

  To(field, convert)  sets one field (one per stage where the stages name it differently), the
                      value converted to this project's meaning (TRL's optimizer steps -> PPO
                      iterations, scheduler names, tracker lists) and checked against the field's
                      rule; an error names the file and the TRL key.
  Only(values, fix)   has no counterpart but means nothing at these values (TRL's defaults); any
                      other value cannot be honoured and is refused in one line: file, key, fix.
  Joint(function)     read together with the keys whose meaning it shares (the batch arithmetic,
                      precision, schedule, GRPO's loss, PEFT, ...), once, where its first key is.

The converters, the joint readings and the reader they fill (`TrlReader`) live in
`rlhf.trl_convert`.

Any other key (use_vllm, push_to_hub, dataloader_num_workers, logging_dir, a typo...) has no
meaning here: they are all listed in one warning line. A null value is an unset key (TRL's
None). An absent key keeps this project's default, never TRL's (docs/trl-config.md lists both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from rlhf.config import PPOConfig, RewardConfig, SFTConfig, read_config_file
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf import trl_convert as convert
from rlhf.trl_convert import (
    ALL, COMMANDS, GRPO, ONLY_GRPO, ONLY_REWARD, ONLY_SFT, REWARD, SFT, TRAINER, TrlReader,
)

log = get_logger(__name__)

Converter = Callable[["TrlReader", str, Any], Any]


def _same(r: TrlReader, key: str, value: Any) -> Any:
    return value


@dataclass(frozen=True)
class To:
    """One TRL key sets one field: `field` (or {stage: field}) <- convert(value)."""

    field: str | Mapping[str, str]
    convert: Converter = _same
    stages: frozenset[str] = ALL
    null: str | None = None
    """Why a null value is refused, where TRL's null means something this project cannot do."""


@dataclass(frozen=True)
class Only:
    """No counterpart; harmless at `accepted`, any other value is refused: "<file>: <key>: <value> <fix>"."""

    accepted: tuple[Any, ...]
    fix: str
    stages: frozenset[str] = ALL


@dataclass(frozen=True)
class Joint:
    """Read with the other keys of `function`, once, when any of them is set (or `always`)."""

    function: Callable[[TrlReader], None]
    stages: frozenset[str] = ALL
    always: bool = False


Rule = Union[To, Only, Joint]


def rule_for(rules: Rule | tuple[Rule, ...], stage: str) -> Rule | None:
    """The rule of a key for `stage` (a key may mean different things per stage), or None."""
    for rule in rules if isinstance(rules, tuple) else (rules,):
        if stage in rule.stages:
            return rule
    return None


def joint_keys(rule: Joint, stage: str) -> list[str]:
    return [k for k, rules in TRL_KEYS.items()
            if isinstance(r := rule_for(rules, stage), Joint) and r.function is rule.function]


def read_keys(r: TrlReader) -> None:
    """Read the file's keys into `r` by their rules in `TRL_KEYS` (a Joint once, with all its
    keys), then list the keys that have no rule for the stage among the ignored ones."""
    done: set[Callable[[TrlReader], None]] = set()
    for key, rules in TRL_KEYS.items():
        rule = rule_for(rules, r.stage)
        if isinstance(rule, Joint):
            wanted = rule.always or any(r.has(k) for k in joint_keys(rule, r.stage))
            if rule.function not in done and wanted:
                rule.function(r)
            done.add(rule.function)
        elif rule is not None and key in r.data:
            read_key(r, key, rule, r.data[key])
    unknown = [k for k in r.data if rule_for(TRL_KEYS.get(k, ()), r.stage) is None]
    r.ignored = unknown + r.skipped + r.ignored


def read_key(r: TrlReader, key: str, rule: To | Only, value: Any) -> None:
    if value is None:
        if isinstance(rule, To) and rule.null:
            raise r.refuse(key, rule.null)
        return
    if isinstance(rule, Only):
        if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in rule.accepted):
            raise r.refuse(key, rule.fix)
        return
    name = rule.field if isinstance(rule.field, str) else rule.field[r.stage]
    r.set(name, rule.convert(r, key, value), key)


# ---------------------------------------------------------------- the table

_FORKED = "rlhf ppo always generates with the actor's own sampler"
TRL_KEYS: dict[str, Rule | tuple[Rule, ...]] = {
    # ModelConfig / ScriptArguments / the GRPO script: what to train on what
    "model_name_or_path": To({SFT: "model", REWARD: "model", GRPO: "actor"}),
    "model_revision": Only(("main",), "is not supported; download that revision and name its folder"),
    "reward_model_name_or_path": To("reward", stages=ONLY_GRPO),
    "reward_funcs": To("reward_fn", convert.reward_funcs, stages=ONLY_GRPO),
    "reward_weights": To("reward_weights", stages=ONLY_GRPO),
    "dataset_name": To("data", convert.dataset),
    "dataset_config": To("data_config"),
    "dataset_train_split": To("data_train_split"),
    "output_dir": To("output"),
    # the batch (GRPO: the generation too), then what counts in its optimizer steps
    "per_device_train_batch_size": Joint(convert.batch),
    "gradient_accumulation_steps": Joint(convert.batch),
    "steps_per_generation": Joint(convert.batch, ONLY_GRPO),
    "generation_batch_size": Joint(convert.batch, ONLY_GRPO),
    "num_iterations": To("ppo_epochs", stages=ONLY_GRPO),
    "num_train_epochs": To("epochs", convert.whole_epochs),
    "max_steps": To("max_steps", convert.max_steps),
    # optimizer and schedule
    "learning_rate": To("lr"),
    "optim": To("optimizer_impl", convert.optimizer),
    "optim_args": Only((), "is not supported; remove it"),
    "weight_decay": To("weight_decay"),
    "adam_beta1": To("adam_beta1"),
    "adam_beta2": To("adam_beta2"),
    "adam_epsilon": To("adam_eps"),
    "max_grad_norm": To("grad_clip"),
    "lr_scheduler_type": Joint(convert.schedule),
    "lr_scheduler_kwargs": Joint(convert.schedule),
    "warmup_steps": Joint(convert.schedule),
    "warmup_ratio": Joint(convert.schedule),
    # precision, memory, compile, processes
    "bf16": Joint(convert.precision),
    "fp16": Joint(convert.precision),
    "gradient_checkpointing": To("gradient_checkpointing"),
    "torch_compile": To("compile"),
    "torch_compile_backend": Only(("inductor",), "is not supported; use inductor"),
    "deepspeed": Joint(convert.deepspeed_file),
    "ddp_timeout": To("dist_timeout"),
    "seed": To("seed"),
    "auto_find_batch_size": Only((False,), "is not supported; set per_device_train_batch_size (rlhf plan predicts "
                                           "the memory)"),
    "average_tokens_across_devices": Only((True,), "is not supported: losses are normalised by the tokens of all "
                                                   "ranks; set true"),
    "label_smoothing_factor": Only((0, 0.0), "is not supported; set 0"),
    "neftune_noise_alpha": Only((), "(NEFTune) is not supported; remove it"),
    # logging, evaluation, checkpoints
    "logging_strategy": Joint(convert.log_interval),
    "logging_steps": Joint(convert.log_interval),
    "log_completions": Joint(convert.log_interval, ONLY_GRPO),
    "report_to": To("report_to", convert.trackers),
    "run_name": To("run_name"),
    "eval_strategy": Joint(convert.evaluation, TRAINER),
    "eval_steps": Joint(convert.evaluation, TRAINER),
    "dataset_test_split": Joint(convert.evaluation, TRAINER),
    "load_best_model_at_end": Only((False,), "is not supported: the model after the last step is exported"),
    "save_strategy": Joint(convert.saving),
    "save_steps": Joint(convert.saving),
    "save_total_limit": To("keep_checkpoints"),
    "resume_from_checkpoint": To("resume", convert.resume),
    # SFTConfig / RewardConfig
    "max_length": To("max_seq_len", stages=TRAINER,
                     null="(no truncation) is not supported; give the longest sequence to train on"),
    "truncation_mode": Only(("keep_start",), "is not supported; use keep_start", ONLY_SFT),
    "chat_template_path": To("chat_template", convert.chat_template, stages=TRAINER),
    "eos_token": Only((), "is not supported: the tokenizer's EOS token ends each sequence; set it in the "
                          "tokenizer (or its chat template) instead", TRAINER),
    "dataset_text_field": To("data_columns", convert.text_field, stages=ONLY_SFT),
    "completion_only_loss": Joint(convert.loss_mask, ONLY_SFT),
    "assistant_only_loss": Joint(convert.loss_mask, ONLY_SFT),
    "packing": Joint(convert.packing, ONLY_SFT),
    "packing_strategy": Joint(convert.packing, ONLY_SFT),
    "padding_free": Joint(convert.packing, ONLY_SFT),
    "loss_type": (Only(("nll", "chunked_nll"), "is not supported; use nll", ONLY_SFT),
                  Joint(convert.grpo_objective, ONLY_GRPO, always=True)),
    "center_rewards_coefficient": To("center_rewards_coef", stages=ONLY_REWARD),
    "disable_dropout": To("disable_dropout", stages=ONLY_REWARD),
    # GRPOConfig: the objective
    "scale_rewards": Joint(convert.grpo_objective, ONLY_GRPO, always=True),
    "num_generations": Joint(convert.grpo_objective, ONLY_GRPO, always=True),
    "beta": To("kl_coef", stages=ONLY_GRPO),
    "use_bias_correction_kl": Joint(convert.kl_correction, ONLY_GRPO),
    "epsilon": To("clip_range", stages=ONLY_GRPO),
    "epsilon_high": To("clip_range_high", stages=ONLY_GRPO),
    "importance_sampling_level": To("importance_ratio", stages=ONLY_GRPO),
    "entropy_coef": To("entropy_coef", stages=ONLY_GRPO),
    "delta": Only((), "(two-sided clipping) is not supported; remove it", ONLY_GRPO),
    "mask_truncated_completions": Only((False,), "is not supported; set false (overlong_buffer in --config "
                                                 "penalises long responses instead)", ONLY_GRPO),
    "multi_objective_aggregation": Only(("sum_then_normalize",), "is not supported; use sum_then_normalize",
                                        ONLY_GRPO),
    "top_entropy_quantile": Only((1, 1.0), "is not supported; set 1.0 (every token in the loss)", ONLY_GRPO),
    "use_adaptive_entropy": Only((False,), "is not supported; set false (entropy_coef is a fixed bonus)", ONLY_GRPO),
    "off_policy_mask_threshold": Only((), "(off-policy sequence masking) is not supported; remove it", ONLY_GRPO),
    "sync_ref_model": Only((False,), "is not supported: the reference model stays frozen; set false", ONLY_GRPO),
    # GRPOConfig: generation
    "max_prompt_length": To("max_prompt_len", stages=ONLY_GRPO),  # TRL < 1.0
    "max_completion_length": To("max_new_tokens", stages=ONLY_GRPO,
                                null="(unbounded completions) is not supported; give a length"),
    "temperature": To("temperature", stages=ONLY_GRPO),
    "top_p": To("top_p", stages=ONLY_GRPO),
    "top_k": To("top_k", stages=ONLY_GRPO),
    "min_p": Only((), f"is not supported ({_FORKED}: temperature, top_k, top_p); remove it", ONLY_GRPO),
    "repetition_penalty": Only((1, 1.0), f"is not supported ({_FORKED}, without a repetition penalty); set 1.0",
                               ONLY_GRPO),
    "generation_kwargs": Only(({},), f"is not supported ({_FORKED}); use temperature, top_k, top_p", ONLY_GRPO),
    "chat_template_kwargs": Only(({},), "is not supported; bake them into a chat template file (chat_template in "
                                        "--config)", ONLY_GRPO),
    # ModelConfig: PEFT and quantisation
    "use_peft": Joint(convert.peft),
    "lora_r": Joint(convert.peft),
    "lora_alpha": Joint(convert.peft),
    "lora_dropout": Joint(convert.peft),
    "lora_target_modules": Joint(convert.peft),
    "lora_target_parameters": Only((), "is not supported; name modules in lora_target_modules"),
    "use_rslora": Only((False,), "is not supported; set false"),
    "use_dora": Only((False,), "is not supported; set false"),
    "load_in_8bit": Only((False,), "is not supported: models train in full precision; set false"),
    "load_in_4bit": Only((False,), "is not supported: models train in full precision; set false"),
}


# ---------------------------------------------------------------- the import


def stage_of(config: Any) -> str:
    if isinstance(config, PPOConfig):
        return GRPO
    if isinstance(config, RewardConfig):
        return REWARD
    if isinstance(config, SFTConfig):
        return SFT
    raise UserError(f"--trl-config: only rlhf sft, reward and ppo read a TRL config, not {type(config).__name__}")


@dataclass
class TrlImport:
    """A read TRL config file; `apply_to` maps it onto one stage's config (`resolve_config`)."""

    path: Path
    data: dict[str, Any]
    world_size: int = 1
    """Processes the run will have: TRL's generation_batch_size counts completions over all of them."""
    skip: Mapping[str, str] = field(default_factory=dict)
    """Keys left out (listed in the warning with their reason): what rlhf e2e wires itself."""

    @property
    def deepspeed_config(self) -> str | None:
        """The file's `deepspeed:` (a ds_config path), read as --deepspeed-config, below this file."""
        value = self.data.get("deepspeed")
        return value if isinstance(value, str) else None

    def apply_to(self, config: Any) -> None:
        stage = stage_of(config)
        reader = TrlReader(self.path, self.data, stage, config, self.world_size, self.skip)
        read_keys(reader)
        for name, value in reader.values.items():
            info = reader.fields[name]
            setattr(getattr(config, info.section) if info.section else config, name, value)
        if reader.ignored:
            log.warning("%s: TRL keys not used by %s (no counterpart here; see docs/trl-config.md): %s",
                        self.path, COMMANDS[stage], ", ".join(reader.ignored))


E2E_WIRED = {key: "rlhf e2e wires it" for key in
             ("model_name_or_path", "output_dir", "dataset_name", "reward_model_name_or_path", "deepspeed")}
"""The keys a stage's TRL file in rlhf e2e leaves out: e2e chains the stages' models, outputs and
data itself (a stage's section may still set them), and --deepspeed-config is one for all stages."""


def import_trl_config(path: str | Path, world_size: int = 1, skip: Mapping[str, str] | None = None) -> TrlImport:
    """Read a TRL config YAML/JSON (a mapping of TRL key names); mapped when applied to a stage."""
    return TrlImport(Path(path), read_config_file(path), world_size, dict(skip or {}))


def deepspeed_config_path(flag: str | None, trl: TrlImport | None) -> str | None:
    """A command's ds_config: --deepspeed-config, or the TRL file's `deepspeed:`; one error if both."""
    from_file = trl.deepspeed_config if trl is not None else None
    if flag and from_file:
        raise UserError(f"--deepspeed-config {flag} and {trl.path}: deepspeed: {from_file} both name a DeepSpeed "
                        "config; keep one")
    return flag or from_file


# TRL keys read jointly whose main field a user typing TRL's flag means.
_JOINT_FLAG = {"num_generations": "samples_per_prompt", "per_device_train_batch_size": "micro_batch_size",
               "gradient_accumulation_steps": "grad_accum", "num_iterations": "ppo_epochs",
               "loss_type": "loss_aggregation", "scale_rewards": "advantage_estimator"}


def flag_for_trl_key(option: str) -> str | None:
    """`--num_generations` / `--num-generations` (TRL's spelling) -> "--samples-per-prompt", the
    flag that carries its meaning here; None when `option` is not a TRL key."""
    key = option.lstrip("-").replace("-", "_")
    rules = TRL_KEYS.get(key)
    if rules is None:
        return None
    first = rules[0] if isinstance(rules, tuple) else rules
    name = _JOINT_FLAG.get(key) if not isinstance(first, To) else (
        first.field if isinstance(first.field, str) else next(iter(first.field.values())))
    return "--" + name.replace("_", "-") if name else "--trl-config"

