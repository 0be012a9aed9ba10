"""Loss aggregation, clip-higher, GSPO's sequence ratio and the KL loss against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.ppo_math import aggregate_loss, gspo_log_ratio, kl_loss, masked_mean, policy_loss

# 99 marks padding that must never reach a result.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 5.0, 7.0, 99.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 0]])


def _close(actual: torch.Tensor, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=rtol, atol=atol)


def test_aggregate_token_mean() -> None:
    _close(aggregate_loss(PER_TOKEN, AGG_MASK, "token-mean"), 22.0 / 6.0)  # (1+2+3+4+5+7) / 6


def test_aggregate_seq_mean_token_mean() -> None:
    _close(aggregate_loss(PER_TOKEN, AGG_MASK, "seq-mean-token-mean"), 4.0)  # mean(2, 4, 6)


def test_aggregate_seq_mean_token_sum_norm() -> None:
    # Row sums 6, 4, 12 each / 4, then the mean over 3 rows.
    _close(aggregate_loss(PER_TOKEN, AGG_MASK, "seq-mean-token-sum-norm", normalizer=4.0), 22.0 / 12.0)


def test_aggregate_empty_rows_and_empty_mask() -> None:
    per_token = torch.cat([PER_TOKEN, torch.full((1, 4), 99.0)])
    mask = torch.cat([AGG_MASK, torch.zeros(1, 4, dtype=AGG_MASK.dtype)])
    _close(aggregate_loss(per_token, mask, "token-mean"), 22.0 / 6.0)
    # verl's agg_loss: a fully masked row is left out of the row count of the seq mean...
    _close(aggregate_loss(per_token, mask, "seq-mean-token-mean"), 4.0)
    # ...while Dr. GRPO (TRL) divides by the batch size: 22 / 4 / 4 rows.
    _close(aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", normalizer=4.0), 22.0 / 16.0)
    empty = torch.zeros_like(mask)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert float(aggregate_loss(per_token, empty, mode, normalizer=4.0)) == 0.0


def test_aggregate_rejects_missing_normalizer_and_unknown_mode() -> None:
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "seq-sum")


def _old_policy_loss(logprobs, old_logprobs, advantages, mask, clip_range):
    """The formula policy_loss had before the new options, copied verbatim."""
    log_ratio = logprobs.to(torch.float32) - old_logprobs.to(torch.float32)
    ratio = torch.exp(log_ratio)
    advantages = advantages.to(torch.float32)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(torch.float32), mask)
        approx_kl = masked_mean(0.5 * log_ratio.square(), mask)
    return loss, clipfrac, approx_kl


def test_policy_loss_defaults_equal_the_old_formula() -> None:
    g = torch.Generator().manual_seed(3)
    logprobs = torch.randn(3, 5, generator=g)
    old = logprobs + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])
    new_lp = logprobs.clone().requires_grad_(True)
    ref_lp = logprobs.clone().requires_grad_(True)
    new = policy_loss(new_lp, old, adv, mask, 0.2)
    ref = _old_policy_loss(ref_lp, old, adv, mask, 0.2)
    for a, b in zip(new, ref):
        assert torch.equal(a, b)
    new[0].backward()
    ref[0].backward()
    assert torch.equal(new_lp.grad, ref_lp.grad)
    assert torch.equal(policy_loss(logprobs, old, adv, mask, 0.2, 0.2)[0], ref[0])


def test_clip_higher_leaves_a_ratio_of_1_25_unclipped() -> None:
    logprobs = torch.tensor([[math.log(1.25)]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    loss, clipfrac, _ = policy_loss(logprobs, old, adv, mask, 0.2, clip_range_high=0.28)
    _close(loss, -1.25)
    assert float(clipfrac) == 0.0
    loss.backward()
    _close(logprobs.grad, [[-1.25]])  # d(-ratio)/dlogp = -ratio: still learning
    logprobs.grad = None
    loss, clipfrac, _ = policy_loss(logprobs, old, adv, mask, 0.2, clip_range_high=0.2)
    _close(loss, -1.2)
    assert float(clipfrac) == 1.0
    loss.backward()
    _close(logprobs.grad, [[0.0]])


def test_clip_higher_leaves_the_lower_bound_alone() -> None:
    # ratio 0.75, A = -1: the lower bound 0.8 binds whatever clip_range_high is.
    logprobs = torch.tensor([[math.log(0.75)]])
    loss, clipfrac, _ = policy_loss(logprobs, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    _close(loss, 0.8)
    assert float(clipfrac) == 1.0


# Log-ratios: row 0 mean (0.1+0.2+0.3)/3 = 0.2; row 1 (hole at t=1) mean (-0.3+0+0)/3 = -0.1.
# 5.0 sits on padding and must not enter a row mean.
GSPO_LOG_RATIO = torch.tensor([[0.1, 0.2, 0.3, 5.0], [-0.3, 5.0, 0.0, 0.0]])
GSPO_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
S0, S1 = 1.2214027581601699, 0.9048374180359595  # exp(0.2), exp(-0.1)


def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    return (old + GSPO_LOG_RATIO).requires_grad_(True), old


def test_gspo_ratio_value_is_s_i_on_every_token() -> None:
    logprobs, old = _gspo_inputs()
    ratio = torch.exp(gspo_log_ratio(logprobs, old, GSPO_MASK))
    masked = ratio * GSPO_MASK
    _close(masked, [[S0, S0, S0, 0.0], [S1, 0.0, S1, S1]])


def test_gspo_loss_value_clipfrac_and_approx_kl() -> None:
    logprobs, old = _gspo_inputs()
    adv = torch.tensor([[1.0] * 4, [2.0] * 4])
    loss, clipfrac, approx_kl = policy_loss(logprobs, old, adv, GSPO_MASK, 0.2,
                                            aggregation="seq-mean-token-mean", ratio_level="sequence")
    # Row 0: s = 1.2214 > 1.2 with A > 0 -> clipped to -1.2; row 1: -2 * 0.9048374.
    _close(loss, (-1.2 - 2.0 * S1) / 2.0)
    _close(clipfrac, 0.5)
    # Token log-ratios: 0.5 * (0.01 + 0.04 + 0.09 + 0.09 + 0 + 0) / 6.
    _close(approx_kl, 0.115 / 6.0)


def _sequence_objective(logprobs, old, adv_rows, mask, low, high):
    """GSPO's sequence-level objective written directly (Zheng et al. 2025, eq. 5-7), as a loss."""
    m = mask.to(torch.float32)
    s = torch.exp(((logprobs - old) * m).sum(-1) / m.sum(-1))
    per_seq = torch.maximum(-adv_rows * s, -adv_rows * torch.clamp(s, 1.0 - low, 1.0 + high))
    return per_seq.mean()


