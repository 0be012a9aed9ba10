"""Where PPO's scores come from: a weighted sum of reward sources, each one number per rollout.

Every source has a `name` (its metrics are `reward/<name>`) and one method,
`score(sequences, attention_mask, batch) -> [B]` (`batch`: a `RewardBatch`, each row's chat
messages, decoded response, data columns, response ids and more, `rlhf.reward_batch`): model
sources read the token ids, function sources the batch. Two kinds exist: a frozen reward model
(`--reward`, named "reward_model") and reward functions (`--reward-fn`: a built-in task's checker
or a user's Python function, `rlhf.reward_functions`). A source also says how its raw scores are
normalised before they are weighted (`normalization`: (mean, std), or None for raw).

`WeightedReward` is what PPO scores with: sum_i w_i * normalised_i(raw_i) over the --reward model
(first, when given) and each --reward-fn in order, the weights from --reward-weights (default all
1). It keeps the last batch's raw score of every source in `components` for the logs. A weight of
0 logs a source without training on it. A reward function may leave a sample unscored (None,
NaN in `components`): the sum then runs over the sources that scored it (TRL's nansum), and a
sample that no source scores is a UserError naming the row. The async functions of a batch are
awaited together (`run_concurrently`). `reward_metrics` turns the components and the functions'
`log_metric` values into the iteration's metrics, each source's mean over the samples it scored.

A reward model whose tokenizer differs from the actor's cannot read the actor's ids: its source
re-renders each (prompt messages, response) pair with the reward model's own tokenizer and chat
template (`rlhf.data.retokenize`), the same rendering its training pairs had, and scores those.

A reward model whose training scores barely vary (score_std below `DEGENERATE_SCORE_STD`) gets
a warning at load: normalising by such a std turns rounding noise into many sigmas, so nearly
every reward is clipped to +-reward_clip and PPO learns nothing (the `reward_clipped_fraction`
metric shows it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf.config import PPOConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel
from rlhf.data.formats import parse_tools
from rlhf.data.retokenize import retokenize_for_reward, same_vocabulary
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.loading import load_tokenizer
from rlhf.models.value_model import deferred_load_value_model
from rlhf.reward_batch import RewardBatch, RewardTrainerState, run_concurrently
from rlhf.reward_functions import RewardFunction, Score, load_reward_functions, prompt_text
from rlhf.stages.rollouts import Rollouts
from rlhf.tools import call_reward
from rlhf.engine.prompt_sharing import response_prefix

log = get_logger(__name__)

# 1e-2: a Bradley-Terry model whose scores spread less than this gives every pair a preference of
# sigmoid(delta) = 0.5 +- 0.005, i.e. it has learned no ordering (a reward model trained from a
# zero-initialised value head spread 0.001), and the spread is of the order of the score's own
# rounding in bfloat16 (steps of 2^-8 ~ 0.004 near 1), a dtype the frozen reward model may run in:
# dividing by it amplifies noise.
DEGENERATE_SCORE_STD = 1e-2


# The reward model's source name (a reward function called so is renamed reward_model_2).
REWARD_MODEL = "reward_model"

class RewardSource(Protocol):
    """Scores this rank's rollouts: [B] float32 on the rollouts' device, one per sequence.
    NaN where the source leaves a sample unscored. `shared_prefix`: rows that share their first
    that many columns (a sampled group's prompt)."""

    name: str
    normalization: tuple[float, float] | None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, batch: RewardBatch,
              shared_prefix: int = 0) -> torch.Tensor: ...


@dataclass
class RewardModelSource:
    """A frozen reward model: the value at each sequence's last real token.

    With `tokenizer` set (the reward model's own, when it differs from the actor's), the rollout
    ids are not scored: each prompt's messages and decoded response are rendered again in the
    reward model's tokenizer and template, cut to `max_len` tokens from the left (`truncated`
    counts those cuts, for the metrics). `pack_budget` > 0: the scores' forwards run packed
    (`FrozenModel.scores`)."""

    model: FrozenModel
    normalization: tuple[float, float] | None = None
    tokenizer: Any = None
    max_len: int = 0
    truncated: int = 0
    name: str = REWARD_MODEL
    pack_budget: int = 0

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, batch: RewardBatch,
              shared_prefix: int = 0) -> torch.Tensor:
        if self.tokenizer is None:  # packed, a group's prompt runs once
            return self.model.scores(sequences, attention_mask, self.pack_budget, shared_prefix)
        tools = [parse_tools(row.get("tools"), "a rollout's data row") for row in batch.fields or []]
        ids, mask, truncated = retokenize_for_reward(batch.prompts, batch.responses, self.tokenizer, self.max_len,
                                                     tools or None)
        self.truncated += truncated
        return self.model.scores(ids.to(sequences.device), mask.to(sequences.device), self.pack_budget)


