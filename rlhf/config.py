"""Typed configuration: dataclasses with a docstring per field, a YAML/JSON file, CLI overrides.

Precedence, lowest first: dataclass defaults < `--deepspeed-config` (engine keys) < `--config`
file < explicit CLI flags. Every section's field names are unique across sections, so each field is
also a CLI flag (`micro_batch_size` -> `--micro-batch-size`) and may appear in a config file either
flat or under its section (`engine:`, `data:`, `tracking:`). The resolved config is saved beside
every output as config.yaml.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf.engine.config import EngineConfig
from rlhf.errors import UserError


@dataclass
class DataConfig:
    """Where rows come from and how they become token sequences."""

    data: list[str] = field(default_factory=list)
    """Datasets: local json/jsonl/parquet/csv files, load_from_disk folders, or hub names (repeat the flag for several)."""
    data_split: str | None = None
    """Share one dataset between the stages sft,reward,ppo, e.g. 2,4,4; each stage takes its seeded, disjoint part."""
    eval_split: float = 0.0
    """Fraction of this stage's rows held out for evaluation (0 disables evaluation unless eval_data is given)."""
    eval_data: list[str] = field(default_factory=list)
    """Separate held-out evaluation data (same formats as data); used instead of eval_split."""
    max_seq_len: int = 512
    """Maximum prompt + response tokens; longer responses are truncated and counted, over-long prompts dropped and counted."""
    train_on_prompt: bool = False
    """SFT only: include prompt tokens in the loss (by default only response tokens are trained)."""


