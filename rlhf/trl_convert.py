"""The converters of `rlhf.trl_config.TRL_KEYS`: each turns TRL's meaning of one key, or of
keys read together (the GRPO batch, precision, schedule, GRPO's loss, PEFT...), into this
project's fields, through the reader's `set` (checked against the field's rule), `refuse` (one
error line: file, key, what to do) and `ignore` (the warning line). The reader (`TrlReader`, one
file applied to one stage config) is here, below the table that drives it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf.config_fields import fields_by_name, parse_value
from rlhf.errors import UserError

SFT, REWARD, GRPO = "sft", "reward", "grpo"
ALL = frozenset({SFT, REWARD, GRPO})
TRAINER = frozenset({SFT, REWARD})  # TRL's plain Trainer loop: evaluation, one row per micro-batch slot
ONLY_SFT, ONLY_REWARD, ONLY_GRPO = frozenset({SFT}), frozenset({REWARD}), frozenset({GRPO})
COMMANDS = {SFT: "rlhf sft", REWARD: "rlhf reward", GRPO: "rlhf ppo"}
TRL_GRPO_GENERATIONS = 8
"""TRL's num_generations default: what a GRPOConfig file without it samples per prompt."""


# ---------------------------------------------------------------- the reader


class TrlReader:
    """One TRL file applied to one stage config: the converted values, and the keys not used."""

    def __init__(self, path: Path, data: Mapping[str, Any], stage: str, config: Any, world_size: int,
                 skip: Mapping[str, str]) -> None:
        self.path, self.stage, self.config, self.world_size = path, stage, config, world_size
        # TrainingArguments.to_dict() writes a *_token key's value as "<KEY>": a saved config's unset token
        self.data = {k: None if isinstance(v, str) and k.endswith("_token") and v == f"<{k.upper()}>" else v
                     for k, v in data.items() if k not in skip}
        self.skipped = [f"{k} ({skip[k]})" for k in data if k in skip]
        self.fields = fields_by_name(type(config))
        self.values: dict[str, Any] = {}
        self.ignored: list[str] = []

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def set(self, name: str, value: Any, key: str) -> None:
        self.values[name] = parse_value(self.fields[name], value, f"{self.path}: {key}")

    def current(self, name: str) -> Any:
        """The field as this file leaves it so far: its value from the file, else from below."""
        if name in self.values:
            return self.values[name]
        info = self.fields[name]
        return getattr(getattr(self.config, info.section) if info.section else self.config, name)

    def refuse(self, key: str, why: str) -> UserError:
        return UserError(f"{self.path}: {key}: {self.data.get(key)!r} {why}")

    def ignore(self, key: str, reason: str = "") -> None:
        self.ignored.append(f"{key} ({reason})" if reason else key)

    def steps_per_iteration(self) -> float:
        """GRPO: the optimizer steps one generation feeds (TRL's unit of max_steps, logging_steps,
        save_steps): ppo_epochs x the minibatches of one experience batch. 1 for sft and reward."""
        if self.stage != GRPO:
            return 1.0
        generation = self.current("generation_batch_size")
        if self.current("train_batch_size"):
            minibatch = self.current("train_batch_size") / self.world_size
        elif self.current("grad_accum"):
            minibatch = self.current("micro_batch_size") * self.current("grad_accum")
        else:  # rlhf ppo's default: the whole experience is one minibatch
            minibatch = generation
        return self.current("ppo_epochs") * generation / minibatch


# ---------------------------------------------------------------- one-key converters


def whole_epochs(r: TrlReader, key: str, value: Any) -> Any:
    if isinstance(value, float):
        if not value.is_integer():
            raise r.refuse(key, "is a fraction of an epoch, which is not supported; give whole epochs or max_steps")
        return int(value)
    return value


def _steps(r: TrlReader, key: str, value: Any) -> Any:
    if isinstance(value, float):
        if 0 < value < 1:
            raise r.refuse(key, "is a fraction of the training steps, which is not supported; give a number of steps")
        return int(value)
    return value


