"""Where PPO's scores come from: a reward source gives one number per rollout.

Every source has one method, `score(sequences, attention_mask, prompts, responses) -> [B]`
(`prompts`: each row's chat messages, `responses`: the decoded responses): model sources read the
token ids, rule-based sources the texts (the prompt's last user turn and the response). Two
exist: a frozen reward model (`--reward`) and a built-in task's ground-truth checker
(`--reward-fn`). A source also says how its raw scores are normalised before they enter the
reward (`normalization`: (mean, std), or None for raw scores).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf.config import PPOConfig
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import FrozenModel
from rlhf.data.formats import Message
from rlhf.data.retokenize import retokenize_for_reward, same_vocabulary
from rlhf.logging import get_logger
from rlhf.models.loading import load_tokenizer
from rlhf.models.value_model import load_value_model

log = get_logger(__name__)

# 1e-2: a Bradley-Terry model whose scores spread less than this gives every pair a preference of
# sigmoid(delta) = 0.5 +- 0.005, i.e. it has learned no ordering (the zero-initialised head
# left 0.001), and the spread is of the order of the score's own rounding in bfloat16 (steps of
# 2^-8 ~ 0.004 near 1), a dtype the frozen reward model may run in: dividing by it amplifies noise.
DEGENERATE_SCORE_STD = 1e-2


class RewardSource(Protocol):
    """Scores this rank's rollouts: [B] float32 on the rollouts' device, one per sequence."""

    normalization: tuple[float, float] | None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str]) -> torch.Tensor: ...


@dataclass
class RewardModelSource:
    """A frozen reward model: the value at each sequence's last real token.

    With `tokenizer` set (the reward model's own, when it differs from the actor's), the rollout
    ids are not scored: each prompt's messages and decoded response are rendered again in the
    reward model's tokenizer and template, cut to `max_len` tokens from the left (`truncated`
    counts those cuts, for the metrics)."""

    model: FrozenModel
    normalization: tuple[float, float] | None = None
    tokenizer: Any = None
    max_len: int = 0
    truncated: int = 0

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str]) -> torch.Tensor:
        if self.tokenizer is None:
            return self.model.scores(sequences, attention_mask)
        ids, mask, truncated = retokenize_for_reward(prompts, responses, self.tokenizer, self.max_len)
        self.truncated += truncated
        return self.model.scores(ids.to(sequences.device), mask.to(sequences.device))


@dataclass
class TaskRewardSource:
    """A built-in task's checker (`rlhf.data.tasks`): score(prompt text, response text)."""

    task: Any
    device: torch.device
    normalization: tuple[float, float] | None = None

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompts: list[list[Message]],
              responses: list[str]) -> torch.Tensor:
        texts = [p[-1]["content"] for p in prompts]  # the last user turn, what the tasks check against
        return torch.tensor([self.task.score(p, r) for p, r in zip(texts, responses)], device=self.device)


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


def build_reward_source(config: PPOConfig, ctx: DistributedContext, tokenizer: Any, dtype: str) -> RewardSource:
    """The source that --reward-fn or --reward names (the task checker wins when both are given)."""
    if config.reward_fn:
        from rlhf.data.tasks import get_task

        return TaskRewardSource(get_task(config.reward_fn), ctx.device)
    reward_tok = load_tokenizer(config.reward, "--reward")
    retokenize = not same_vocabulary(reward_tok, tokenizer)
    if retokenize:
        log.info("--reward %s: its tokenizer differs from the actor's; responses are decoded and re-tokenised "
                 "with the reward model's tokenizer and chat template", config.reward)
    model = FrozenModel(load_value_model(config.reward, dtype=torch.float32), ctx, config.engine.zero_stage,
                        dtype, config.offload_reward, config.engine.micro_batch_size, "reward")
    return RewardModelSource(model, reward_statistics(config.reward, config.normalize_reward),
                             reward_tok if retokenize else None, config.max_prompt_len + config.max_new_tokens)


__all__ = [
    "DEGENERATE_SCORE_STD", "RewardModelSource", "RewardSource", "TaskRewardSource", "build_reward_source",
    "reward_statistics", "warn_if_degenerate",
]
