"""PPO math for RLHF as pure functions over [B, T] tensors with a response mask.

Conventions shared by every function here:
- Tensors are [B, T] and aligned with the response: position t holds the quantities of response
  token t (its log-prob under the policy, the critic's value of the state it was generated from,
  its reward). `mask` is 1 on real response tokens and 0 on padding (left, right or inside).
- Means are token means over the masked positions of the whole batch (DeepSpeed-Chat's
  `sum(x * mask) / sum(mask)`, TRL's `masked_mean`); an empty mask gives 0, never NaN.
- Outputs that are [B, T] are 0 outside the mask, so a stray padding value can never leak
  into a loss or a statistic.
- Losses are token means by default; `aggregate_loss` also gives the sequence-level means of
  GRPO/GSPO and Dr. GRPO's constant normaliser (verl's `agg_loss` modes).
- Statistics are computed in float32 whatever the input dtype (bf16 log-probs included);
  whitening's sums, which may be all-reduced over ranks, in float64.

References: InstructGPT (Ouyang et al. 2022) and Ziegler et al. 2019 for the per-token KL
penalty and the adaptive KL coefficient; DeepSpeed-Chat (`ppo_trainer.py`) and TRL
(`ppo_trainer.py`, `core.py`) for the reward placement, GAE and the clipped losses; verl
(`core_algos.py`) for GAE that skips masked positions; J. Schulman, "Approximating KL
divergence" (2020) for the k1/k2/k3 estimators; DAPO (Yu et al. 2025) for clip-higher, GSPO
(Zheng et al. 2025) for the sequence-level ratio, Dr. GRPO (Liu et al. 2025) for the constant
loss normaliser, GRPO (Shao et al. 2024) for KL as a loss term; Yao et al. 2025 ("Your Efficient
RL Framework Secretly Brings You Off-Policy RL Training") for truncated importance sampling of the
rollout/training mismatch, and verl's rollout importance sampling for its masked variant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from rlhf.engine.positions import last_token_index

KLKind = Literal["k1", "k2", "k3"]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1 (over all of them, or along `dim`).

    Follows TRL's `masked_mean` / DeepSpeed-Chat's `sum(x * mask) / mask.sum()`; an empty mask
    (or an empty row with `dim`) gives 0 rather than NaN so a loss stays finite.
    """
    mask = mask.to(torch.float32)
    total = (x.to(torch.float32) * mask).sum() if dim is None else (x.to(torch.float32) * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over the masked positions (a scalar), as TRL's `masked_var`.

    With `unbiased` the Bessel correction n / (n - 1) is applied, which needs at least two
    masked positions; fewer raise ValueError (this reads the count on the host).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x.to(torch.float32) - mean) ** 2, mask)
    if unbiased:
        count = mask.to(torch.float32).sum()
        if count.item() < 2:
            raise ValueError(f"unbiased masked_var needs at least 2 masked positions, got {int(count.item())}")
        var = var * count / (count - 1)
    return var