def _step_interval(r: TrlReader, key: str, value: Any) -> Any:
    """Every n optimizer steps; for GRPO every ceil(n / steps per generation) PPO iterations."""
    steps, per_iteration = _steps(r, key, value), r.steps_per_iteration()
    if not isinstance(steps, int) or steps <= 0 or per_iteration == 1:
        return steps
    return max(1, math.ceil(steps / per_iteration))


def max_steps(r: TrlReader, key: str, value: Any) -> Any:
    """max_steps counts optimizer steps in TRL; rlhf ppo counts iterations (one generation each)."""
    steps, per_iteration = _steps(r, key, value), r.steps_per_iteration()
    if not isinstance(steps, int) or steps <= 0 or per_iteration == 1:
        return steps
    if steps % per_iteration:
        raise r.refuse(key, f"optimizer steps are not whole generations (each feeds {per_iteration:g} optimizer "
                            f"steps: num_iterations x steps_per_generation / gradient_accumulation_steps); use a "
                            f"multiple of {per_iteration:g}")
    return int(steps // per_iteration)


_OPTIMIZERS = {"adamw_torch": "torch", "adamw_torch_fused": "auto"}


def optimizer(r: TrlReader, key: str, value: Any) -> Any:
    if value not in _OPTIMIZERS:
        raise r.refuse(key, "is not supported: rlhf trains with AdamW; use adamw_torch or adamw_torch_fused")
    return _OPTIMIZERS[value]


_TRACKERS = ("wandb", "tensorboard", "none")


def trackers(r: TrlReader, key: str, value: Any) -> str:
    names = [n.strip() for item in ([value] if isinstance(value, str) else value) for n in str(item).split(",")]
    out: list[str] = []
    for name in filter(None, names):
        if name not in (*_TRACKERS, "all"):
            raise r.refuse(key, f"names {name}, which is not supported; use wandb, tensorboard or none")
        out += ["wandb", "tensorboard"] if name == "all" else [name]
    out = [n for n in dict.fromkeys(out) if n != "none"]
    return ",".join(out) or "none"


def resume(r: TrlReader, key: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    raise r.refuse(key, "names a checkpoint; rlhf resumes from the latest one in <output>/checkpoints: set "
                        "output_dir to the run's folder and resume_from_checkpoint: true (or pass --resume)")


def dataset(r: TrlReader, key: str, value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def text_field(r: TrlReader, key: str, value: Any) -> list[str]:
    """dataset_text_field FIELD -> the column rename text=FIELD; "text" (TRL's default) renames nothing."""
    return r.current("data_columns") if value == "text" else [f"text={value}"]


def chat_template(r: TrlReader, key: str, value: Any) -> Any:
    if str(value).endswith(".jinja"):
        return value
    raise r.refuse(key, "is not a .jinja file; pass the template file itself (e.g. a tokenizer folder's "
                        "chat_template.jinja)")


_TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


def reward_funcs(r: TrlReader, key: str, value: Any) -> list[str]:
    """TRL's names: its registry (-> trl.rewards:NAME), or a dotted path a.b.f (-> a.b:f)."""
    out = []
    for name in [value] if isinstance(value, str) else value:
        name = str(name)
        if name == "get_soft_overlong_punishment":
            raise r.refuse(key, "names get_soft_overlong_punishment: use overlong_buffer and overlong_penalty in "
                                "--config (DAPO's soft overlong penalty over max_new_tokens) instead")
        if name in _TRL_REWARDS:
            name = f"trl.rewards:{name}"
        elif ":" not in name and "." in name and not name.endswith(".py"):
            module, _, function = name.rpartition(".")
            name = f"{module}:{function}"
        out.append(name)
    return out


# ---------------------------------------------------------------- keys read together


def batch(r: TrlReader) -> None:
    """TRL counts rows per device: per_device_train_batch_size -> micro_batch_size,
    gradient_accumulation_steps -> grad_accum; the global batch follows (not a ds_config's).

    GRPO: one generation is steps_per_generation micro-batches per device (default
    gradient_accumulation_steps; or generation_batch_size completions over all processes), so
    generation_batch_size (ours: per rank) = per_device_train_batch_size x steps_per_generation,
    and each PPO epoch over it takes steps_per_generation / gradient_accumulation_steps optimizer
    steps, as one TRL generation does."""
    if r.has("per_device_train_batch_size"):
        r.set("micro_batch_size", r.get("per_device_train_batch_size"), "per_device_train_batch_size")
    if r.has("gradient_accumulation_steps") or r.stage == GRPO:
        r.set("grad_accum", r.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    r.set("train_batch_size", None, "per_device_train_batch_size")
    if r.stage != GRPO:
        return
    micro, accum = r.current("micro_batch_size"), r.current("grad_accum")
    key = "steps_per_generation" if r.has("steps_per_generation") or not r.has("generation_batch_size") \
        else "generation_batch_size"
    if key == "generation_batch_size":
        total, devices = r.get(key), micro * r.world_size
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0 or total % devices:
            raise r.refuse(key, f"must be a multiple of per_device_train_batch_size x processes = {micro} x "
                                f"{r.world_size} (TRL's rule)")
        per_generation = total // devices
    else:
        per_generation = r.get(key, accum)
        if not isinstance(per_generation, int) or isinstance(per_generation, bool) or per_generation < 1:
            raise r.refuse(key, "must be a whole number >= 1")
        # A config TRL saved holds both (its __post_init__ fills in the other); they must agree.
        if r.has("generation_batch_size") and r.get("generation_batch_size") != micro * r.world_size * per_generation:
            raise r.refuse("generation_batch_size", f"and steps_per_generation: {per_generation} disagree for "
                                                    f"{r.world_size} process(es) of per_device_train_batch_size "
                                                    f"{micro}; keep one of them")
    if per_generation % accum:
        raise r.refuse(key, f"gives {per_generation} micro-batches per generation, not a multiple of "
                            f"gradient_accumulation_steps {accum}: an optimizer step here cannot span two "
                            "generations; make it a multiple")
    r.set("generation_batch_size", micro * per_generation, key)


def precision(r: TrlReader) -> None:
    """bf16 / fp16 -> dtype; bf16: false (and no fp16) is fp32. Absent: our dtype auto."""
    bf16, fp16 = r.get("bf16"), r.get("fp16")
    if bf16 and fp16:
        raise r.refuse("bf16", "and fp16: true are both enabled; enable one")
    if fp16:
        r.set("dtype", "fp16", "fp16")
    elif bf16:
        r.set("dtype", "bf16", "bf16")
    elif bf16 is False:
        r.set("dtype", "fp32", "bf16")


_SCHEDULES = {"linear": "linear", "cosine": "cosine", "cosine_with_min_lr": "cosine", "constant": "constant",
              "constant_with_warmup": "constant"}
_SCHEDULE_KWARGS = {"cosine": {"num_cycles"}, "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"}}


def schedule(r: TrlReader) -> None:
    """lr_scheduler_type (+ kwargs) and warmup. Transformers' constant schedule has no warmup; a
    warmup_steps below 1 is a fraction of the training steps (transformers 5), warmup_ratio the
    same in older versions. Both decay to min_lr_ratio x lr (0 unless cosine_with_min_lr)."""
    kind = r.get("lr_scheduler_type")
    if kind is not None:
        if kind not in _SCHEDULES:
            raise r.refuse("lr_scheduler_type", f"is not supported; use one of {', '.join(_SCHEDULES)}")
        r.set("lr_scheduler", _SCHEDULES[kind], "lr_scheduler_type")
    kwargs = r.get("lr_scheduler_kwargs", {})
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise r.refuse("lr_scheduler_kwargs", "is not a JSON object") from None
    for name in kwargs:
        if name not in _SCHEDULE_KWARGS.get(kind or "linear", set()):
            raise r.refuse("lr_scheduler_kwargs", f"has {name}, which lr_scheduler_type {kind or 'linear'} does not "
                                                  "take here; remove it")
    if kwargs.get("num_cycles", 0.5) != 0.5:
        raise r.refuse("lr_scheduler_kwargs", "sets num_cycles; only 0.5 (one half cosine) is supported")
    if kind == "cosine_with_min_lr":
        if "min_lr_rate" in kwargs:
            r.set("min_lr_ratio", kwargs["min_lr_rate"], "lr_scheduler_kwargs.min_lr_rate")
        elif "min_lr" in kwargs:
            r.set("min_lr_ratio", kwargs["min_lr"] / r.current("lr"), "lr_scheduler_kwargs.min_lr / learning_rate")
        else:
            raise r.refuse("lr_scheduler_kwargs", "needs min_lr or min_lr_rate with cosine_with_min_lr")
    if kind == "constant":
        for key in ("warmup_steps", "warmup_ratio"):
            if r.get(key, 0):
                r.ignore(key, "lr_scheduler_type constant has no warmup")
        r.set("warmup_steps", 0, "lr_scheduler_type")
        r.set("warmup_ratio", 0.0, "lr_scheduler_type")
        return
    if r.has("warmup_ratio"):
        r.set("warmup_ratio", r.get("warmup_ratio"), "warmup_ratio")
    steps = r.get("warmup_steps")
    if isinstance(steps, float) and 0 < steps < 1:
        r.set("warmup_ratio", steps, "warmup_steps")
        r.set("warmup_steps", 0, "warmup_steps")
    elif steps is not None:
        r.set("warmup_steps", int(steps) if isinstance(steps, float) else steps, "warmup_steps")


def log_interval(r: TrlReader) -> None:
    strategy = r.get("logging_strategy", "steps")
    if strategy == "steps":
        if r.has("logging_steps"):
            r.set("log_interval", _step_interval(r, "logging_steps", r.get("logging_steps")), "logging_steps")
    elif strategy == "no":
        r.ignore("logging_strategy", "metrics.jsonl is always written")
    else:
        raise r.refuse("logging_strategy", "is not supported; use steps with logging_steps")
    if r.stage == GRPO and r.has("log_completions"):
        r.set("sample_log_interval", r.current("log_interval") if r.get("log_completions") else 0, "log_completions")


def evaluation(r: TrlReader) -> None:
    """eval_strategy steps: every eval_steps (default logging_steps) on the dataset_test_split
    (default TRL's "test"), as TRL's scripts; no: neither is read."""
    strategy = r.get("eval_strategy", "no")
    if strategy == "no":
        for key in ("eval_steps", "dataset_test_split"):
            if r.has(key):
                r.ignore(key, "eval_strategy is no")
        return
    if strategy != "steps":
        raise r.refuse("eval_strategy", "is not supported; use steps with eval_steps (or no)")
    key = "eval_steps" if r.has("eval_steps") else "logging_steps"
    steps = _step_interval(r, key, r.get(key)) if r.has(key) else r.current("log_interval")
    r.set("eval_interval", steps, key)
    r.set("data_test_split", r.get("dataset_test_split", "test"), "dataset_test_split")


def saving(r: TrlReader) -> None:
    strategy = r.get("save_strategy", "steps")
    if strategy == "no":
        r.set("save_interval", 0, "save_strategy")
    elif strategy != "steps":
        raise r.refuse("save_strategy", "is not supported; use steps with save_steps (or no)")
    elif r.has("save_steps"):
        r.set("save_interval", _step_interval(r, "save_steps", r.get("save_steps")), "save_steps")


def loss_mask(r: TrlReader) -> None:
    """completion_only_loss / assistant_only_loss -> train_on_prompt (ours trains responses and
    every assistant turn unless train_on_prompt; assistant_only_loss: false is TRL's default)."""
    completion, assistant = r.get("completion_only_loss"), r.get("assistant_only_loss")
    if assistant is True:
        r.set("train_on_prompt", False, "assistant_only_loss")
        r.set("train_last_turn_only", False, "assistant_only_loss")
    elif completion is not None:
        r.set("train_on_prompt", not completion, "completion_only_loss")


def packing(r: TrlReader) -> None:
    """packing (bfd: whole sequences, positions restarting) or padding_free -> each micro-batch
    of at most per_device_train_batch_size x max_length tokens run packed (no padding computed)."""
    strategy = r.get("packing_strategy", "bfd")
    if not (r.get("packing") or r.get("padding_free")):
        if strategy != "bfd":
            r.ignore("packing_strategy", "packing is false")
        return
    if r.get("packing") and strategy != "bfd":
        raise r.refuse("packing_strategy", "cuts sequences, which is not supported; use bfd (whole sequences)")
    key = "packing" if r.get("packing") else "padding_free"
    r.set("max_tokens_per_micro_batch", r.current("micro_batch_size") * r.current("max_seq_len"), key)
    r.set("pack_sequences", True, key)


_LOSS_AGGREGATION = {"grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm", "dapo": "token-mean",
                     "bnpo": "token-mean"}


def grpo_objective(r: TrlReader) -> None:
    """A GRPOConfig means GRPO: scale_rewards group -> advantage_estimator grpo, none -> dr_grpo
    (group mean only), unless the config below already names a critic-free estimator (e2e's);
    loss_type -> loss_aggregation; num_generations -> samples_per_prompt (TRL's 8 when absent and
    ours is 1, which GRPO cannot run)."""
    scale = {True: "group", False: "none"}.get(r.get("scale_rewards"), r.get("scale_rewards", "group"))
    if scale == "batch":
        raise r.refuse("scale_rewards", "(the batch std) is not supported; use group or none, or set "
                                        "advantage_estimator: reinforce_pp_baseline in --config (group mean, then "
                                        "whitened over the batch)")
    if scale not in ("group", "none"):
        raise r.refuse("scale_rewards", "is not one of group, none, batch")
    if r.current("advantage_estimator") == "gae":
        r.set("advantage_estimator", "grpo" if scale == "group" else "dr_grpo", "scale_rewards")
    elif r.has("scale_rewards"):
        r.ignore("scale_rewards", f"advantage_estimator is {r.current('advantage_estimator')}")
    loss_type = r.get("loss_type")
    if loss_type is not None:
        if loss_type not in _LOSS_AGGREGATION:
            raise r.refuse("loss_type", f"is not supported; use one of {', '.join(_LOSS_AGGREGATION)}")
        r.set("loss_aggregation", _LOSS_AGGREGATION[loss_type], "loss_type")
    if r.has("num_generations"):
        r.set("samples_per_prompt", r.get("num_generations"), "num_generations")
    elif r.current("samples_per_prompt") < 2:
        r.set("samples_per_prompt", TRL_GRPO_GENERATIONS, "num_generations (TRL's default)")


def kl_correction(r: TrlReader) -> None:
    if r.get("use_bias_correction_kl") is True and r.current("kl_coef") > 0:
        raise r.refuse("use_bias_correction_kl", "with beta > 0 is not supported: rlhf ppo's KL term is the plain "
                                                 "k3 estimate, not weighted by the importance ratio; set it to false")


_LORA_KEYS = {"lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "lora_target_modules": "lora_target_modules"}


def peft(r: TrlReader) -> None:
    """ModelConfig's use_peft: lora_r (TRL's 16 when absent: our lora_rank 0 is off) and the other
    lora_* keys; without use_peft TRL reads none of them."""
    if not r.get("use_peft"):
        for key in ("lora_r", *_LORA_KEYS):
            if r.has(key):
                r.ignore(key, "use_peft is false")
        return
    r.set("lora_rank", r.get("lora_r", 16), "lora_r" if r.has("lora_r") else "use_peft")
    for key, name in _LORA_KEYS.items():
        if r.has(key):
            r.set(name, r.get(key), key)


def deepspeed_file(r: TrlReader) -> None:
    if not isinstance(r.get("deepspeed"), str):
        raise r.refuse("deepspeed", "is not a file name; save the DeepSpeed config to a file and name it here "
                                    "(or pass --deepspeed-config)")
