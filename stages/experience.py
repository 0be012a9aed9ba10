"""PPO experience: one rollout batch turned into rewards, advantages and returns.

Alignment: log-probs are [B, T-1] (position t scores token t+1); values come from the critic's
[B, T] output as values[:, :-1] (the value of the prefix that ends at t, i.e. of the state in which
token t+1 was chosen); the response mask is the generation's action mask shifted the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from rlhf.algorithms.advantages import discounted_returns
from rlhf.engine.micro_batches import column_span
from rlhf.algorithms.ppo_math import KLKind, SumReducer, compute_token_rewards, gae_advantages, masked_whiten


@dataclass
class Experience:
    """A batch of rollouts with everything the PPO update needs (all on one device)."""

    sequences: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    action_mask: torch.Tensor  # [B, T-1] bool: response tokens
    old_logprobs: torch.Tensor | None  # [B, T-1]; None: the update is on-policy, the trained forward's own
    ref_logprobs: torch.Tensor | None  # [B, T-1]; None: no reference model (no KL term, PPOConfig.needs_reference)
    old_values: torch.Tensor  # [B, T-1]
    rewards: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, T-1]
    returns: torch.Tensor  # [B, T-1]
    scores: torch.Tensor  # [B] raw scores (before normalisation and clipping)
    kl: torch.Tensor | None  # [B, T-1]; None without a reference
    rollout_logprobs: torch.Tensor | None = None  # [B, T-1] generation's, for --rollout-is; None: no correction

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, index: torch.Tensor | slice) -> "Experience":
        return Experience(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                             for f in fields(self)})

    def trimmed(self) -> "Experience":
        """The same rows without the columns that are padding in all of them (engine/micro_batches.py):
        a causal forward gives the same log-probs and values on what is left."""
        width = self.sequences.shape[1]
        lo, hi = column_span(self.attention_mask)
        if (lo, hi) == (0, width):
            return self

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() < 2:
                return t
            return t[:, lo:hi] if t.shape[1] == width else t[:, lo : hi - 1]

        return Experience(**{f.name: cut(getattr(self, f.name)) for f in fields(self)})


def shaped_scores(
    weighted: torch.Tensor, ended_with_eos: torch.Tensor, missing_eos_penalty: float,
    overlong: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score used in the reward: the reward sources' weighted sum (each already normalised by its
    source), minus a penalty when EOS never came, plus DAPO's (non-positive) overlong penalty."""
    score = weighted - missing_eos_penalty * (~ended_with_eos).float()
    return score if overlong is None else score + overlong.to(score.dtype)


def build_experience(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask_full: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    values_full: torch.Tensor | None,
    raw_scores: torch.Tensor,
    scores: torch.Tensor,
    kl_coef: float,
    kl_kind: KLKind,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    reward_clip: float | None = None,
    all_reduce: SumReducer | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> Experience:
    """Rewards (KL penalty + `scores` on the last response token) and advantages.

    With the critic's values: GAE advantages and returns. Without (`values_full` None, the
    critic-free estimators, whose group baseline is already in `scores`): each token's advantage
    is the return that follows it (discounted_returns) and `returns` equal it. `raw_scores` are
    kept for the metrics, `scores` (normalised, penalised, baselined) go into the reward; a KL that
    goes into the loss instead passes kl_coef 0 here, and then `old_logprobs` may be None (an
    on-policy update reads the trained forward's own log-probs; `kl` is then 0 here and measured
    in the update). Advantages are whitened over the masked
    tokens of every rank (`all_reduce`) when `whiten_advantages`. Without a reference (`ref_logprobs`
    None, kl_coef 0) the score is the only reward and `kl` is None. `rollout_logprobs` [B, T-1]
    (generation's, aligned as the log-probs) are kept for the update's rollout importance weights.
    """
    mask = action_mask_full[:, 1:].bool()
    if old_logprobs is None and kl_coef:
        raise ValueError("a KL penalty in the reward needs the rollout policy's log-probs")
    if ref_logprobs is None:
        if kl_coef:
            raise ValueError("a KL penalty in the reward needs the reference model's log-probs")
        no_kl = mask.new_zeros(mask.shape, dtype=torch.float32)
        rewards, _ = compute_token_rewards(scores, no_kl, no_kl, mask, 0.0, kl_kind, reward_clip)
        kl = None
    else:
        rewards, kl = compute_token_rewards(scores, ref_logprobs if old_logprobs is None else old_logprobs,
                                            ref_logprobs, mask, kl_coef, kl_kind, reward_clip)
    if values_full is not None:
        values = values_full[:, :-1].float() * mask
        advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
    else:
        values = torch.zeros_like(rewards)
        advantages = discounted_returns(rewards, mask, gamma)
        returns = advantages
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask, all_reduce=all_reduce)
    return Experience(sequences, attention_mask, mask, old_logprobs, ref_logprobs, values, rewards,
                      advantages, returns, raw_scores, kl, rollout_logprobs)


def mean_kl_per_sequence(exp: Experience) -> torch.Tensor:
    """KL summed over each response, averaged over the batch (what adaptive KL targets); needs a reference."""
    assert exp.kl is not None, "no reference model: no KL"
    return (exp.kl * exp.action_mask).sum(-1).mean()


__all__ = ["Experience", "build_experience", "mean_kl_per_sequence", "shaped_scores"]


@dataclass
class LogprobDrift:
    """How far the experience's old log-probs (generation's, when PPO does not recompute them) are
    from the training forward's before any optimizer step, over response tokens: what taking
    them from generation costs in accuracy. Accumulated per micro-batch as device tensors (no host
    read in the micro-step), reset every iteration."""

    max: torch.Tensor | float = 0.0
    total: torch.Tensor | float = 0.0
    count: torch.Tensor | float = 0.0

    def add(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        mask = mask.bool()
        diff = torch.where(mask, (logprobs.detach().float() - old_logprobs.float()).abs(), 0.0).double()
        most = diff.amax() if diff.numel() else diff.new_zeros(())
        self.max = torch.maximum(torch.as_tensor(self.max, dtype=torch.float64, device=diff.device), most)
        self.total = self.total + diff.sum()
        self.count = self.count + mask.sum().double()

    def global_metrics(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                       all_reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """old_logprob_diff_max / _mean over all ranks (every rank must call it)."""
        sums = all_reduce_sum(torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu()
                                           for v in (self.total, self.count)]))
        most = all_reduce_max(torch.as_tensor(self.max, dtype=torch.float64).cpu())
        return {"old_logprob_diff_max": float(most), "old_logprob_diff_mean": float(sums[0]) / max(float(sums[1]), 1.0)}
