"""Critic-free advantage estimators and DAPO reward shaping against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rlhf.algorithms.advantages import (
    discounted_returns,
    group_baseline_scores,
    overlong_penalty,
    varied_groups,
    whitens_advantages,
)
from rlhf.algorithms.estimators import ESTIMATORS

# Three groups of 4: mean 0.5 (unbiased std 1/sqrt(3)), mean 1.5 (unbiased std 1), all tied.
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def _close(actual: torch.Tensor, expected: list, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=rtol, atol=atol)


def test_grpo_normalises_by_the_unbiased_group_std() -> None:
    # Group 0: (r - 0.5) / sqrt(1/3) = +-0.5 * sqrt(3) = +-0.8660254; group 1: (r - 1.5) / 1.
    h = 0.8660254
    expected = [h, -h, -h, h, 1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    _close(group_baseline_scores(SCORES, 4, "grpo", eps=0.0), expected)
    _close(group_baseline_scores(SCORES, 4, "grpo"), expected)  # eps 1e-6 moves it by ~1e-6 relative
    _close(group_baseline_scores(torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0]), 4, "grpo", eps=0.0),
           [h, -h, -h, h, h, h, -h, -h])


def test_grpo_tied_group_is_exactly_zero() -> None:
    # 0.1 * 3 has rounding error in float32; a tie must still give 0, not rounding / eps.
    out = group_baseline_scores(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), 3, "grpo")
    assert torch.equal(out, torch.zeros(6))


def test_dr_grpo_and_reinforce_pp_baseline_subtract_the_group_mean() -> None:
    expected = [0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    _close(group_baseline_scores(SCORES, 4, "dr_grpo"), expected)
    _close(group_baseline_scores(SCORES, 4, "reinforce_pp_baseline"), expected)


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    # Group 1: 3 - mean(1, 1, 1) = 2; 1 - mean(3, 1, 1) = -2/3.
    t = 2.0 / 3.0
    expected = [t, -t, -t, t, 2.0, -t, -t, -t, 0.0, 0.0, 0.0, 0.0]
    _close(group_baseline_scores(SCORES, 4, "rloo"), expected)


def test_rloo_matches_an_explicit_leave_one_out_loop() -> None:
    scores = torch.randn(15, generator=torch.Generator().manual_seed(0))
    n = 5
    expected = []
    for i in range(scores.numel()):
        start = (i // n) * n
        others = [float(scores[j]) for j in range(start, start + n) if j != i]
        expected.append(float(scores[i]) - sum(others) / len(others))
    _close(group_baseline_scores(scores, n, "rloo"), expected)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_ungrouped_estimators_leave_scores_unchanged(estimator: str) -> None:
    out = group_baseline_scores(SCORES, 4, estimator)
    assert out.dtype == torch.float32
    assert torch.equal(out, SCORES)
    assert torch.equal(group_baseline_scores(SCORES, 1, estimator), SCORES)


def test_group_baseline_rejects_bad_shapes_and_names() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_baseline_scores(SCORES[:7], 4, "reinforce_pp")
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="group size >= 2"):
            group_baseline_scores(SCORES, 1, estimator)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_baseline_scores(SCORES, 4, "ppo")


def test_varied_groups_marks_groups_that_do_not_all_tie() -> None:
    assert varied_groups(SCORES, 4).tolist() == [True, True, False]
    assert varied_groups(torch.tensor([1.0, 1.0]), 2).tolist() == [False]
    with pytest.raises(ValueError):
        varied_groups(SCORES, 5)


REWARDS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [0.0, 1.0, 0.0, 4.0]])
# Row 0 right-padded (its padding reward 100 must be ignored); row 1 has a hole at t = 1.
RETURN_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])


def test_discounted_returns_gamma_one_skips_masked_positions() -> None:
    # Row 0: 3, 2 + 3, 1 + 5. Row 1: 4, 0 + 4, (hole), 0 + 4.
    _close(discounted_returns(REWARDS, RETURN_MASK, 1.0), [[6.0, 5.0, 3.0, 0.0], [4.0, 0.0, 4.0, 4.0]])


def test_discounted_returns_gamma_half() -> None:
    # Row 0: 3, 2 + 1.5, 1 + 1.75. Row 1: 4, 0 + 2, (hole: skipped, no extra discount), 0 + 1.
    _close(discounted_returns(REWARDS, RETURN_MASK, 0.5), [[2.75, 3.5, 3.0, 0.0], [1.0, 0.0, 2.0, 4.0]])


def test_discounted_returns_spread_the_score_and_later_kl_penalties() -> None:
    # KL penalties -0.1, -0.2, -0.3 and the score 2 on the last token: every token gets the score.
    rewards = torch.tensor([[-0.1, -0.2, 1.7, 0.0]])
    _close(discounted_returns(rewards, torch.tensor([[1, 1, 1, 0]]), 1.0), [[1.4, 1.5, 1.7, 0.0]])


def test_overlong_penalty_on_each_segment() -> None:
    # max 20, buffer 4: no penalty up to 16, a ramp over 17..20, -penalty beyond 20.
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    _close(overlong_penalty(lengths, 20, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    _close(overlong_penalty(lengths, 20, 4, 2.0), [0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    out = overlong_penalty(lengths, 20, 0, 1.0)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(6))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 21, 1.0)


def test_whitens_advantages_table() -> None:
    table = {estimator: whitens_advantages(estimator) for estimator in ESTIMATORS}
    assert table == {"gae": True, "reinforce_pp": True, "reinforce_pp_baseline": True,
                     "grpo": False, "dr_grpo": False, "rloo": False}
    with pytest.raises(ValueError):
        whitens_advantages("nope")
