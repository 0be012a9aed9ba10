"""Where PPO's scores come from: a weighted sum of reward sources, each one number per rollout.

Every source has a `name` (its metrics are `reward/<name>`) and one method,
`score(sequences, attention_mask, prompts, responses, fields) -> [B]` (`prompts`: each row's chat
messages, `responses`: the decoded responses, `fields`: each prompt row's other data columns):
model sources read the token ids, function sources the texts. Two kinds exist: a frozen reward
model (`--reward`, named "reward_model") and reward functions (`--reward-fn`: a built-in task's
checker or a user's Python function, `rlhf.reward_functions`). A source also says how its raw
scores are normalised before they are weighted (`normalization`: (mean, std), or None for raw).

`WeightedReward` is what PPO scores with: sum_i w_i * normalised_i(raw_i) over the --reward model
(first, when given) and each --reward-fn in order, the weights from --reward-weights (default all
1). It keeps the last batch's raw score of every source in `components` for the logs. A weight of
0 logs a source without training on it.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf.config import PPOConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel
from rlhf.data.formats import Message
from rlhf.data.retokenize import retokenize_for_reward, same_vocabulary
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.loading import load_tokenizer
from rlhf.models.value_model import deferred_load_value_model
from rlhf.reward_functions import RewardFunction, load_reward_functions, prompt_text

log = get_logger(__name__)

# 1e-2: a Bradley-Terry model whose scores spread less than this gives every pair a preference of
# sigmoid(delta) = 0.5 +- 0.005, i.e. it has learned no ordering (the zero-initialised head
# left 0.001), and the spread is of the order of the score's own rounding in bfloat16 (steps of
# 2^-8 ~ 0.004 near 1), a dtype the frozen reward model may run in: dividing by it amplifies noise.
DEGENERATE_SCORE_STD = 1e-2


# The reward model's source name (a reward function called so is renamed reward_model_2).
REWARD_MODEL = "reward_model"

Fields = list[dict[str, Any]] | None  # one dict of extra data columns per row; None: no columns


class RewardSource(Protocol):
    """Scores this rank's rollouts: [B] float32 on the rollouts' device, one per sequence.
    `shared_prefix`: rows that share their first that many columns (a sampled group's prompt)."""

    name: str
    normalization: tuple[float, float] | None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str], fields: Fields = None, shared_prefix: int = 0) -> torch.Tensor: ...


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

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str], fields: Fields = None, shared_prefix: int = 0) -> torch.Tensor:
        if self.tokenizer is None:  # packed, a group's prompt runs once
            return self.model.scores(sequences, attention_mask, self.pack_budget, shared_prefix)
        ids, mask, truncated = retokenize_for_reward(prompts, responses, self.tokenizer, self.max_len)
        self.truncated += truncated
        return self.model.scores(ids.to(sequences.device), mask.to(sequences.device), self.pack_budget)


@dataclass
class FunctionRewardSource:
    """A reward function (a built-in task's checker or a user's): scores the last user turn's text,
    the response and the row's data columns. Raw scores, never normalised."""

    function: RewardFunction
    normalization: tuple[float, float] | None = None

    @property
    def name(self) -> str:
        return self.function.name

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str], fields: Fields = None, shared_prefix: int = 0) -> torch.Tensor:
        rows = fields if fields is not None else [{} for _ in responses]
        values = self.function([prompt_text(p) for p in prompts], responses, rows)
        return torch.tensor(values, dtype=torch.float32, device=sequences.device)


def normalized(raw: torch.Tensor, normalization: tuple[float, float] | None) -> torch.Tensor:
    """(raw - mean) / std with a source's (mean, std); raw scores when None."""
    return raw if normalization is None else (raw - normalization[0]) / max(normalization[1], 1e-6)


@dataclass
class WeightedReward:
    """The reward PPO scores with: sum_i weights[i] * normalized(sources[i]'s raw scores), float32 [B].

    `components` holds the last call's raw scores per source name (this rank's; [B] each) for the
    `reward/<name>` metrics. Its scores are already normalised: `normalization` is None (the reward
    model's own is `model_normalization`). `retokenizes` and `take_truncated()` report a
    re-tokenising reward model's cuts."""

    sources: list[RewardSource]
    weights: list[float]
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    normalization: tuple[float, float] | None = None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str], fields: Fields = None, shared_prefix: int = 0) -> torch.Tensor:
        total = torch.zeros(len(responses), dtype=torch.float32, device=sequences.device)
        components = {}
        for source, weight in zip(self.sources, self.weights, strict=True):
            raw = source.score(sequences, attention_mask, prompts, responses, fields,
                               shared_prefix).float().to(sequences.device)
            components[source.name] = raw
            total += weight * normalized(raw, source.normalization)
        self.components = components
        return total

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


def check_reward_sources(config: PPOConfig) -> list[RewardFunction]:
    """Load every --reward-fn (files, modules and functions checked) and check --reward-weights'
    count, before any model is loaded; the functions go to `build_reward_source`."""
    functions = load_reward_functions(config.reward_fn, reserved=[REWARD_MODEL])
    names = ([REWARD_MODEL] if config.reward else []) + [f.name for f in functions]
    if not names:
        raise UserError("no reward source: pass --reward (a reward model folder) and/or --reward-fn "
                        "(a built-in task, path/to/file.py:function or package.module:function)")
    if config.reward_weights and len(config.reward_weights) != len(names):
        raise UserError(f"--reward-weights {','.join(f'{w:g}' for w in config.reward_weights)}: "
                        f"{len(config.reward_weights)} weights for {len(names)} reward sources ({', '.join(names)}); "
                        "give one weight per source, the --reward model first, then each --reward-fn in order")
    return functions


def build_reward_source(config: PPOConfig, ctx: DistributedContext, tokenizer: Any, dtype: str,
                        functions: list[RewardFunction] | None = None) -> WeightedReward:
    """The weighted reward over the --reward model (when given) and each --reward-fn in order.
    `functions`: from `check_reward_sources` (loaded again here when None)."""
    if functions is None:
        functions = check_reward_sources(config)
    sources: list[RewardSource] = [FunctionRewardSource(f) for f in functions]
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
                        config.engine.micro_batch_size, "reward", compile=config.engine.compile, weights=weights,
                        fused_layers=config.engine.fused_layers, cpu_matmul=config.engine.cpu_matmul)
    return RewardModelSource(model, reward_statistics(config.reward, config.normalize_reward),
                             reward_tok if retokenize else None, config.max_prompt_len + config.max_new_tokens,
                             pack_budget=config.max_tokens_per_micro_batch if config.pack_sequences else 0)


__all__ = [
    "DEGENERATE_SCORE_STD", "REWARD_MODEL", "FunctionRewardSource", "RewardModelSource", "RewardSource",
    "WeightedReward", "build_reward_model_source", "build_reward_source", "check_reward_sources", "normalized",
    "reward_statistics", "warn_if_degenerate",
]