@dataclass
class FunctionRewardSource:
    """A reward function (a built-in task's checker or a user's) over the batch, in its convention
    (`rlhf.reward_functions`). Raw scores, never normalised; NaN where it returned None."""

    function: RewardFunction
    normalization: tuple[float, float] | None = None

    @property
    def name(self) -> str:
        return self.function.name

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, batch: RewardBatch,
              shared_prefix: int = 0) -> torch.Tensor:
        return scores_tensor(self.function(batch), sequences.device)


@dataclass
class EnvironmentRewardSource:
    """An --environment's get_reward(), called once per finished rollout on its own instance (TRL's);
    raw scores, NaN where it returned None."""

    name: str
    normalization: tuple[float, float] | None = None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, batch: RewardBatch,
              shared_prefix: int = 0) -> torch.Tensor:
        if batch.environments is None:
            raise ValueError("an environment reward needs the rollouts' environments")
        return scores_tensor([call_reward(e) for e in batch.environments], sequences.device)


def scores_tensor(values: list[Score], device: torch.device | str) -> torch.Tensor:
    """A function's scores as float32 [B], NaN where it returned None."""
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32, device=device)


def normalized(raw: torch.Tensor, normalization: tuple[float, float] | None) -> torch.Tensor:
    """(raw - mean) / std with a source's (mean, std); raw scores when None."""
    return raw if normalization is None else (raw - normalization[0]) / max(normalization[1], 1e-6)


@dataclass
class WeightedReward:
    """The reward PPO scores with: sum_i weights[i] * normalized(sources[i]'s raw scores) over the
    sources that scored each sample, float32 [B].

    `components` holds the last call's raw scores per source name (this rank's; [B] each, NaN
    where unscored) for the `reward/<name>` metrics. Its scores are already normalised:
    `normalization` is None (the reward model's own is `model_normalization`). `retokenizes` and
    `take_truncated()` report a re-tokenising reward model's cuts; `take_logged_metrics()` the
    functions' `log_metric` values since the last call."""

    sources: list[RewardSource]
    weights: list[float]
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    normalization: tuple[float, float] | None = None
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, batch: RewardBatch,
              shared_prefix: int = 0) -> torch.Tensor:
        device = sequences.device
        raws: dict[int, torch.Tensor] = {}
        awaited = [i for i, s in enumerate(self.sources) if isinstance(s, FunctionRewardSource) and s.function.is_async]
        for i, source in enumerate(self.sources):
            if i not in awaited:
                raws[i] = source.score(sequences, attention_mask, batch, shared_prefix)
        if awaited:  # every async function of the batch at once, as TRL
            functions: list[RewardFunction] = [self.sources[i].function for i in awaited]  # type: ignore[attr-defined]
            results = run_concurrently([f.acall(batch) for f in functions], max(f.timeout or 0 for f in functions),
                                       "--reward-fn " + ", ".join(f.spec for f in functions))
            raws.update({i: scores_tensor(values, device) for i, values in zip(awaited, results)})
        total = torch.zeros(len(batch), dtype=torch.float32, device=device)
        scored = torch.zeros(len(batch), dtype=torch.bool, device=device)
        components = {}
        for i, (source, weight) in enumerate(zip(self.sources, self.weights, strict=True)):
            raw = raws[i].float().to(device)
            components[source.name] = raw
            here = ~raw.isnan()
            total += torch.where(here, weight * normalized(raw, source.normalization), 0.0)
            scored |= here
        if not bool(scored.all()):
            row = int((~scored).nonzero()[0])
            raise UserError(f"reward: row {row} of the batch (prompt {prompt_text(batch.prompts[row])[:60]!r}) has no "
                            f"score: every reward source ({', '.join(self.names)}) returned None for it; return a "
                            "number for every sample from at least one --reward-fn")
        self.components = components
        for name, values in batch.log.metrics.items():
            self.logged_metrics.setdefault(name, []).extend(values)
        return total

    def take_logged_metrics(self) -> dict[str, list[float]]:
        """The reward functions' `log_metric` values since the last call, by name; they restart."""
        logged, self.logged_metrics = self.logged_metrics, {}
        return logged

    @property
    def logs_metrics(self) -> bool:
        """Some reward function may call `log_metric` (it accepts the argument): the same on every rank."""
        return any(isinstance(s, FunctionRewardSource) and s.function.batched
                   and (s.function.keywords is None or "log_metric" in s.function.keywords) for s in self.sources)

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    @property
    def model_source(self) -> RewardModelSource | None:
        """The --reward model's source, or None when only functions give the reward."""
        return next((s for s in self.sources if isinstance(s, RewardModelSource)), None)

    @property
    def model_normalization(self) -> tuple[float, float] | None:
        """The reward model's (mean, std) from its summary.json, or None (raw, or no reward model)."""
        model = self.model_source
        return None if model is None else model.normalization

    @property
    def retokenizes(self) -> bool:
        """Whether the reward model re-renders rollouts in its own tokenizer (it counts cuts then)."""
        model = self.model_source
        return model is not None and model.tokenizer is not None

    def take_truncated(self) -> int:
        """Sequences the re-tokenising reward model cut to fit since the last call (0 without one);
        the count restarts."""
        model = self.model_source
        if model is None:
            return 0
        truncated, model.truncated = model.truncated, 0
        return truncated