SumReducer = Callable[[Tensor], Tensor]
"""Sums a tensor over the data-parallel ranks (e.g. `DistributedContext.all_reduce_sum`)."""


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, all_reduce: SumReducer | None = None
) -> Tensor:
    """Normalise `x` to unit variance (and zero mean with `shift_mean`) over the masked positions.

    TRL's `masked_whiten`: advantages are whitened with `shift_mean=True`, rewards (when scaled)
    with `shift_mean=False` so their sign is kept. The mean and the unbiased variance come from
    three float64 sums (x, x**2, mask count); `all_reduce` sums them over ranks first, so N ranks
    each whitening their share give what one rank gives on the whole batch. Fewer than two masked
    positions give a variance of 0 (never an error, so one short batch cannot stop a run).
    Returns float32, 0 outside the mask.
    """
    m = mask.to(torch.float64)
    x64 = x.to(torch.float64)
    sums = torch.stack([(x64 * m).sum(), (x64 * x64 * m).sum(), m.sum()])
    if all_reduce is not None:
        sums = all_reduce(sums).to(sums.device)
    count = sums[2].clamp(min=1.0)
    mean = sums[0] / count
    var = ((sums[1] / count - mean * mean) * count / (count - 1.0).clamp(min=1.0)).clamp(min=0.0)
    mean32 = mean.to(torch.float32)
    whitened = (x.to(torch.float32) - mean32) * torch.rsqrt(var.to(torch.float32) + eps)
    if not shift_mean:
        whitened = whitened + mean32
    return whitened * mask.to(torch.float32)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    With log_ratio = log pi(a) - log pi_ref(a) for a ~ pi (Schulman, "Approximating KL"):
    - "k1": log_ratio - unbiased, can be negative per token; InstructGPT's penalty.
    - "k2": log_ratio**2 / 2 - biased, low variance, always >= 0.
    - "k3": exp(-log_ratio) - 1 + log_ratio - unbiased, always >= 0 (GRPO's / verl's low-var KL).
    """
    log_ratio = logprobs.to(torch.float32) - ref_logprobs.to(torch.float32)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def compute_token_rewards(
    score: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    kl_kind: KLKind = "k1",
    reward_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: -kl_coef * KL on every response token, plus the score on the last one.

    InstructGPT's reward R(x, y) = r(x, y) - beta * log(pi(y|x) / pi_ref(y|x)), spread over
    tokens as in DeepSpeed-Chat's `compute_rewards` and TRL: each response token gets its KL
    penalty and the sequence-level `score` [B] (clamped to [-reward_clip, reward_clip] when set,
    as DeepSpeed-Chat's `clip_reward_value`) is added at the LAST masked token of each row, found
    from the mask so sequences of different lengths and any padding are handled.

    Returns (rewards [B, T], kl [B, T]), both float32 and 0 outside the mask.
    """
    mask_f = mask.to(torch.float32)
    kl = kl_estimate(logprobs, ref_logprobs, kl_kind) * mask_f
    rewards = -kl_coef * kl
    score = score.to(torch.float32)
    if reward_clip is not None:
        score = score.clamp(-reward_clip, reward_clip)
    last = last_token_index(mask)
    rewards = rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1))
    return rewards, kl


def masked_columns(mask: Tensor) -> range:
    """The columns from the first to the last that any row's mask holds (the response span of a
    left-padded batch): a backward scan skips every column outside it without changing a result.
    One host sync (the span's ends)."""
    held = mask.any(dim=0).nonzero()
    return range(int(held[0]), int(held[-1]) + 1) if held.numel() else range(0)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the masked tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, run backward
    as in TRL / DeepSpeed-Chat's `get_advantages_and_returns`. Masked-out positions are skipped
    the way verl's `compute_gae_advantage_return` skips them: the "next" value and advantage are
    carried across them, so after the last response token of a row V_{t+1} = A_{t+1} = 0 (no
    bootstrapping past the end of the response, whatever values the padding holds).

    Returns (advantages, returns = advantages + values), float32, 0 outside the mask. Whitening
    the advantages is left to the caller (`masked_whiten`).
    """
    rewards = rewards.to(torch.float32)
    values = values.to(torch.float32)
    mask = mask.bool()
    mask_f = mask.to(torch.float32)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(masked_columns(mask)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        m = mask[:, t]
        # On a masked-out position keep the successor's value/advantage unchanged (skip it).
        next_value = torch.where(m, values[:, t], next_value)
        next_advantage = torch.where(m, advantage, next_advantage)
        advantages[:, t] = advantage
    advantages = advantages * mask_f
    returns = (advantages + values) * mask_f
    return advantages, returns


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""How a [B, T] per-token loss becomes a scalar (verl's `loss_agg_mode` names)."""


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str, normalizer: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the mask (verl's `agg_loss`).

    - "token-mean": mean over every masked token of the batch (PPO, DAPO): long responses weigh
      more, in proportion to their length.
    - "seq-mean-token-mean": each row's masked token mean, then the mean over rows (GRPO as in
      DeepSeekMath, GSPO); rows with an empty mask are left out of the row count, as verl.
    - "seq-mean-token-sum-norm": each row's masked token SUM divided by the constant `normalizer`
      (e.g. max_new_tokens), then the mean over rows (Dr. GRPO, Liu et al. 2025, Listing 1; TRL's
      `loss_type="dr_grpo"`). A constant divisor removes GRPO's length bias. verl's `agg_loss`
      sums over rows instead of averaging, a factor of B that we leave to the learning rate.
    An empty mask gives 0, never NaN.
    """
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    mask_f = mask.to(torch.float32)
    row_sums = (per_token.to(torch.float32) * mask_f).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        row_counts = mask_f.sum(dim=-1)
        nonempty = (row_counts > 0).to(torch.float32)
        return (row_sums / row_counts.clamp(min=1.0)).sum() / nonempty.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        if normalizer is None or normalizer <= 0:
            raise ValueError(f"loss aggregation 'seq-mean-token-sum-norm' needs a normalizer > 0, got {normalizer}")
        return row_sums.mean() / normalizer if row_sums.numel() else row_sums.sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")


def gspo_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token log-ratio [B, T]: sg(log s_i) + logp - sg(logp), log s_i the row's mean log-ratio.

    Zheng et al. 2025 ("Group Sequence Policy Optimization", eq. 13-14): s_i = (pi / pi_old)(y_i)
    ^ (1 / |y_i|). Every token's ratio has the value s_i, and its gradient is s_i * grad logp_t,
    so with a sequence-level advantage the surrogate's gradient is the sequence objective's.
    """
    logprobs = logprobs.to(torch.float32)
    log_ratio = logprobs - old_logprobs.to(torch.float32)
    log_seq_ratio = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)
    return log_seq_ratio + logprobs - logprobs.detach()


