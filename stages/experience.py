"""PPO experience: one rollout batch turned into rewards, advantages and returns.

Alignment: log-probs are [B, T-1] (position t scores token t+1); values come from the critic's
[B, T] output as values[:, :-1] (the value of the prefix that ends at t, i.e. of the state in which
token t+1 was chosen); the response mask is the generation's action mask shifted the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rlhf.algorithms.ppo import compute_token_rewards, gae_advantages, masked_mean
from rlhf.engine.distributed import DistributedContext


@dataclass
class Experience:
    """A batch of rollouts with everything the PPO update needs (all on one device)."""

    sequences: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    action_mask: torch.Tensor  # [B, T-1] bool: response tokens
    old_logprobs: torch.Tensor  # [B, T-1]
    ref_logprobs: torch.Tensor  # [B, T-1]
    old_values: torch.Tensor  # [B, T-1]
    rewards: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, T-1]
    returns: torch.Tensor  # [B, T-1]
    scores: torch.Tensor  # [B] raw scores (before normalisation and clipping)
    kl: torch.Tensor  # [B, T-1]

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, index: torch.Tensor | slice) -> "Experience":
        return Experience(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def global_whiten(x: torch.Tensor, mask: torch.Tensor, ctx: DistributedContext, eps: float = 1e-8) -> torch.Tensor:
    """Whiten `x` over the masked entries of ALL ranks (so N ranks equal one rank on the same batch)."""
    m = mask.float()
    stats = ctx.all_reduce_sum(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).double())
    count = stats[2].clamp(min=1.0)
    mean = stats[0] / count
    var = (stats[1] / count - mean * mean) * count / (count - 1).clamp(min=1.0)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps)
    return out * m


def shaped_scores(
    raw: torch.Tensor, ended_with_eos: torch.Tensor, mean: float, std: float, normalize: bool,
    missing_eos_penalty: float,
) -> torch.Tensor:
    """Score used in the reward: optionally normalised, minus a penalty when EOS never came."""
    score = (raw - mean) / max(std, 1e-6) if normalize else raw
    return score - missing_eos_penalty * (~ended_with_eos).float()


def build_experience(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask_full: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values_full: torch.Tensor,
    raw_scores: torch.Tensor,
    score_fn: Callable[[torch.Tensor], torch.Tensor],
    kl_coef: float,
    kl_kind: str,
    reward_clip: float | None,
    gamma: float,
    lam: float,
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> Experience:
    """Rewards (KL penalty + score on the last response token), GAE advantages and returns."""
    mask = action_mask_full[:, 1:].bool()
    values = values_full[:, :-1].float() * mask
    score = score_fn(raw_scores)
    rewards, kl = compute_token_rewards(score, old_logprobs, ref_logprobs, mask, kl_coef, kl_kind, reward_clip)
    advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
    if whiten is not None:
        advantages = whiten(advantages, mask)
    return Experience(sequences, attention_mask, mask, old_logprobs, ref_logprobs, values, rewards,
                      advantages, returns, raw_scores, kl)


def response_lengths(exp: Experience) -> torch.Tensor:
    return exp.action_mask.sum(-1).float()


def mean_kl_per_sequence(exp: Experience) -> torch.Tensor:
    """KL summed over each response, averaged over the batch (what adaptive KL targets)."""
    return (exp.kl * exp.action_mask).sum(-1).mean()


__all__ = ["Experience", "build_experience", "global_whiten", "masked_mean", "mean_kl_per_sequence",
           "response_lengths", "shaped_scores"]
