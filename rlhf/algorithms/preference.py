"""Offline preference losses: DPO and its family, named and computed as TRL's DPOTrainer (and, for
SimPO, its CPOTrainer) does.

Each takes, per pair, the policy's summed log-probs of the chosen and rejected responses, the
reference's (None for the reference-free SimPO) and the responses' token counts, and returns the
per-pair losses [B] with the implicit rewards of both responses (detached; the metrics
`rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`).

With the log-ratios c = log pi(y_w|x) - log ref(y_w|x), r = log pi(y_l|x) - log ref(y_l|x) and
delta = c - r:

    sigmoid   -(1 - e) log s(b delta) - e log s(-b delta)       (e = 0: DPO; e > 0: conservative DPO)
    robust    (-(1 - e) log s(b delta) + e log s(-b delta)) / (1 - 2e)
    hinge     max(0, 1 - b delta)
    ipo       (c / n_w - r / n_l - 1 / (2b))^2                  (per-token log-ratios, as TRL)
    apo_zero  1 - s(b c) + s(b r)
    simpo     -(1 - e) log s(b m) - e log s(-b m),  m = lp_w / n_w - lp_l / n_l - gamma / b

(s the logistic function, b beta, e label smoothing, n the responses' token counts, lp the policy's
summed log-probs). The rewards are b c and b r; SimPO's are b lp_w / n_w and b lp_l / n_l.

With `rpo_alpha` > 0 each pair's loss adds alpha x the chosen response's mean token NLL,
-lp_w / n_w (RPO, Pang et al. 2024, arXiv:2404.19733; TRL's rpo_alpha, in TRL 1.x the loss list
[<type>, sft] weighted [1, alpha]): it keeps the chosen responses likely, where DPO alone can lower
both responses' likelihood while it widens their margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf.algorithms.preference_types import LABEL_SMOOTHED, LOSS_PAPERS, REFERENCE_FREE, PreferenceLoss

@dataclass(frozen=True)
class PairLogps:
    """Summed response log-probs [B] of the chosen and rejected responses, and their token counts [B]."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass(frozen=True)
class PreferenceLossResult:
    """Per-pair losses [B] (differentiable) and the implicit rewards [B] of each response (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _smoothed_logistic(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - e) log s(x) - e log s(-x): the logistic loss against a label flipped with probability e."""
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def preference_loss(policy: PairLogps, reference: PairLogps | None, loss_type: PreferenceLoss, beta: float,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                    rpo_alpha: float = 0.0) -> PreferenceLossResult:
    """The `loss_type` loss of each pair (module docstring), plus `rpo_alpha` x the chosen response's
    mean token NLL; `reference` is the reference model's log-probs of the same responses (None
    only for the reference-free loss types)."""
    result = _pair_loss(policy, reference, loss_type, beta, label_smoothing, simpo_gamma)
    if rpo_alpha == 0:
        return result
    chosen_nll = -policy.chosen / policy.chosen_tokens.clamp(min=1)
    return PreferenceLossResult(result.losses + rpo_alpha * chosen_nll, result.chosen_rewards, result.rejected_rewards)


def _pair_loss(policy: PairLogps, reference: PairLogps | None, loss_type: PreferenceLoss, beta: float,
               label_smoothing: float, simpo_gamma: float) -> PreferenceLossResult:
    """The `loss_type` loss of each pair and the implicit rewards (module docstring)."""
    if loss_type == "simpo":
        chosen_avg = policy.chosen / policy.chosen_tokens.clamp(min=1)
        rejected_avg = policy.rejected / policy.rejected_tokens.clamp(min=1)
        logits = beta * (chosen_avg - rejected_avg) - simpo_gamma
        return PreferenceLossResult(_smoothed_logistic(logits, label_smoothing), beta * chosen_avg.detach(),
                                    beta * rejected_avg.detach())
    if reference is None:
        raise ValueError(f"loss type {loss_type!r} needs the reference model's log-probs")
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = _smoothed_logistic(beta * delta, label_smoothing)
    elif loss_type == "robust":
        clean = -(1.0 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1.0 - 2.0 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * delta)
    elif loss_type == "ipo":
        per_token = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (per_token - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "apo_zero":
        losses = 1.0 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    else:
        raise ValueError(f"unknown preference loss type {loss_type!r}; one of {sorted(LOSS_PAPERS)}")
    return PreferenceLossResult(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def preference_metric_sums(result: PreferenceLossResult, policy: PairLogps) -> dict[str, float]:
    """The pair metrics TRL logs, as sums over the pairs (the loop divides by the pair count):
    rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward strictly higher),
    rewards/margins, logps/chosen, logps/rejected (summed response log-probs)."""
    chosen, rejected = result.chosen_rewards.float(), result.rejected_rewards.float()
    return {
        "rewards/chosen": float(chosen.sum()),
        "rewards/rejected": float(rejected.sum()),
        "rewards/accuracies": float((chosen > rejected).sum()),
        "rewards/margins": float((chosen - rejected).sum()),
        "logps/chosen": float(policy.chosen.detach().float().sum()),
        "logps/rejected": float(policy.rejected.detach().float().sum()),
    }


__all__ = ["LABEL_SMOOTHED", "LOSS_PAPERS", "PairLogps", "PreferenceLoss", "PreferenceLossResult", "REFERENCE_FREE",
           "preference_loss", "preference_metric_sums"]