def rollout_batch(rollouts: Rollouts, state: RewardTrainerState | None = None) -> RewardBatch:
    """The reward functions' view of this rank's rollouts: messages, responses, data columns,
    conversational flags and each response's token ids (up to and including EOS, as TRL's)."""
    sequences, action = rollouts.sequences.cpu(), rollouts.action_mask.cpu()
    if rollouts.trajectories is not None:  # a tool rollout's: its tool responses' tokens too, as TRL's
        start, attention = response_prefix(action), rollouts.attention_mask.cpu().bool()
        action = attention & (torch.arange(action.shape[1]) >= start)
    ids = [s[a].tolist() for s, a in zip(sequences, action)]
    return RewardBatch(rollouts.prompts, rollouts.responses, rollouts.fields, rollouts.conversational, ids, state,
                       rollouts.trajectories, rollouts.environments)


def reward_metrics(components: dict[str, torch.Tensor], logged: dict[str, list[float]], ctx: DistributedContext,
                   logs_metrics: bool, truncated: float | None = None) -> dict[str, float]:
    """The reward metrics of an iteration over all ranks (one all-reduce):

    reward/<source>               its mean raw score over the samples it scored (TRL's nanmean;
                                  NaN when it scored none)
    reward_scored_fraction/<source>  the share of samples it scored (1 but for functions returning None)
    reward_fn/<name>              the mean of the values the functions passed log_metric(name, value)
    reward_retokenize_truncated   a re-tokenising reward model's cuts (when `truncated` is given)

    `logs_metrics`: some function may log metrics, on every rank alike: the names are gathered
    from every rank first (a rank whose rows logged none still joins the sum)."""
    sources = sorted(components)
    names = sorted(logged)
    if logs_metrics and ctx.world_size > 1:
        names = sorted({n for rank in ctx.all_gather_object(names) for n in rank})  # type: ignore[union-attr]
    parts: list[float] = []
    for k in sources:
        raw = components[k].double().cpu()  # scores may live on the GPU
        here = ~raw.isnan()
        parts += [float(raw[here].sum()), float(here.sum()), float(raw.numel())]
    for k in names:
        parts += [sum(logged.get(k, [])), float(len(logged.get(k, [])))]
    parts.append(float(truncated or 0))
    sums = ctx.all_reduce_sum(torch.tensor(parts, dtype=torch.float64)).tolist()
    metrics = {}
    for i, k in enumerate(sources):
        total, scored, rows = sums[3 * i : 3 * i + 3]
        metrics[f"reward/{k}"] = total / scored if scored else math.nan
        metrics[f"reward_scored_fraction/{k}"] = scored / max(rows, 1.0)
    offset = 3 * len(sources)
    for i, k in enumerate(names):
        total, count = sums[offset + 2 * i : offset + 2 * i + 2]
        metrics[f"reward_fn/{k}"] = total / count if count else math.nan
    if truncated is not None:
        metrics["reward_retokenize_truncated"] = sums[-1]
    return metrics


def reward_statistics(reward_path: str, normalize: bool) -> tuple[float, float] | None:
    """(mean, std) of reward-model scores from the reward stage's summary.json, or None (raw)."""
    summary = Path(reward_path).parent / "summary.json"
    data = json.loads(summary.read_text()) if summary.is_file() else {}
    if "score_std" in data:
        warn_if_degenerate(reward_path, float(data["score_std"]), f"its reward stage's {summary}")
    if not normalize:
        return None
    if "score_mean" in data and "score_std" in data:
        return float(data["score_mean"]), float(data["score_std"])
    log.warning("no score_mean/score_std in %s: rewards are not normalised", summary)
    return None


