"""Typed configuration: dataclasses with a docstring per field, a YAML/JSON file, CLI overrides.

Precedence, lowest first: dataclass defaults < `--deepspeed-config` (engine keys) < `--trl-config`
(a TRL trainer config, `rlhf.trl_config`) < `--config` file < explicit CLI flags, applied by
`rlhf.config_sources.resolve_config` alone. Every section's field names are unique
across sections, so each field is also a CLI flag (`micro_batch_size` -> `--micro-batch-size`) and
may appear in a config file either flat or under its section (`engine:`, `data:`, `tracking:`, `lora:`). The
resolved config is saved beside every output as config.yaml.

A field's docstring opens with its help, one paragraph of at most ~160 characters (what the flag
does, its unit or choices), which `--help` shows; further paragraphs, after a blank line, are the
longer explanation, which docs/config.md shows too (`python -m rlhf.config_docs` writes it).

Each value is checked once, where its field is defined: its type (Literal choices included) and its
rule (`bounded(default, ge=..)`, `checked(default, rule)`) when it is set from any source, with one
error line "<source>: <value> must be <rule>"; rules between fields are each dataclass's
`validate()`, run once after every source is applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf.algorithms.estimators import ESTIMATORS, AdvantageEstimator, Estimator
from rlhf.algorithms.preference_types import LABEL_SMOOTHED, REFERENCE_FREE, PreferenceLoss
from rlhf.config_fields import (  # re-exported: the stage configs' machinery
    FieldInfo, coerce, field_docs, fields_by_name, leaf_fields, parse_value, set_field, strip_optional,
)
from rlhf.engine.backends import RENAMED_FIELDS, CpuConfig, CudaConfig
from rlhf.engine.config import Bounds, EngineConfig, ZeroStage, bounded, checked
from rlhf.errors import UserError


@dataclass(frozen=True)
class SplitShares:
    """The rule of `data_split`: three comma-separated non-negative numbers with a positive sum."""

    def violation(self, value: Any) -> str | None:
        rule = "three non-negative numbers sft,reward,ppo with a positive sum, like 2,4,4"
        if value == "":
            return None  # empty: no split, as when unset
        try:
            weights = [float(w) for w in str(value).split(",")]
        except ValueError:
            return rule
        ok = len(weights) == 3 and all(math.isfinite(w) and w >= 0 for w in weights) and sum(weights) > 0
        return None if ok else rule


def column_renames(items: list[str]) -> dict[str, str]:
    """`data_columns` items NEW=OLD (an item may hold several, comma-separated) -> {NEW: OLD}; a
    ValueError naming the first bad item."""
    renames: dict[str, str] = {}
    for item in (part.strip() for value in items for part in str(value).split(",")):
        if not item:
            continue
        new, sep, old = (p.strip() for p in item.partition("="))
        if not sep or not new or not old:
            raise ValueError(f"{item!r} is not NEW=OLD")
        if new in renames:
            raise ValueError(f"{new!r} is the new name of two columns")
        if old in renames.values():
            raise ValueError(f"{old!r} is renamed twice")
        renames[new] = old
    return renames


@dataclass(frozen=True)
class ColumnRenames:
    """The rule of `data_columns`: NEW=OLD items, each new name and each old column named once."""

    def violation(self, value: Any) -> str | None:
        try:
            column_renames(value)
        except ValueError as exc:
            return f"NEW=OLD column renames like prompt=question,answer=solution ({exc})"
        return None


@dataclass(frozen=True)
class PositiveWeights:
    """The rule of `data_mix`: positive, finite numbers."""

    def violation(self, value: Any) -> str | None:
        ok = all(math.isfinite(w) and w > 0 for w in value)
        return None if ok else "positive numbers, one per --data, like 0.7,0.3"


@dataclass(frozen=True)
class StepCount(Bounds):
    """The rule of `max_steps`: -1 (train `epochs` epochs) or a positive number of steps; 0 would
    silently mean a full epoch."""

    def violation(self, value: Any) -> str | None:
        if value == 0 or (isinstance(value, int) and value < -1):
            return "-1 (train --epochs epochs) or >= 1"
        return super().violation(value)


@dataclass
class DataConfig:
    """Where rows come from and how they become token sequences."""

    data: list[str] = field(default_factory=list)
    """Datasets: local json/jsonl/parquet/csv files, load_from_disk folders, or hub names (repeat the flag for
    several)."""
    data_split: str | None = checked(None, SplitShares())
    """Share one dataset between the stages sft,reward,ppo, e.g. 2,4,4; each stage takes its seeded, disjoint part."""
    eval_split: float = bounded(0.0, ge=0, lt=1)
    """Fraction of this stage's rows held out for evaluation (0 disables evaluation unless eval_data is given)."""
    eval_data: list[str] = field(default_factory=list)
    """Separate held-out evaluation data (same formats as data); used instead of eval_split."""
    max_seq_len: int = bounded(512, ge=2)
    """Maximum prompt + response tokens; longer responses are truncated and counted, over-long prompts dropped and
    counted.

    At most the model's max_position_embeddings: a larger value is capped there, with one log line, so no row is
    trained on positions the model has none for.
    """
    train_on_prompt: bool = False
    """SFT only: include prompt tokens in the loss (by default only response tokens are trained)."""
    train_last_turn_only: bool = False
    """SFT only: of a multi-turn conversation train only the last assistant turn (default: every assistant turn, as
    TRL's assistant_only_loss)."""
    chat_template: str | None = None
    """A Jinja chat template file (.jinja) used instead of the tokenizer's; the exported model's tokenizer carries
    it."""
    data_config: str | None = None
    """The config (subset) of each --data dataset, for hub datasets and folders whose README.md defines several (e.g.
    main).

    A single file or save_to_disk folder has none.
    """
    data_train_split: str = "train"
    """The split of each --data dataset to train on (e.g. train_prefs).

    A json/jsonl/parquet/csv file has only train, unless it is a .json object of splits
    {"train": [...], "test": [...]}.
    """
    data_test_split: str | None = None
    """A split of each --data dataset to evaluate on (e.g. test_prefs): the eval set instead of eval_split.

    The split is used whole: neither mixed by data_mix nor shared out by data_split. eval_split is then
    unused, with a warning. Not with eval_data. ppo answers its prompts greedily and scores them with
    eval_reward_fn.
    """
    data_columns: list[str] = field(default_factory=list, metadata={"rule": ColumnRenames()})
    """Column renames NEW=OLD, comma-separated (prompt=question,answer=solution), applied before the row format is
    detected.

    Every row of --data (both splits) and of --eval-data is renamed; --ptx-data is not.
    """
    data_mix: list[float] = field(default_factory=list, metadata={"rule": PositiveWeights()})
    """With several --data: the share of each in the training rows, comma-separated (e.g. 0.7,0.3).

    Each dataset gives a seeded sample without replacement, as many rows as the shares allow: the dataset
    that runs out first bounds the total. The log counts what each gave and left out. The rows are mixed
    before the stage takes its data_split share.
    """

    @property
    def column_renames(self) -> dict[str, str]:
        """`data_columns` as {NEW: OLD}."""
        return column_renames(self.data_columns)

    def validate(self, where: str = "config") -> None:
        if self.data_mix and len(self.data_mix) != len(self.data):
            raise UserError(f"{where}: data_mix: {len(self.data_mix)} weights for {len(self.data)} --data datasets; "
                            "give one weight per --data, in order")
        if self.data_test_split is not None:
            if self.eval_data:
                raise UserError(f"{where}: data_test_split: {self.data_test_split!r} and eval_data both name the eval "
                                "set; pass one of them")
            if self.data_test_split == self.data_train_split:
                raise UserError(f"{where}: data_test_split: {self.data_test_split!r} is also data_train_split; "
                                "evaluate on another split")