@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_gspo_gradient_matches_the_sequence_level_objective(clip_high: float) -> None:
    # Row 0 (s = 1.2214, A > 0) clipped at 1.2 but not at 1.28; rows 1 and 2 (A < 0) inside.
    log_ratio = torch.cat([GSPO_LOG_RATIO, torch.tensor([[0.05, -0.05, 0.1, 7.0]])])
    mask = torch.cat([GSPO_MASK, torch.tensor([[1, 1, 1, 0]])])
    old = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    adv_rows = torch.tensor([1.0, 2.0, -1.5])
    adv = adv_rows.unsqueeze(1).expand(3, 4)
    token_form = (old + log_ratio).requires_grad_(True)
    sequence_form = (old + log_ratio).requires_grad_(True)
    loss, _, _ = policy_loss(token_form, old, adv, mask, 0.2, clip_high,
                             aggregation="seq-mean-token-mean", ratio_level="sequence")
    reference = _sequence_objective(sequence_form, old, adv_rows, mask, 0.2, clip_high)
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(token_form.grad, sequence_form.grad)
    assert torch.all(token_form.grad[mask == 0] == 0)
    # Row 0: 0 when clipped, else -A * s / |y| / B = -1.2214028 / 9 per token.
    _close(token_form.grad[0, :3], [0.0 if clip_high == 0.2 else -S0 / 9.0] * 3)
    # Hand value for row 1 (A = 2, 3 tokens, 3 rows): -A * s / |y| / B = -2 * 0.9048374 / 9 per token.
    _close(token_form.grad[1, 0], -2.0 * S1 / 9.0)


def test_policy_loss_rejects_unknown_ratio_level() -> None:
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.2, ratio_level="seq")


def test_policy_loss_dr_grpo_aggregation() -> None:
    # ratio 1 everywhere: per-token loss -A; row sums -(1+2) and -(3) over normalizer 4, mean of 2 rows.
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _, _ = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), adv, mask, 0.2,
                             aggregation="seq-mean-token-sum-norm", normalizer=4.0)
    _close(loss, -(3.0 / 4.0 + 3.0 / 4.0) / 2.0)


LOG2 = math.log(2.0)


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        # log-ratios log 2, 0, -log 2 (and a padded 9): token mean over 3 tokens.
        ("k1", 0.0, [1 / 3, 1 / 3, 1 / 3, 0.0]),
        ("k2", 0.5 * (LOG2**2 + LOG2**2) / 3, [LOG2 / 3, 0.0, -LOG2 / 3, 0.0]),
        # k3 = exp(-x) - 1 + x: 0.5 - 1 + log 2 and 2 - 1 - log 2 sum to 0.5; grad 1 - exp(-x).
        ("k3", 0.5 / 3, [0.5 / 3, 0.0, -1.0 / 3, 0.0]),
    ],
)
def test_kl_loss_value_and_gradient(kind: str, value: float, grad: list) -> None:
    ref = torch.tensor([[0.3, -1.0, 0.2, 0.0]], requires_grad=True)
    logprobs = (ref.detach() + torch.tensor([[LOG2, 0.0, -LOG2, 9.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = kl_loss(logprobs, ref, mask, kind)
    _close(loss, value)
    loss.backward()
    _close(logprobs.grad, [grad])
    assert ref.grad is None  # the reference is a constant


def test_kl_loss_aggregation() -> None:
    logprobs = torch.tensor([[LOG2, LOG2, 0.0], [LOG2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # k1: row means log 2 and log 2 -> log 2; token mean is also log 2; sum-norm: (2 + 1) log 2 / 3 / 2.
    _close(kl_loss(logprobs, torch.zeros(2, 3), mask, "k1", "seq-mean-token-mean"), LOG2)
    _close(kl_loss(logprobs, torch.zeros(2, 3), mask, "k1", "seq-mean-token-sum-norm", 3.0), LOG2 / 2.0)