ROLLOUT_IS_MODES = ("truncate", "mask", "off")
"""How the rollout/training mismatch weight corrects the policy loss (`rollout_is_correction`)."""

ROLLOUT_IS_LOG_BOUND = 20.0
"""|log w| is clamped to this before exp (verl's SAFETY_BOUND): a token whose two log-probs differ by
more still counts as far out of bounds, and its weight stays finite."""


def rollout_is_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token weight w = exp(old_logp - rollout_logp) [B, T], float32, detached: the training
    forward's probability of each sampled token over the rollout engine's (which sampled it);
    1 outside the mask. The log-ratio is clamped to +-ROLLOUT_IS_LOG_BOUND."""
    with torch.no_grad():
        log_ratio = old_logprobs.to(torch.float32) - rollout_logprobs.to(torch.float32)
        ratio = torch.exp(log_ratio.clamp(-ROLLOUT_IS_LOG_BOUND, ROLLOUT_IS_LOG_BOUND))
        return torch.where(mask.bool(), ratio, torch.ones_like(ratio))


def rollout_is_correction(ratio: Tensor, mask: Tensor, mode: str, cap: float) -> tuple[Tensor | None, Tensor, Tensor]:
    """(per-token loss weights or None, the policy loss's mask, the tokens the cap acted on) for
    the rollout weights `ratio` (`rollout_is_ratio`) over `mask`.

    - "truncate" (TIS, Yao et al. 2025; TRL's vllm_importance_sampling_correction, verl's
      rollout_is truncate): every response token's loss is multiplied by min(w, cap); the tokens
      the cap acted on are those with w > cap. The mask is unchanged.
    - "mask" (MIS, verl's rollout_is mask mode): tokens with w outside [1/cap, cap] leave the
      policy loss's mask (so the aggregation's normaliser no longer counts them, as verl's
      modified response mask); the kept ones are weighted by w.
    - "off": no weights, the mask unchanged, nothing acted on.
    Every output is detached and 0 (False) outside `mask`.
    """
    mask = mask.bool()
    if mode == "off":
        return None, mask, torch.zeros_like(mask)
    if cap <= 1:
        raise ValueError(f"the rollout importance-sampling cap must be > 1, got {cap}")
    ratio = ratio.detach().to(torch.float32)
    if mode == "truncate":
        return ratio.clamp(max=cap) * mask, mask, mask & (ratio > cap)
    if mode == "mask":
        outside = mask & ((ratio > cap) | (ratio < 1.0 / cap))
        kept = mask & ~outside
        return ratio * kept, kept, outside
    raise ValueError(f"unknown rollout importance sampling {mode!r}; expected one of {', '.join(ROLLOUT_IS_MODES)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float,
    clip_range_high: float | None = None,
    *,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    ratio_level: str = "token",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate loss (Schulman et al. 2017), aggregated over the mask.

    loss = agg(max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))), ratio =
    exp(logp - old_logp), as DeepSpeed-Chat's `actor_loss_fn` and TRL. Options the critic-free
    methods use:
    - `clip_range_high` (None: `clip_range`): DAPO's clip-higher, a wider upper bound so
      low-probability tokens can still grow (Yu et al. 2025).
    - `aggregation`/`normalizer`: see `aggregate_loss` (default: token mean).
    - `ratio_level="sequence"`: GSPO's sequence-level ratio (see `gspo_log_ratio`),
      clipped like the token one; verl's `compute_policy_loss_gspo`.
    - `token_weights` [B, T] (detached): each token's clipped surrogate is multiplied by its
      weight before aggregation (the rollout importance weights of `rollout_is_correction`, as
      TRL's and verl's TIS multiply the per-token loss).
    Also returns, detached and as token means over the mask: clipfrac (share of tokens where the
    clipped term is the active one) and approx_kl = mean(0.5 * (logp - old_logp)**2) (TRL's
    `approxkl`, from the token log-ratios whatever `ratio_level`).
    """
    logprobs = logprobs.to(torch.float32)
    log_ratio = logprobs - old_logprobs.to(torch.float32)
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)
    elif ratio_level == "sequence":
        ratio = torch.exp(gspo_log_ratio(logprobs, old_logprobs, mask))
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected 'token' or 'sequence'")
    high = clip_range if clip_range_high is None else clip_range_high
    advantages = advantages.to(torch.float32)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(torch.float32)
    loss = aggregate_loss(per_token, mask, aggregation, normalizer)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(torch.float32), mask)
        approx_kl = masked_mean(0.5 * log_ratio.square(), mask)
    return loss, clipfrac, approx_kl


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: KLKind,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> Tensor:
    """KL(policy || reference) as a loss term (GRPO, Shao et al. 2024; verl's `use_kl_loss`).

    Instead of a penalty in the reward, beta * this is added to the policy loss; GRPO uses the
    "k3" estimator. The gradient flows through `logprobs` only (the reference is a constant).
    Aggregated like the policy loss (`aggregate_loss`).
    """
    per_token = kl_estimate(logprobs, ref_logprobs.detach(), kind)
    return aggregate_loss(per_token, mask, aggregation, normalizer)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float
) -> tuple[Tensor, Tensor]:
    """Clipped value loss: 0.5 * mean(max((V - R)**2, (V_clipped - R)**2)) over the mask.

    V_clipped = old_V + clip(V - old_V, -eps, eps), as DeepSpeed-Chat's `critic_loss_fn`, TRL
    and OpenAI baselines' ppo2. Also returns the detached share of tokens where the clipped
    error is the larger one (clipfrac).
    """
    values = values.to(torch.float32)
    old_values = old_values.to(torch.float32)
    returns = returns.to(torch.float32)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(error, clipped_error), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > error).to(torch.float32), mask)
    return loss, clipfrac


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over the mask (a scalar), as in OpenAI baselines.

    1 is a perfect critic, 0 no better than a constant, negative worse; NaN when the returns
    have zero variance (nothing to explain), as baselines' `explained_variance`.
    """
    returns = returns.to(torch.float32)
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values.to(torch.float32), mask, unbiased=False)
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns, torch.full_like(var_returns, float("nan")))


class FixedKLController:
    """A constant KL coefficient (`value`); `update` is a no-op so it swaps with the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient fixed (same signature as AdaptiveKLController.update)."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences").

    After each batch, with e = clip(KL / target - 1, -0.2, 0.2):
    value <- value * (1 + e * n_steps / horizon). The coefficient grows while the policy drifts
    further than `target` nats from the reference and shrinks while it stays closer.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust `value` from the measured mean KL (per sequence) over `n_steps` samples."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