@dataclass
class TrackingConfig:
    """Experiment tracking. metrics.jsonl is always written."""

    report_to: str = "wandb"
    """Comma-separated trackers: wandb, tensorboard, or none. W&B runs offline without credentials or network
    (WANDB_MODE is respected)."""
    wandb_project: str = "rlhf"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (team or user); default is the logged-in user's."""
    run_name: str | None = None
    """Run name; defaults to <stage>-<output folder name>."""
    wandb_group: str | None = None
    """W&B group (e2e runs put their three stages in one group)."""
    wandb_init_timeout: float = bounded(10.0, gt=0)
    """Seconds an online W&B run may take to reach its server; past them (no network, a wrong WANDB_BASE_URL) the run
    logs offline, with one warning."""
    log_interval: int = bounded(1, ge=1)
    """Log metrics every this many optimizer steps."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft LoRA) instead of full fine-tuning of the trained models."""

    lora_rank: int = bounded(0, ge=0)
    """LoRA rank r: train rank-r adapters beside each target linear layer, the base weights frozen. 0: full
    fine-tuning.

    An adapted layer computes W + alpha/r x B A with adapters A and B; Adam keeps state only for the
    adapters. In ppo the reference model is then the actor with its adapters disabled (no second copy),
    and rollouts use the merged weights. A reward model or critic trains its value head fully.
    """
    lora_alpha: float = bounded(16.0, gt=0)
    """LoRA scaling numerator: adapters add alpha/rank x B A (16 with rank 8 is a scale of 2)."""
    lora_dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training (sft, reward; ppo turns every dropout off)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt (suffixes such as q_proj v_proj), or all-linear: every linear projection inside the
    decoder layers.

    all-linear covers the attention and MLP projections; not the embeddings, the LM head or the value head.
    """
    export_adapter: bool = False
    """Export the trained adapter in peft format instead of merged weights (default: the merged model, a plain Hugging
    Face folder).

    The adapter folder holds adapter_config.json and adapter_model.safetensors, loadable with peft's
    PeftModel.from_pretrained on the base model. The merged model is what the next stage loads.
    """

    def validate(self, where: str = "config") -> None:
        if self.export_adapter and self.lora_rank == 0:
            raise UserError(f"{where}: export_adapter: true needs lora_rank > 0 (there is no adapter to export)")
        if not self.lora_target_modules or any(not name.strip() for name in self.lora_target_modules):
            raise UserError(f"{where}: lora_target_modules: {self.lora_target_modules} must name modules "
                            "(e.g. q_proj v_proj), or be all-linear")


@dataclass
class RunConfig:
    """Fields every stage has."""

    output: str = ""
    """Output folder: model/, config.yaml, metrics.jsonl, summary.json, checkpoints/, DONE."""
    epochs: int = bounded(1, ge=1)
    """Passes over the training rows (ignored when max_steps > 0)."""
    max_steps: int = checked(-1, StepCount(ge=-1))
    """Train for exactly this many optimizer steps, over as many epochs as needed; -1 runs `epochs` epochs."""
    eval_interval: int = bounded(0, ge=0)
    """Evaluate every this many optimizer steps (0: only at the end)."""
    save_interval: int = bounded(0, ge=0)
    """Write a resume checkpoint every this many optimizer steps (0: none; see save_final_checkpoint)."""
    save_final_checkpoint: bool = False
    """Also write a resume checkpoint after the last step, which extending a finished run (a larger max_steps/epochs)
    resumes from.

    Off by default: a finished stage is marked DONE, and the checkpoint (model, optimizer state, RNG) is
    several times the size of the exported model (1.7 GB for SFT of a 135M model). The --save-interval
    checkpoints, which an interrupted run resumes from, are written either way.
    """
    keep_checkpoints: int = bounded(2, ge=1)
    """How many resume checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: bool = False
    """Continue from the latest checkpoint in <output>/checkpoints."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)

    def validate(self, where: str = "config") -> None:
        """Rules between fields, checked once after every source is applied (`rlhf.config_sources.resolve_config`)."""
        self.engine.validate(where)
        self.data.validate(where)
        self.lora.validate(where)


@dataclass
class StageConfig(RunConfig):
    """A stage that starts from one model (sft, reward)."""

    model: str = ""
    """Starting model: a local Hugging Face folder (e.g. a previous stage's <output>/model) or a hub name."""
    max_tokens_per_micro_batch: int = bounded(0, ge=0)
    """Regroup each optimizer step's rows by length into micro-batches of at most this many padded tokens: the same
    step, less padding. 0: off.

    The step's rows (micro_batch_size x grad_accum per rank) are regrouped into as many micro-batches on
    every rank. The loss is normalised by the step's global token (pair) count either way, so the step is
    the same. 0: micro_batch_size rows each.
    """
    pack_sequences: bool = True
    """With --max-tokens-per-micro-batch, run each micro-batch's real tokens packed end to end (no padding computed)
    where the model allows.

    sft packs the LM's forward, reward the forwards that score the chosen and rejected sequences. Packed
    rows restart their positions under a block-diagonal mask. A micro-batch is packed when the model packs
    (Llama, Qwen2, Mistral; not LoRA; float32 on the CPU with --fused-layers), it holds at most 4096 real
    tokens, and that is fewer tokens than its padded forward. Loss and gradients are the same up to rounding.
    """


@dataclass
class SFTConfig(StageConfig):
    """Supervised fine-tuning of a causal LM on demonstrations."""


@dataclass
class RewardConfig(StageConfig):
    """Reward-model training on preference pairs: a causal LM backbone plus a scalar value head."""

    value_head_init_std: float | None = bounded(None, ge=0)
    """Initial value-head weights drawn from N(0, std); unset: std 1/sqrt(hidden_size + 1). Ignored when --model is
    already a reward model.

    The default follows OpenRLHF's and TRL's classifier heads, so the backbone gets a gradient from the
    first step; a zero head (std 0) gives it none, and a real model then learns nothing.
    """
    center_rewards_coef: float = bounded(0.0, ge=0)
    """Add coef x mean((score_chosen + score_rejected)^2) to the pairwise loss, pulling the scores towards mean zero.
    0: off.

    Eisenstein et al. 2023, eq. 2; TRL's center_rewards_coefficient, which recommends 0.01.
    """
    disable_dropout: bool = False
    """Turn off every dropout layer of the backbone in training, as TRL's RewardTrainer does. Off: the model's own
    dropout config applies.

    LoRA's adapter dropout (--lora-dropout) stays.
    """


@dataclass
class DPOConfig(StageConfig):
    """Offline preference optimisation (DPO and its family) of a causal LM on preference pairs.

    Defaults follow TRL's DPOConfig (beta 0.1, sigmoid loss, dropout off, a frozen reference copy).
    """

    ref: str | None = None
    """The frozen reference policy; defaults to --model (with LoRA: --model's weights with the adapters off, no copy)."""
    loss_type: PreferenceLoss = "sigmoid"
    """sigmoid (DPO) arXiv:2305.18290, ipo 2310.12036, hinge (SLiC) 2305.10425, robust 2403.00409, simpo (no reference)
    2405.14734, apo_zero 2408.06266: TRL's names.

    The papers: DPO, Rafailov et al. 2023 (with --label-smoothing: conservative DPO); IPO, Azar et al.
    2023; SLiC-HF, Zhao et al. 2023; robust DPO, Chowdhury et al. 2024; SimPO, Meng et al. 2024
    (length-normalised, reference-free, margin --simpo-gamma); APO, D'Oosterlinck et al. 2024. The
    formulas are in docs/algorithms.md.
    """
    beta: float = bounded(0.1, gt=0)
    """The KL strength beta of the implicit reward beta x log(pi / ref) (TRL 0.1; SimPO's paper uses 2.0-2.5)."""
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    """Probability that a pair's label is flipped (sigmoid: cDPO; robust: rDPO; simpo); 0: the plain losses."""
    simpo_gamma: float = bounded(0.5, ge=0)
    """SimPO's target reward margin gamma (TRL's CPOConfig 0.5); only --loss-type simpo reads it."""
    rpo_alpha: float = bounded(0.0, ge=0)
    """Add alpha x the chosen response's mean token NLL to each pair's loss (RPO, arXiv:2404.19733; TRL's rpo_alpha).
    0: off.

    It keeps the chosen responses likely: DPO alone may lower the likelihood of both responses while it
    widens their margin, and a sampled policy then drifts to answers neither response holds. TRL 1.x
    writes it as loss_type [sigmoid, sft] with loss_weights [1, alpha]; the NLL here is each pair's
    own mean over its chosen tokens.
    """
    precompute_ref_logprobs: bool = False
    """Compute the reference log-probs of every pair once before training, then free the reference model.

    Saves the reference forward of every step and its memory during training; the log-probs are the ones
    the reference computes on the fly (it is frozen), so the run is the same.
    """
    share_prompt_forward: bool = True
    """Run each pair's prompt once for its chosen and rejected responses (training and reference forwards), where it
    pays (--share-prompt-min-gflop).

    The prompt's keys and values are copied to both rows (engine/prompt_sharing.py); log-probs and gradients
    are those of two plain forwards up to rounding.
    """
    share_prompt_min_gflop: float = bounded(0.2, ge=0)
    """Share a micro-batch's prompts only where that saves at least this many GFLOP (2 x parameters per token); 0:
    always.

    Sharing runs two forwards (the prompts, then the responses) where the plain path runs one, and a
    forward has a fixed cost of op dispatch: about 2.5 ms for a 2-layer, 64-wide Llama on a CPU, some
    0.2 GFLOP at two cores' speed. Measured on such a model (8 pairs, prompts of ~25 tokens): 12.9 ms a
    step shared, 10.7 ms plain; on SmolLM2-135M sharing saves half the tokens.
    """
    offload_ref: bool = False
    """Keep the frozen reference model's shards on CPU."""
    disable_dropout: bool = True
    """Turn off every dropout layer of the policy in training, as TRL's DPOTrainer does (the reference has none)."""

    def validate(self, where: str = "config") -> None:
        super().validate(where)
        if self.label_smoothing > 0 and self.loss_type not in LABEL_SMOOTHED:
            raise UserError(f"{where}: label_smoothing {self.label_smoothing} does not change loss_type "
                            f"{self.loss_type}; use one of {sorted(LABEL_SMOOTHED)} or set it to 0")
        if self.loss_type in REFERENCE_FREE and self.precompute_ref_logprobs:
            raise UserError(f"{where}: precompute_ref_logprobs with loss_type {self.loss_type}, which reads no "
                            "reference model; drop one of them")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads a reference model's log-probs (every loss type but SimPO)."""
        return self.loss_type not in REFERENCE_FREE


KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLPlacement = Literal["auto", "reward", "loss"]
ImportanceRatio = Literal["token", "sequence"]
KVCacheDtype = Literal["auto", "model", "fp16"]  # engine/sampling.py's KV_CACHE_DTYPES
RolloutIS = Literal["auto", "truncate", "mask", "off"]  # rlhf/algorithms/ppo_math.py's ROLLOUT_IS_MODES + auto


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
    reward_fn: list[str] = field(default_factory=list)
    """Reward functions: a built-in task's checker (sort, arithmetic_words, larger_number), path/to/file.py:function or
    package.module:function.

    A function is called per sample, f(prompt, response, **row_fields) -> float | None, or in TRL's
    GRPOTrainer convention, f(prompts, completions, completion_ids, trainer_state, log_metric, log_extra,
    **columns) -> list[float | None], with messages for conversational rows. None leaves a sample to the
    other reward sources. async def functions are awaited together (rlhf/reward_functions.py).
    """
    reward_weights: list[float] = field(default_factory=list)
    """Weights of the reward sources, comma-separated: the --reward model first (when given), then each --reward-fn in
    order; default all 1."""
    reward_timeout: float = bounded(300.0, ge=0)
    """Seconds one --reward-fn call (a row, or a batch for TRL-style functions) may take before the run stops naming
    the row; 0: no limit.

    A sync function is interrupted where it runs (a sleep, a socket wait or a Python loop wakes), an async
    one cancelled. One stuck in C code that never returns to Python cannot be stopped: the run then ends
    5 s later with the same line (exit code 2).
    """
    tools: list[str] = field(default_factory=list)
    """Tools the policy may call in its rollouts: path/to/file.py:fn1,fn2 or module:fn1,fn2 (TRL's tools=).

    Plain functions, sync or async, with type hints and a Google-style docstring; their JSON schemas
    (transformers' get_json_schema) are rendered into every prompt by the chat template, which must render
    tools. A rollout then runs turns: generate until EOS, run the turn's tool calls, append their responses
    as tokens, generate again (docs/tools.md).
    """
    environment: str | None = None
    """TRL's environment_factory: path/to/file.py:Class; one instance per rollout, its public methods the tools.

    reset(**row) returns None or text appended to the last user message; an optional get_reward() is a
    reward source named after the class (weight 1 unless --reward-weights says otherwise).
    """
    max_tool_calls: int = bounded(8, ge=1)
    """Turns with tool calls a rollout may make; the turn after the last one answers without running its calls."""
    tool_timeout: float = bounded(30.0, ge=0)
    """Seconds a tool call may take; a call past it answers the model with a timeout error. 0: no limit."""
    advantage_estimator: AdvantageEstimator = "gae"
    """gae: PPO with a critic; grpo, dr_grpo: group-normalised scores; rloo: leave-one-out baseline;
    reinforce_pp(_baseline): REINFORCE++. Only gae trains a critic.

    gae: generalised advantage estimation with a critic (Schulman et al. 2016/2017). grpo: group-normalised
    scores (Shao et al. 2024, DeepSeekMath). dr_grpo: group mean only, constant-normalised loss (Liu et al.
    2025, "Understanding R1-Zero-Like Training"). rloo: leave-one-out baseline (Ahmadian et al. 2024, "Back
    to Basics"). reinforce_pp: REINFORCE++ with globally whitened returns (Hu 2025). reinforce_pp_baseline:
    REINFORCE++ with a group-mean baseline.
    """
    samples_per_prompt: int = bounded(1, ge=1)
    """Responses sampled per prompt (a group; its prompt is prefilled once); >= 2 for grpo, dr_grpo, rloo,
    reinforce_pp_baseline."""
    loss_aggregation: LossAggregation = "auto"
    """How per-token losses become one: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm; auto picks one by
    estimator and importance ratio.

    token-mean: as PPO and DAPO. seq-mean-token-mean: as the GRPO paper and GSPO. seq-mean-token-sum-norm:
    as Dr. GRPO, token sums over max_new_tokens. auto: seq-mean-token-sum-norm for dr_grpo,
    seq-mean-token-mean with --importance-ratio sequence, else token-mean.
    """
    clip_range_low: float | None = bounded(None, gt=0, lt=1)
    """Lower policy-ratio clip (ratio >= 1 - low); defaults to --clip-range."""
    clip_range_high: float | None = bounded(None, gt=0)
    """Upper policy-ratio clip (ratio <= 1 + high); defaults to --clip-range; DAPO's clip-higher uses 0.28 with low
    0.2."""
    importance_ratio: ImportanceRatio = "token"
    """token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio (Zheng et al. 2025; use clip
    ranges ~3e-4/4e-4)."""
    kl_placement: KLPlacement = "auto"
    """Where the KL to the reference goes: reward (a per-token penalty) or loss (a --kl-estimator term x --kl-coef);
    auto: loss for grpo, dr_grpo, else reward.

    reward: as InstructGPT, REINFORCE++ and RLOO. loss: as GRPO.
    """
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards all tie (no learning signal) and refill from more prompts,
    up to --dynamic-sampling-rounds generation rounds."""
    dynamic_sampling_rounds: int = bounded(4, ge=1)
    """Most generation rounds per iteration with --dynamic-sampling (tied groups fill what is still missing after
    them); rounds that keep no group at all stop the run."""
    max_zero_signal_iters: int = bounded(3, ge=0)
    """Warn when every group's rewards tie (no learning signal: GRPO's advantage is 0 for every sample) this many
    iterations in a row; 0: never.

    A group estimator (grpo, dr_grpo, rloo, reinforce_pp_baseline) compares a prompt's samples, so a group
    is a prompt's samples; for gae and reinforce_pp the whole batch is one group. Ties come from a constant
    reward, one that ignores the response, or samples that do not differ.
    """
    overlong_buffer: int = bounded(0, ge=0)
    """DAPO's soft overlong penalty: responses longer than max_new_tokens - this lose up to --overlong-penalty
    linearly (0: off)."""
    overlong_penalty: float = bounded(1.0, ge=0)
    """The overlong penalty at max_new_tokens (DAPO: 1.0)."""
    share_prompt_forward: bool = True
    """With --samples-per-prompt > 1, run each group's shared prompt once in the training and reference forwards, where
    it pays (--share-prompt-min-gflop).

    The prompt's keys and values are copied to the group's rows; log-probs and gradients are the same up to
    rounding.
    """
    share_prompt_min_gflop: float = bounded(0.2, ge=0)
    """Share the groups' prompts only where a micro-batch's forward saves at least this many GFLOP; 0: always.

    The saving is 2 x parameters per prompt token not run, at the data's mean prompt length. Sharing runs two forwards (the prompts, then the responses) where the plain path runs one, and a
    forward has a fixed cost of op dispatch. Measured on a 2-layer, 64-wide Llama (a GRPO batch of 4
    prompts x 8 samples, 31-column prompts, ~5-token responses, 2 CPU threads; medians of 15 alternations):
    forward and backward take 9.2 ms shared, 8.6 ms plain (it would save 0.15 GFLOP). On SmolLM2-135M the
    same batch shape saves ~230 GFLOP a forward, and sharing pays.
    """
    pack_sequences: bool = True
    """With --max-tokens-per-micro-batch, run each micro-batch's real tokens packed end to end (no padding computed)
    where the model allows.

    The actor's, the critic's, the reference model's and the reward model's forwards pack. Packed rows
    restart their positions under a block-diagonal mask. A micro-batch is packed when the model packs
    (Llama, Qwen2, Mistral; float32 on the CPU with --fused-layers), it holds at most 4096 real tokens,
    and that is fewer tokens than its padded forward (shared prompts counted once). Log-probs and gradients
    are the same up to rounding.
    """
    actor_zero_stage: ZeroStage | None = None
    """ZeRO stage of the actor; defaults to --zero-stage."""
    critic_zero_stage: ZeroStage | None = None
    """ZeRO stage of the critic; defaults to --zero-stage."""
    critic_lr: float | None = bounded(None, gt=0)
    """Critic learning rate (separate optimizer); defaults to --lr."""
    inference_tp_size: int = bounded(1, ge=1)
    """Tensor-parallel degree of the actor in rollout mode; must divide the world size."""
    rollout_parity_tolerance: float | None = bounded(None, ge=0)
    """Max |log-prob| difference between train and rollout mode before the run fails; unset: by dtype (1e-3 fp32, 0.15
    bf16/fp16).

    The default is 1e-3 in fp32, 0.05 in fp32 with a float16 KV cache (--kv-cache-dtype auto or fp16 on
    the CPU), and 0.15 in bf16/fp16.
    """
    rollout_parity_every: int = bounded(10, ge=1)
    """Run the rollout parity check (a train-mode forward of two rows) on the first rollout, then every this many
    iterations; 1: every iteration.

    A resumed run checks its first rollout too. Between checks, the old_logprob_diff_* metrics compare
    generation's log-probs with the training forward's on every token.
    """
    max_tokens_per_micro_batch: int = bounded(0, ge=0)
    """Cut training micro-batches by a token budget instead of --micro-batch-size rows: at most this many tokens each.
    0: off.

    Rows of similar length go together; a micro-batch's size is rows x width, without padding. Each
    micro-batch's loss is weighted by its share of the minibatch's tokens (rows for sequence-level losses),
    so the step equals one over the whole minibatch. 0: --micro-batch-size rows.
    """
    recompute_old_logprobs: bool | None = None
    """Old log-probs from an actor forward over the rollouts, not generation's (one forward more); unset: on in bf16/fp16
    and with --rollout-is truncate/mask.

    Unset, fp32 takes generation's log-probs while they stay within --old-logprob-tolerance of the training
    forward's, and recomputes them from the iteration after they do not. An on-policy update (one epoch
    over one minibatch, no KL in the reward) runs no separate forward either way: its old log-probs are the
    trained forward's own, detached.
    """
    old_logprob_tolerance: float | None = bounded(None, ge=0)
    """Max |difference| between generation's log-probs and the training forward's before PPO recomputes them for the
    rest of the run; unset: by dtype.

    The difference is measured every iteration and logged as old_logprob_diff_max/mean. The default is
    1e-3 in fp32, 0.05 in fp32 with a float16 KV cache (--kv-cache-dtype auto or fp16 on the CPU), and
    0.15 in bf16/fp16.
    """
    rollout_is: RolloutIS = "auto"
    """Correct the rollout/training log-prob mismatch per token: truncate (TIS), mask (MIS) or off; auto: truncate in
    bf16/fp16, off in fp32.

    w = exp(old log-prob - generation's log-prob) per response token, the old log-probs the training
    forward's. truncate: each token's policy loss x min(w, cap) (Yao et al. 2025; TRL's
    vllm_importance_sampling_correction). mask: tokens with w outside [1/cap, cap] leave the policy loss
    and its normaliser, the rest are weighted by w (verl's rollout_is mask mode). truncate and mask make the
    old log-probs the training forward's (--recompute-old-logprobs). Logged as rollout_is_ratio_mean/max
    and rollout_is_truncated_fraction or rollout_is_masked_fraction.
    """
    rollout_is_cap: float = bounded(2.0, gt=1)
    """The cap of --rollout-is: truncate caps w at it, mask drops the tokens whose w is outside [1/cap, cap].

    2 is verl's rollout_is_threshold default (its mask mode's lower bound 1/threshold) and TRL's
    vllm_importance_sampling_cap for its token-level TIS (TRL's later sequence-level modes default to 3).
    """
    max_prompt_len: int = bounded(256, ge=1)
    """Prompts longer than this many tokens are dropped and counted."""
    max_new_tokens: int = bounded(128, ge=1)
    """Response tokens generated per prompt."""
    generation_batch_size: int = bounded(8, ge=1)
    """Rollout samples per rank per PPO iteration (the experience batch; a TP group generates tp times this)."""
    ppo_epochs: int = bounded(1, ge=1)
    """Passes over each iteration's experience (TRL: 4; DeepSpeed-Chat: 1)."""
    min_new_tokens: int = bounded(0, ge=0)
    """Suppress EOS until this many response tokens (e.g. to forbid empty responses, or for benchmarks)."""
    temperature: float = bounded(1.0, ge=0)
    """Sampling temperature of rollouts."""
    top_k: int = bounded(0, ge=0)
    """Top-k sampling of rollouts (0: off)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Top-p (nucleus) sampling of rollouts (1: off)."""
    greedy: bool = False
    """Greedy rollouts (for debugging and tests; PPO needs sampling to explore)."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """Rollout KV cache dtype: auto (float16 for a float32 model on the CPU's fast decoder, else the model's dtype),
    model (always the model's) or fp16.

    auto keeps the cache in float16 for a float32 Llama, Qwen2 or Mistral model on the CPU's fast decoder,
    as llama.cpp keeps its cache; a 16-bit model or a GPU keeps the model's dtype. model makes rollouts
    exactly the model's own forward. fp16 is auto, with a note where it does not apply. The float16 cache
    halves the cache memory and the bytes a decode step reads. Generation's log-probs then differ from the
    float32 training forward's (by ~4e-4 on a 4-layer tiny Llama, up to ~1e-2 on SmolLM2-135M); the
    difference is measured every iteration as old_logprob_diff_max, and the default tolerances are 0.05
    there.
    """
    offload_ref: bool = False
    """Keep the frozen reference model's shards on CPU."""
    offload_reward: bool = False
    """Keep the frozen reward model's shards on CPU."""
    kl_coef: float = bounded(0.05, ge=0)
    """Initial KL penalty coefficient beta (TRL 0.05; InstructGPT 0.02; DeepSpeed-Chat 0.1)."""
    kl_estimator: KLEstimator | None = None
    """Per-token KL estimate: k1 = log p - log q, k2 = (log p - log q)^2 / 2, k3 = unbiased and >= 0; unset: k1 in the
    reward, k3 in the loss.

    k1: as InstructGPT. k3: Schulman's unbiased, always non-negative estimator, as GRPO.
    """
    adaptive_kl: bool = False
    """Adapt kl_coef towards kl_target (Ziegler et al. 2019)."""
    log_kl: bool = False
    """Measure and log the KL to the reference (kl) at --kl-coef 0 too; this builds and runs the reference model.

    Without a KL term (--kl-coef 0, no --adaptive-kl, as TRL's GRPO beta 0) the reference model is neither loaded
    nor run, and no kl is logged; --log-kl brings it back for the curve alone (the update is the same).
    """
    kl_target: float = bounded(6.0, gt=0)
    """Adaptive KL target, summed over a response (TRL default)."""
    kl_horizon: int = bounded(10000, ge=1)
    """Adaptive KL horizon in samples (TRL default)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """GAE discount (DeepSpeed-Chat, TRL)."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE lambda (DeepSpeed-Chat, TRL)."""
    clip_range: float = bounded(0.2, gt=0)
    """PPO policy ratio clip (Schulman et al.; as InstructGPT, DeepSpeed-Chat and TRL)."""
    clip_range_value: float = bounded(0.2, gt=0)
    """Value clip around the rollout values (DeepSpeed-Chat, TRL)."""
    reward_clip: float = bounded(5.0, gt=0)
    """Clip the (normalised) score to [-c, c] (DeepSpeed-Chat clip_reward_value)."""
    normalize_reward: bool = True
    """Normalise scores with the reward stage's score_mean/score_std (from its summary.json)."""
    missing_eos_penalty: float = bounded(0.0, ge=0)
    """Subtracted from the score of responses that end without EOS (TRL's missing_eos_penalty; 0: off)."""
    whiten_advantages: bool = True
    """Whiten advantages over the global experience batch (InstructGPT, DeepSpeed-Chat, TRL)."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Entropy bonus coefficient in the policy loss (0: off, as in InstructGPT)."""
    ptx_data: list[str] = field(default_factory=list)
    """Pretraining/SFT data mixed into the actor loss (InstructGPT's PPO-ptx); needs ptx_coef > 0."""
    ptx_coef: float = bounded(0.0, ge=0)
    """Weight of the PTX language-modelling loss (InstructGPT used 27.8 on their scale; DeepSpeed-Chat 1.0)."""
    ema_decay: float = bounded(0.0, ge=0, lt=1)
    """Keep an exponential moving average of the actor (DeepSpeed-Chat 0.992), saved to model_ema/; 0: off."""
    sample_log_interval: int = bounded(10, ge=0)
    """Log a table of sample prompts/responses/scores every this many iterations."""
    eval_reward_fn: list[str] = field(default_factory=list)
    """Reward functions scoring greedy answers to the held-out prompts; default: the --reward-fn list.

    They run before the first iteration, every --eval-interval iterations and after the last.

    The held-out prompts are --eval-data, --data-test-split or an --eval-split holdout of --data. Each function's
    mean is logged as eval/<name> (a task checker's: its success rate), their sum as eval_reward, in metrics.jsonl,
    W&B, summary.json and curves.png. Specs as for --reward-fn. Without held-out prompts nothing is evaluated.
    """
    eval_max_new_tokens: int | None = bounded(None, ge=1)
    """Response tokens per held-out prompt; default --max-new-tokens."""

    def validate(self, where: str = "config") -> None:
        super().validate(where)
        if not self.greedy and self.temperature == 0:
            raise UserError(f"{where}: temperature: 0 must be > 0 when sampling; use greedy: true for argmax rollouts")
        if self.min_new_tokens > self.max_new_tokens:
            raise UserError(f"{where}: min_new_tokens: {self.min_new_tokens} must be <= max_new_tokens "
                            f"({self.max_new_tokens})")
        if self.ptx_data and self.ptx_coef <= 0:
            raise UserError(f"{where}: ptx_coef: {self.ptx_coef} must be > 0 with ptx_data (the PTX loss weight)")
        if self.ptx_coef > 0 and not self.ptx_data:
            raise UserError(f"{where}: ptx_coef: {self.ptx_coef} needs ptx_data (the data of the PTX loss); pass "
                            "--ptx-data or leave ptx_coef at 0")
        if self.estimator.needs_groups and self.samples_per_prompt < 2:
            raise UserError(f"{where}: samples_per_prompt: {self.samples_per_prompt} must be >= 2 with "
                            f"advantage_estimator {self.advantage_estimator} (it compares a prompt's samples)")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise UserError(f"{where}: dynamic_sampling: true needs samples_per_prompt >= 2 (it drops groups whose "
                            "rewards all tie)")
        if self.overlong_buffer >= self.max_new_tokens:
            raise UserError(f"{where}: overlong_buffer: {self.overlong_buffer} must be < max_new_tokens "
                            f"({self.max_new_tokens})")
        if self.reward_weights and any(w < 0 for w in self.reward_weights):
            raise UserError(f"{where}: reward_weights: {self.reward_weights} must be >= 0")
        if self.rollout_is in ("truncate", "mask") and self.recompute_old_logprobs is False:
            raise UserError(f"{where}: rollout_is: {self.rollout_is} weighs generation's log-probs against the "
                            "training forward's, so it recomputes the old log-probs: drop recompute_old_logprobs: "
                            "false (--no-recompute-old-logprobs), or set rollout_is: off")
        if self.engine.offload and 0 in (self.actor_zero_stage, self.critic_zero_stage):
            raise UserError(f"{where}: offload: true must be used with actor_zero_stage and critic_zero_stage "
                            "1, 2 or 3 (zero_stage 0 shards nothing to offload)")

    @property
    def estimator(self) -> Estimator:
        """--advantage-estimator's entry in the registry (rlhf/algorithms/estimators.py)."""
        return ESTIMATORS[self.advantage_estimator]

    @property
    def critic_free(self) -> bool:
        """Every estimator but GAE: no critic is loaded, trained or saved."""
        return not self.estimator.needs_critic

    @property
    def kl_in_loss(self) -> bool:
        """The KL to the reference is a loss term (GRPO) rather than a per-token reward penalty."""
        placement = self.estimator.kl_placement if self.kl_placement == "auto" else self.kl_placement
        return placement == "loss"

    @property
    def needs_reference(self) -> bool:
        """A KL term uses the reference model (--kl-coef > 0 or --adaptive-kl), or --log-kl asks for its KL."""
        return self.kl_coef > 0 or self.adaptive_kl or self.log_kl

    @property
    def kl_kind(self) -> KLEstimator:
        """--kl-estimator, or its default for the placement: k3 in the loss, k1 in the reward."""
        return self.kl_estimator or ("k3" if self.kl_in_loss else "k1")

    @property
    def loss_aggregation_mode(self) -> str:
        """--loss-aggregation with `auto` resolved for the estimator and the importance ratio."""
        if self.loss_aggregation != "auto":
            return self.loss_aggregation
        default = self.estimator.loss_aggregation
        if default == "token-mean" and self.importance_ratio == "sequence":
            return "seq-mean-token-mean"
        return default

    def recomputes_old_logprobs(self, dtype: str) -> bool:
        """--recompute-old-logprobs with unset resolved for the engine's resolved dtype (fp32, bf16, fp16):
        on in 16-bit (generation's log-probs are a 16-bit forward's of their own) and with --rollout-is
        truncate or mask (whose weight compares the two)."""
        if self.recompute_old_logprobs is not None:
            return self.recompute_old_logprobs
        return dtype != "fp32" or self.rollout_is in ("truncate", "mask")

    def rollout_is_mode(self, dtype: str) -> str:
        """--rollout-is with auto resolved for the engine's resolved dtype: truncate in 16-bit where the old
        log-probs are the training forward's, else off (in fp32 w is 1 up to rounding)."""
        if self.rollout_is != "auto":
            return self.rollout_is
        return "truncate" if dtype != "fp32" and self.recompute_old_logprobs is not False else "off"

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        low = self.clip_range_low if self.clip_range_low is not None else self.clip_range
        high = self.clip_range_high if self.clip_range_high is not None else self.clip_range
        return low, high


E2EPreset = Literal["smollm2"]
E2EAlgorithm = Literal["ppo", "dpo"]


@dataclass
class E2EConfig:
    """`rlhf e2e`: SFT -> reward -> PPO (or SFT -> DPO) chained. Stage settings go in the config file's
    `sft:`, `reward:`, `ppo:`, `dpo:` sections or in prefixed flags (`--sft.lr 1e-3`, `--ppo.kl-coef 0.1`)."""

    preset: E2EPreset | None = None
    """A named recipe replacing the built-in defaults (flags and --config still override it): smollm2 =
    SmolLM2-135M-Instruct on the larger_number task.

    smollm2 trains the model `rlhf models get smollm2-135m-instruct` writes, sized for minutes on two CPU
    cores (docs/stages.md).
    """
    output: str = "runs/e2e"
    """Run folder: sft/, reward/, ppo/, data/, base/ and summary.json. Re-running skips finished stages and resumes an
    interrupted one."""
    model: str | None = None
    """Base model (local folder or hub name); by default a tiny model is built from a config."""
    tiny_family: str = "llama"
    """Family of the built-in tiny base model (llama, qwen2, mistral, opt, gpt2)."""
    tiny_hidden_size: int = bounded(64, ge=8)
    """Hidden size of the built-in tiny base model."""
    tiny_layers: int = bounded(2, ge=1)
    """Decoder layers of the built-in tiny base model."""
    task: str = "sort"
    """Built-in task whose generated data the stages train on and whose checker measures success."""
    data: list[str] = field(default_factory=list)
    """Your own dataset instead of the task's: shared by the stages through data_split; no task success is
    measured."""
    data_split: str = checked("2,4,4", SplitShares())
    """Shares of --data for sft,reward,ppo."""
    data_config: str | None = None
    """The config (subset) of each --data dataset, for every stage (see `rlhf sft --help`)."""
    data_train_split: str = "train"
    """The split of each --data dataset that the stages share out through data_split."""
    data_test_split: str | None = None
    """A split of each --data dataset that sft and reward evaluate on (whole; replaces the reward stage's 5%
    holdout)."""
    data_columns: list[str] = field(default_factory=list, metadata={"rule": ColumnRenames()})
    """Column renames NEW=OLD of --data, comma-separated, for every stage (prompt=question,answer=solution)."""
    data_mix: list[float] = field(default_factory=list, metadata={"rule": PositiveWeights()})
    """With several --data: the share of each, comma-separated (e.g. 0.7,0.3), mixed before data_split shares the rows
    out (the same mix in every stage)."""
    reward_fn: list[str] = field(default_factory=list)
    """RL rewards from these functions (a task name such as sort, file.py:function, module:function) instead of the
    reward model (the reward stage is then skipped)."""
    algorithm: E2EAlgorithm = "ppo"
    """The stage after SFT: ppo (a reward model and PPO, or a critic-free estimator) or dpo (`rlhf dpo` on the
    preference pairs).

    dpo runs SFT -> DPO: no reward stage and no rollouts; on the built-in task the DPO stage trains on its
    preference pairs (the reward stage's) and the summary reports dpo_task_success.
    """
    advantage_estimator: AdvantageEstimator = "gae"
    """The RL stage's estimator (as `rlhf ppo`'s); a critic-free one on the built-in task without --reward-fn rewards
    with the task's checker.

    The reward stage is then skipped.
    """
    n_sft: int = bounded(16000, ge=1)
    """Task SFT demonstrations (a wrong_fraction share of them wrong)."""
    wrong_fraction: float = bounded(0.35, ge=0, le=1)
    """Share of wrong answers among the task's SFT demonstrations."""
    n_pairs: int = bounded(32000, ge=1)
    """Task preference pairs for the reward model."""
    n_prompts: int = bounded(8192, ge=1)
    """Task prompts for PPO."""
    n_eval_pairs: int = bounded(512, ge=1)
    """Held-out task pairs for reward-model accuracy."""
    n_eval_prompts: int = bounded(512, ge=1)
    """Held-out task prompts for the success rate of sampled responses."""
    eval_temperature: float = bounded(1.0, ge=0)
    """Sampling temperature when measuring task success."""
    eval_max_new_tokens: int = bounded(10, ge=1)
    """Response budget when measuring task success."""
    seed: int = bounded(0, ge=0)
    """Seed of the data, the models and every stage."""
    report_to: str = "wandb"
    """Trackers of every stage (one W&B group per e2e run; offline without credentials)."""
    wandb_project: str = "rlhf"
    """W&B project of every stage."""

    def validate(self, where: str = "config") -> None:
        selection = {"data_config": self.data_config, "data_test_split": self.data_test_split,
                     "data_columns": self.data_columns, "data_mix": self.data_mix,
                     "data_train_split": None if self.data_train_split == "train" else self.data_train_split}
        given = [name for name, value in selection.items() if value]
        if self.algorithm == "dpo" and (self.reward_fn or self.advantage_estimator != "gae"):
            raise UserError(f"{where}: algorithm dpo trains on preference pairs, with no rewards or advantages: "
                            "drop reward_fn / advantage_estimator, or use algorithm ppo")
        if given and not self.data:
            raise UserError(f"{where}: {', '.join(given)} select within --data; the built-in task's files have "
                            "no splits, configs or other columns: pass --data too, or drop them")


SECTIONS: tuple[str, ...] = ("engine", "data", "tracking", "lora", "cpu", "cuda")
TUNING_SECTIONS: tuple[str, ...] = ("cpu", "cuda")
"""The device backends' sections (engine/backends/): how a device runs the models, not what they compute."""


def field_named(by_name: Mapping[str, FieldInfo], key: str) -> FieldInfo | None:
    """The field a file key or flag names (`-` or `_`, an earlier name too: the backends' RENAMED_FIELDS), or None."""
    name = key.replace("-", "_")
    return by_name.get(RENAMED_FIELDS.get(name, name))


def apply_mapping(config: Any, mapping: Mapping[str, Any], source: str) -> None:
    """Apply a flat or sectioned mapping (from a config file) onto a stage config."""
    by_name = fields_by_name(type(config))
    for key, value in mapping.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                info = field_named(by_name, sub_key)
                renamed = sub_key.replace("-", "_") in RENAMED_FIELDS
                if info is None or (info.section != key and not renamed):
                    raise UserError(f"{source}: unknown key '{key}.{sub_key}'; see `rlhf <stage> --help` for the fields")
                set_field(config, info, sub_value, f"{source}: {key}.{sub_key}")
            continue
        info = field_named(by_name, key)
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
