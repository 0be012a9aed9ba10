"""Supervised fine-tuning and reward-model losses as pure functions over tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def sft_loss_sum(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Summed next-token cross entropy and the number of tokens it covers.

    `logits` [B, T, V] at position t predict `labels` [B, T] at t + 1 (the shift of Hugging
    Face's causal-LM loss); labels equal to `ignore_index` (prompt and padding) are skipped.
    The cross entropy is taken in float32. Returns (loss_sum, num_tokens) with num_tokens an
    int64 scalar tensor, so gradient accumulation over micro-batches and data-parallel ranks can
    divide the total sum by the total token count: every token weighs the same however the
    tokens are spread over micro-batches (a mean of per-micro-batch means does not).
    """
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1]).to(torch.float32)
    shift_labels = labels[:, 1:].reshape(-1)
    loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    num_tokens = (shift_labels != ignore_index).sum()
    return loss_sum, num_tokens


def sft_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Token-mean next-token cross entropy and the number of tokens it covers.

    Same shift and masking as `sft_loss_sum`; (loss_sum / num_tokens, num_tokens). A batch
    with no supervised token gives a loss of 0 (with a zero gradient) rather than NaN.
    """
    loss_sum, num_tokens = sft_loss_sum(logits, labels, ignore_index)
    return loss_sum / num_tokens.clamp(min=1), num_tokens


def pairwise_reward_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | float | None = None, center_coef: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Bradley-Terry preference loss of a reward model and its pairwise accuracy.

    loss = mean(-log sigmoid(r_chosen - r_rejected - margin)) over the [B] pairs, as InstructGPT
    and DeepSpeed-Chat's reward model; `margin` (a float or [B] tensor) is Llama 2's preference
    margin. `logsigmoid` keeps it finite for large score gaps. `center_coef` adds
    center_coef * mean((r_chosen + r_rejected)^2), which pulls the scores towards mean zero
    (Eisenstein et al. 2023, eq. 2; TRL's center_rewards_coefficient). Accuracy (detached) is the
    share of pairs with r_chosen > r_rejected, the margin not counted.
    """
    chosen = chosen_scores.to(torch.float32)
    rejected = rejected_scores.to(torch.float32)
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        accuracy = (chosen > rejected).to(torch.float32).mean()
    return loss, accuracy
