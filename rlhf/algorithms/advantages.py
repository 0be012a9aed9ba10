"""Critic-free advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) and DAPO's reward shaping.

These replace GAE's learned critic with a baseline computed from the rewards themselves. The
sequence-level score of each sample is first transformed by its estimator's group rule
(`group_baseline_scores`), placed on the last response token together with the per-token KL
penalty (`ppo.compute_token_rewards`), and turned into a per-token advantage by the undiscounted
return (`discounted_returns`), as OpenRLHF's `get_cumulative_returns`. Whether the result is then
whitened over the batch is `whitens_advantages`. What each estimator is (its baseline, whether it
needs groups, whitens, ...) is its entry in `rlhf.algorithms.estimators.ESTIMATORS`.

Conventions: scores are [G * N] in group-major order (the N samples of prompt 0, then the N of
prompt 1, ...); per-token tensors follow `rlhf.algorithms.ppo_math` ([B, T] aligned to response
tokens, `mask` 1 on response tokens, outputs 0 outside the mask, float32).

References: GRPO - Shao et al. 2024 (DeepSeekMath), TRL `GRPOTrainer`, OpenRLHF `group_norm`;
Dr. GRPO - Liu et al. 2025 ("Understanding R1-Zero-Like Training"); RLOO - Ahmadian et al. 2024
("Back to Basics"), Kool et al. 2019; REINFORCE++ - Hu 2025, OpenRLHF `reinforce_baseline`;
DAPO - Yu et al. 2025 (dynamic sampling, overlong reward shaping).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algorithms.estimators import get_estimator
from rlhf.algorithms.ppo_math import masked_columns


def _as_groups(scores: Tensor, group_size: int) -> Tensor:
    """View float32 `scores` [G * N] as [G, N], rejecting a length that is not a multiple of N."""
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores cannot be split into groups of {group_size}")
    return scores.to(torch.float32).reshape(-1, group_size)


def varied_groups(scores: Tensor, group_size: int) -> Tensor:
    """[G] bool, True where a group's scores are not all equal.

    DAPO's dynamic sampling keeps only these groups: when every sample of a prompt gets the same
    reward, every group-relative advantage is 0 and the group contributes no gradient.
    """
    groups = _as_groups(scores, group_size)
    return groups.amax(dim=1) != groups.amin(dim=1)


def group_baseline_scores(scores: Tensor, group_size: int, estimator: str, eps: float = 1e-6) -> Tensor:
    """Per-sample score [G * N] after the estimator's group transform (float32).

    - "grpo": (r - mean_g) / (std_g + eps), std unbiased (torch.std, as TRL's GRPOTrainer and
      OpenRLHF's group_norm); a group whose rewards all tie gives exactly 0 (not 0 / eps noise).
    - "dr_grpo": r - mean_g; Dr. GRPO drops the std division, which over-weights easy/hard prompts.
    - "rloo": r_i minus the mean of the other N - 1 samples = N / (N - 1) * (r_i - mean_g).
    - "reinforce_pp_baseline": r - mean_g (REINFORCE++-baseline; whitened over the batch later).
    - "reinforce_pp", "gae": unchanged (the baseline is batch whitening or the critic).
    """
    entry = get_estimator(estimator)
    if entry.needs_groups and group_size < 2:
        raise ValueError(f"advantage estimator {estimator!r} needs a group size >= 2, got {group_size}")
    groups = _as_groups(scores, group_size)
    if not entry.needs_groups:
        return groups.reshape(-1)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if entry.baseline == "group mean, std-normalised":
        normalised = centred / (groups.std(dim=1, keepdim=True) + eps)
        varied = (groups.amax(dim=1) != groups.amin(dim=1)).unsqueeze(1)
        out = torch.where(varied, normalised, torch.zeros_like(normalised))
    elif entry.baseline == "leave-one-out":
        out = centred * (group_size / (group_size - 1))
    else:  # "group mean"
        out = centred
    return out.reshape(-1)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Per-token return G_t = r_t + gamma * G_{t+1} over the masked tokens, [B, T] float32.

    OpenRLHF's `get_cumulative_returns`: the token advantage of REINFORCE++, RLOO and GRPO. Run
    backward; masked-out positions are skipped (G_{t+1} carried across them, as
    `ppo.gae_advantages`), so a hole inside a response does not break the sum. With the score on
    the last response token and gamma 1, every response token gets the score plus the KL
    penalties of itself and the tokens after it. 0 outside the mask.
    """
    rewards = rewards.to(torch.float32)
    mask = mask.bool()
    mask_f = mask.to(torch.float32)
    next_return = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(masked_columns(mask)):
        current = rewards[:, t] + gamma * next_return
        next_return = torch.where(mask[:, t], current, next_return)
        returns[:, t] = current
    return returns * mask_f


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the score; float32 [B].

    With L the response length: 0 for L <= max - buffer; a linear ramp
    ((max - buffer) - L) / buffer * penalty inside the last `buffer` tokens; -penalty beyond max.
    It tells the policy that running into the length limit is bad without the cliff of a
    truncation-gets-zero rule. `buffer` 0 disables it (all zeros).
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    lengths = lengths.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    start = float(max_new_tokens - buffer)
    ramp = (start - lengths) / buffer * penalty
    out = torch.where(lengths > start, ramp, torch.zeros_like(lengths))
    return torch.where(lengths > max_new_tokens, torch.full_like(lengths, -penalty), out)


def whitens_advantages(estimator: str) -> bool:
    """Whether the token advantages are whitened over the batch (OpenRLHF's convention).

    True for gae, reinforce_pp and reinforce_pp_baseline (their scale comes from the batch);
    False for grpo, dr_grpo and rloo, already normalised or baselined within each group: the
    registry's `whitens_advantages` (rlhf/algorithms/estimators.py).
    """
    return get_estimator(estimator).whitens_advantages