@dataclass
class TrackingConfig:
    """Experiment tracking. metrics.jsonl is always written."""

    report_to: str = "wandb"
    """Comma-separated trackers: wandb, tensorboard, or none. W&B runs offline without credentials or network (WANDB_MODE is respected)."""
    wandb_project: str = "rlhf"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (team or user); default is the logged-in user's."""
    run_name: str | None = None
    """Run name; defaults to <stage>-<output folder name>."""
    wandb_group: str | None = None
    """W&B group (e2e runs put their three stages in one group)."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""


@dataclass
class RunConfig:
    """Fields every stage has."""

    output: str = ""
    """Output folder: model/, config.yaml, metrics.jsonl, summary.json, checkpoints/, DONE."""
    epochs: int = 1
    """Passes over the training rows (ignored when max_steps > 0)."""
    max_steps: int = -1
    """Train for exactly this many optimizer steps, over as many epochs as needed; -1 runs `epochs` epochs."""
    eval_interval: int = 0
    """Evaluate every this many optimizer steps (0: only at the end)."""
    save_interval: int = 0
    """Write a resume checkpoint every this many optimizer steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many resume checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: bool = False
    """Continue from the latest checkpoint in <output>/checkpoints."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass
class StageConfig(RunConfig):
    """A stage that starts from one model (sft, reward)."""

    model: str = ""
    """Starting model: a local Hugging Face folder (e.g. a previous stage's <output>/model) or a hub name."""


@dataclass
class SFTConfig(StageConfig):
    """Supervised fine-tuning of a causal LM on demonstrations."""


@dataclass
class RewardConfig(StageConfig):
    """Reward-model training on preference pairs: a causal LM backbone plus a scalar value head."""

    value_head_init_std: float = 0.0
    """Initial value-head weights: 0 gives a zero head (every score starts at 0, no preference); > 0 draws them from N(0, std). Ignored when --model is already a reward model."""


KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class PPOConfig(RunConfig):
    """PPO on prompts with a frozen reference and reward model and a trained critic.

    Defaults follow InstructGPT / DeepSpeed-Chat / TRL practice; each field says which.
    `max_steps` and `epochs` count PPO iterations and passes over the prompts.
    """

    actor: str = ""
    """The policy to train: usually the SFT stage's <output>/model."""
    reward: str = ""
    """The reward model (the reward stage's <output>/model); frozen. Not needed with --reward-fn."""
    critic: str | None = None
    """The critic's starting point: a value model or causal LM folder; defaults to --reward (DeepSpeed-Chat)."""
    ref: str | None = None
    """The frozen reference policy for the KL penalty; defaults to --actor."""
    reward_fn: str | None = None
    """Use a built-in task's ground-truth checker as the reward instead of a reward model (verifiable rewards)."""
    actor_zero_stage: int | None = None
    """ZeRO stage of the actor; defaults to --zero-stage."""
    critic_zero_stage: int | None = None
    """ZeRO stage of the critic; defaults to --zero-stage."""
    critic_lr: float | None = None
    """Critic learning rate (separate optimizer); defaults to --lr."""
    inference_tp_size: int = 1
    """Tensor-parallel degree of the actor in rollout mode; must divide the world size."""
    rollout_parity_tolerance: float | None = None
    """Max |log-prob| difference between train and rollout mode before failing (default: 1e-3 fp32, 0.15 bf16/fp16)."""
    max_prompt_len: int = 256
    """Prompts longer than this many tokens are dropped and counted."""
    max_new_tokens: int = 128
    """Response tokens generated per prompt."""
    generation_batch_size: int = 8
    """Rollout samples per rank per PPO iteration (the experience batch; a TP group generates tp times this)."""
    ppo_epochs: int = 1
    """Passes over each iteration's experience (TRL: 4; DeepSpeed-Chat: 1)."""
    min_new_tokens: int = 0
    """Suppress EOS until this many response tokens (e.g. to forbid empty responses, or for benchmarks)."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    top_k: int = 0
    """Top-k sampling of rollouts (0: off)."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling of rollouts (1: off)."""
    greedy: bool = False
    """Greedy rollouts (for debugging and tests; PPO needs sampling to explore)."""
    offload_ref: bool = False
    """Keep the frozen reference model's shards on CPU."""
    offload_reward: bool = False
    """Keep the frozen reward model's shards on CPU."""
    kl_coef: float = 0.05
    """Initial KL penalty coefficient beta (TRL 0.05; InstructGPT 0.02; DeepSpeed-Chat 0.1)."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimate in the reward: k1 = log p - log q (InstructGPT), k3 = unbiased, always >= 0 (Schulman)."""
    adaptive_kl: bool = False
    """Adapt kl_coef towards kl_target (Ziegler et al. 2019)."""
    kl_target: float = 6.0
    """Adaptive KL target, summed over a response (TRL default)."""
    kl_horizon: int = 10000
    """Adaptive KL horizon in samples (TRL default)."""
    gamma: float = 1.0
    """GAE discount (DeepSpeed-Chat, TRL)."""
    lam: float = 0.95
    """GAE lambda (DeepSpeed-Chat, TRL)."""
    clip_range: float = 0.2
    """PPO policy ratio clip (Schulman et al.; all three)."""
    clip_range_value: float = 0.2
    """Value clip around the rollout values (DeepSpeed-Chat, TRL)."""
    reward_clip: float = 5.0
    """Clip the (normalised) score to [-c, c] (DeepSpeed-Chat clip_reward_value)."""
    normalize_reward: bool = True
    """Normalise scores with the reward stage's score_mean/score_std (from its summary.json)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of responses that end without EOS (TRL's missing_eos_penalty; 0: off)."""
    whiten_advantages: bool = True
    """Whiten advantages over the global experience batch (all three)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient in the policy loss (0: off, as in InstructGPT)."""
    ptx_data: list[str] = field(default_factory=list)
    """Pretraining/SFT data mixed into the actor loss (InstructGPT's PPO-ptx); needs ptx_coef > 0."""
    ptx_coef: float = 0.0
    """Weight of the PTX language-modelling loss (InstructGPT used 27.8 on their scale; DeepSpeed-Chat 1.0)."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the actor (DeepSpeed-Chat 0.992), saved to model_ema/; 0: off."""
    sample_log_interval: int = 10
    """Log a table of sample prompts/responses/scores every this many iterations."""


@dataclass
class E2EConfig:
    """`rlhf e2e`: SFT -> reward -> PPO chained. Stage settings go in the config file's `sft:`,
    `reward:`, `ppo:` sections or in prefixed flags (`--sft.lr 1e-3`, `--ppo.kl-coef 0.1`)."""

    output: str = "runs/e2e"
    """Run folder: sft/, reward/, ppo/, data/, base/ and summary.json. Re-running skips finished stages and resumes an interrupted one."""
    model: str | None = None
    """Base model (local folder or hub name); by default a tiny model is built from a config."""
    tiny_family: str = "llama"
    """Family of the built-in tiny base model (llama, qwen2, mistral, opt, gpt2)."""
    tiny_hidden_size: int = 64
    """Hidden size of the built-in tiny base model."""
    tiny_layers: int = 2
    """Decoder layers of the built-in tiny base model."""
    task: str = "sort"
    """Built-in task whose generated data the stages train on and whose checker measures success."""
    data: list[str] = field(default_factory=list)
    """Your own dataset instead of the task's: shared by the stages through data_split; no task success is measured."""
    data_split: str = "2,4,4"
    """Shares of --data for sft,reward,ppo."""
    reward_fn: str | None = None
    """PPO rewards from this task's checker instead of the reward model (the reward stage is then skipped)."""
    n_sft: int = 16000
    """Task SFT demonstrations (a wrong_fraction share of them wrong)."""
    wrong_fraction: float = 0.35
    """Share of wrong answers among the task's SFT demonstrations."""
    n_pairs: int = 32000
    """Task preference pairs for the reward model."""
    n_prompts: int = 8192
    """Task prompts for PPO."""
    n_eval_pairs: int = 512
    """Held-out task pairs for reward-model accuracy."""
    n_eval_prompts: int = 512
    """Held-out task prompts for the success rate of sampled responses."""
    eval_temperature: float = 1.0
    """Sampling temperature when measuring task success."""
    eval_max_new_tokens: int = 10
    """Response budget when measuring task success."""
    seed: int = 0
    """Seed of the data, the models and every stage."""
    report_to: str = "wandb"
    """Trackers of every stage (one W&B group per e2e run; offline without credentials)."""
    wandb_project: str = "rlhf"
    """W&B project of every stage."""


SECTIONS: tuple[str, ...] = ("engine", "data", "tracking")


# ---------------------------------------------------------------- introspection


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (the string literal after each field) of a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field of a config: its section path, name, type and docstring."""

    section: str | None
    name: str
    type: Any
    doc: str
    default: Any


def _resolved_hints(cls: type) -> dict[str, Any]:
    module = inspect.getmodule(cls)
    return typing.get_type_hints(cls, globalns=vars(module) if module else None)


def leaf_fields(cls: type) -> list[FieldInfo]:
    """All leaf fields of a stage config, sections flattened (names are unique across sections)."""
    hints = _resolved_hints(cls)
    out: list[FieldInfo] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub_hints = _resolved_hints(tp)
            sub_docs = field_docs(tp)
            for sf in dataclasses.fields(tp):
                default = sf.default if sf.default is not dataclasses.MISSING else sf.default_factory()  # type: ignore[misc]
                out.append(FieldInfo(f.name, sf.name, sub_hints[sf.name], sub_docs.get(sf.name, ""), default))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append(FieldInfo(None, f.name, tp, field_docs(cls).get(f.name, ""), default))
    names = [fi.name for fi in out]
    duplicates = {n for n in names if names.count(n) > 1}
    assert not duplicates, f"config field names must be unique across sections: {duplicates}"
    return out


# ---------------------------------------------------------------- values


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a value from YAML/JSON/CLI text to the field type, or raise a UserError naming `where`."""
    base, optional = _strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(f"{where}: a value is required")
    origin = typing.get_origin(base)
    try:
        if origin is Literal:
            choices = typing.get_args(base)
            if value not in choices:
                raise UserError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
            return value
        if origin is list:
            (item_tp,) = typing.get_args(base)
            items = value.split(",") if isinstance(value, str) else list(value)
            return [coerce(v, item_tp, where) for v in items]
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: expected {getattr(base, '__name__', base)}, got {value!r}") from None
    return value


def set_field(config: Any, info: FieldInfo, value: Any, where: str) -> None:
    """Set one leaf field, converting its type."""
    target = getattr(config, info.section) if info.section else config
    setattr(target, info.name, coerce(value, info.type, where))


def apply_mapping(config: Any, mapping: dict[str, Any], source: str) -> None:
    """Apply a flat or sectioned mapping (from a config file) onto a stage config."""
    by_name = {fi.name: fi for fi in leaf_fields(type(config))}
    for key, value in mapping.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                info = by_name.get(sub_key)
                if info is None or info.section != key:
                    raise UserError(f"{source}: unknown key '{key}.{sub_key}'; see `rlhf <stage> --help` for the fields")
                set_field(config, info, sub_value, f"{source}: {key}.{sub_key}")
            continue
        info = by_name.get(key.replace("-", "_"))
        if info is None:
            raise UserError(f"{source}: unknown key '{key}'; see `rlhf <stage> --help` for the fields")
        set_field(config, info, value, f"{source}: {key}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON config file into a mapping, with one clear error on failure."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of field names to values")
    return data


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data (sections nested), for config.yaml and trackers."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def load_saved_config(cls: type, path: str | Path) -> Any:
    """Read a config.yaml written by `save_config` back into `cls`."""
    config = cls()
    apply_mapping(config, read_config_file(path), str(path))
    return config