def warn_if_degenerate(reward_path: str, score_std: float, where: str) -> bool:
    """Warn (and return True) when the reward model's score spread is below DEGENERATE_SCORE_STD."""
    if score_std >= DEGENERATE_SCORE_STD:
        return False
    log.warning(
        "--reward %s: score_std %.3g (from %s) is below %g: the reward model barely tells responses apart, "
        "normalised rewards are mostly noise and clipped to +-reward_clip (see reward_clipped_fraction); "
        "retrain it (more steps or data, a higher --lr, --value-head-init-std > 0) or pass --no-normalize-reward",
        reward_path, score_std, where, DEGENERATE_SCORE_STD,
    )
    return True


def check_reward_sources(config: PPOConfig, environment_reward: str | None = None) -> list[RewardFunction]:
    """Load every --reward-fn (files, modules and functions checked) and check --reward-weights'
    count, before any model is loaded; the functions go to `build_reward_source`.
    `environment_reward`: the name of an --environment's get_reward source (the last one)."""
    functions = load_reward_functions(config.reward_fn, reserved=[REWARD_MODEL, *filter(None, [environment_reward])])
    for function in functions:
        function.timeout = config.reward_timeout or None
    names = ([REWARD_MODEL] if config.reward else []) + [f.name for f in functions]
    names += [environment_reward] if environment_reward else []
    if not names:
        raise UserError("no reward source: pass --reward (a reward model folder) and/or --reward-fn "
                        "(a built-in task, path/to/file.py:function or package.module:function), or an "
                        "--environment with get_reward()")
    if config.reward_weights and len(config.reward_weights) != len(names):
        raise UserError(f"--reward-weights {','.join(f'{w:g}' for w in config.reward_weights)}: "
                        f"{len(config.reward_weights)} weights for {len(names)} reward sources ({', '.join(names)}); "
                        "give one weight per source, the --reward model first, then each --reward-fn in order, "
                        "then the --environment's get_reward")
    return functions


def build_reward_source(config: PPOConfig, ctx: DistributedContext, tokenizer: Any, dtype: str,
                        functions: list[RewardFunction] | None = None,
                        environment_reward: str | None = None) -> WeightedReward:
    """The weighted reward over the --reward model (when given), each --reward-fn in order and the
    --environment's get_reward (`environment_reward`: its source name). `functions`: from
    `check_reward_sources` (loaded again here when None)."""
    if functions is None:
        functions = check_reward_sources(config, environment_reward)
    sources: list[RewardSource] = [FunctionRewardSource(f) for f in functions]
    if environment_reward:
        sources.append(EnvironmentRewardSource(environment_reward))
    if config.reward:
        sources.insert(0, build_reward_model_source(config, ctx, tokenizer, dtype))
    weights = list(config.reward_weights) or [1.0] * len(sources)
    log.info("reward = %s", " + ".join(f"{w:g} * {s.name}" for w, s in zip(weights, sources)))
    return WeightedReward(sources, weights)


def build_reward_model_source(config: PPOConfig, ctx: DistributedContext, tokenizer: Any,
                              dtype: str) -> RewardModelSource:
    """The frozen --reward model, re-tokenising rollouts when its tokenizer differs from the actor's."""
    reward_tok = load_tokenizer(config.reward, "--reward")
    retokenize = not same_vocabulary(reward_tok, tokenizer)
    if retokenize:
        log.info("--reward %s: its tokenizer differs from the actor's; responses are decoded and re-tokenised "
                 "with the reward model's tokenizer and chat template", config.reward)
    reward_model, weights = deferred_load_value_model(config.reward)  # on meta: each rank reads only its shards
    model = FrozenModel(reward_model, ctx, config.engine.zero_stage, dtype, config.offload_reward,
                        config.engine.micro_batch_size, "reward", compile=config.engine.compile, weights=weights)
    return RewardModelSource(model, reward_statistics(config.reward, config.normalize_reward),
                             reward_tok if retokenize else None, config.max_prompt_len + config.max_new_tokens,
                             pack_budget=config.max_tokens_per_micro_batch if config.pack_sequences else 0)


__all__ = [
    "DEGENERATE_SCORE_STD", "REWARD_MODEL", "EnvironmentRewardSource", "FunctionRewardSource", "RewardModelSource", "RewardSource",
    "WeightedReward", "build_reward_model_source", "build_reward_source", "check_reward_sources", "normalized",
    "reward_metrics", "reward_statistics", "rollout_batch", "scores_tensor", "warn_if_degenerate",
]
