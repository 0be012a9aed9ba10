"""The preference losses (rlhf/algorithms/preference.py) against values computed by hand.

Two pairs, beta 0.5. Pair 1: policy log-probs chosen -1, rejected -3; reference -2 and -2; so the
log-ratios are c = 1, r = -1, delta = 2 and beta x delta = 1; responses of 2 and 4 tokens. Pair 2:
policy -2 and -2.5, reference -2 and -2: c = 0, r = -0.5, delta = 0.5, beta x delta = 0.25; one
token each. Below, L(x) = -log sigmoid(x) = log(1 + e^-x): L(1) = 0.313262, L(-1) = 1.313262,
L(0.25) = 0.575939, L(-0.25) = 0.825939.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.algorithms.preference import PairLogps, preference_loss, preference_metric_sums

BETA = 0.5
POLICY = PairLogps(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -2.5]), torch.tensor([2, 1]), torch.tensor([4, 1]))
REFERENCE = PairLogps(torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), POLICY.chosen_tokens,
                      POLICY.rejected_tokens)
L1, L_1, L025, L_025 = 0.3132617, 1.3132617, 0.5759394, 0.8259394


def losses(loss_type: str, **kwargs: float) -> list[float]:
    return preference_loss(POLICY, REFERENCE, loss_type, BETA, **kwargs).losses.tolist()  # type: ignore[arg-type]


def test_sigmoid_is_dpo_and_label_smoothing_is_cdpo() -> None:
    assert losses("sigmoid") == pytest.approx([L1, L025], abs=1e-6)
    # cDPO, e = 0.1: 0.9 L(x) + 0.1 L(-x)
    assert losses("sigmoid", label_smoothing=0.1) == pytest.approx(
        [0.9 * L1 + 0.1 * L_1, 0.9 * L025 + 0.1 * L_025], abs=1e-6)
    assert losses("sigmoid", label_smoothing=0.1)[0] == pytest.approx(0.4132617, abs=1e-6)


def test_robust() -> None:
    # (0.9 L(x) - 0.1 L(-x)) / 0.8: pair 1 (0.2819355 - 0.1313262) / 0.8 = 0.1882617
    assert losses("robust", label_smoothing=0.1) == pytest.approx([0.1882617, (0.9 * L025 - 0.1 * L_025) / 0.8],
                                                                  abs=1e-6)
    assert losses("robust") == pytest.approx(losses("sigmoid"), abs=1e-7)  # e = 0: DPO


def test_hinge() -> None:
    assert losses("hinge") == pytest.approx([0.0, 0.75], abs=1e-7)  # max(0, 1 - 1), max(0, 1 - 0.25)


def test_ipo_uses_per_token_log_ratios() -> None:
    # Pair 1: 1/2 - (-1)/4 = 0.75, (0.75 - 1/(2 x 0.5))^2 = 0.0625; pair 2: 0 + 0.5 = 0.5, (0.5 - 1)^2 = 0.25.
    assert losses("ipo") == pytest.approx([0.0625, 0.25], abs=1e-7)


def test_apo_zero() -> None:
    # 1 - s(0.5 x 1) + s(0.5 x -1) = 1 - 0.6224593 + 0.3775407; pair 2: 1 - s(0) + s(-0.25) = 0.5 + 0.4378235
    assert losses("apo_zero") == pytest.approx([0.7550813, 0.9378235], abs=1e-6)


def test_simpo_is_length_normalised_and_reference_free() -> None:
    # Pair 1: averages -1/2 and -3/4, 0.5 x 0.25 - gamma 0.5 = -0.375, L(-0.375) = log(1 + e^0.375) = 0.898123;
    # pair 2: -2 and -2.5, 0.5 x 0.5 - 0.5 = -0.25, L(-0.25).
    result = preference_loss(POLICY, None, "simpo", BETA, simpo_gamma=0.5)
    assert result.losses.tolist() == pytest.approx([0.8981233, L_025], abs=1e-6)
    assert result.chosen_rewards.tolist() == pytest.approx([-0.25, -1.0])  # beta x average log-prob
    assert result.rejected_rewards.tolist() == pytest.approx([-0.375, -1.25])
    smoothed = preference_loss(POLICY, None, "simpo", BETA, label_smoothing=0.2, simpo_gamma=0.5)
    assert smoothed.losses[1].item() == pytest.approx(0.8 * L_025 + 0.2 * L025, abs=1e-6)  # 0.7759394
    with pytest.raises(ValueError, match="reference"):
        preference_loss(POLICY, None, "sigmoid", BETA)


def test_rewards_and_metrics_as_trl_logs_them() -> None:
    result = preference_loss(POLICY, REFERENCE, "sigmoid", BETA)
    assert result.chosen_rewards.tolist() == pytest.approx([0.5, 0.0])  # beta x c
    assert result.rejected_rewards.tolist() == pytest.approx([-0.5, -0.25])  # beta x r
    sums = preference_metric_sums(result, POLICY)
    assert sums == pytest.approx({"rewards/chosen": 0.5, "rewards/rejected": -0.75, "rewards/accuracies": 2.0,
                                  "rewards/margins": 1.25, "logps/chosen": -3.0, "logps/rejected": -5.5})


def test_gradient_of_dpo_pushes_chosen_up_and_rejected_down() -> None:
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -2.5], requires_grad=True)
    policy = PairLogps(chosen, rejected, POLICY.chosen_tokens, POLICY.rejected_tokens)
    preference_loss(policy, REFERENCE, "sigmoid", BETA).losses.sum().backward()
    # dL/dc = -beta x s(-beta delta): pair 1 -0.5 x 0.2689414, pair 2 -0.5 x 0.4378235
    assert chosen.grad.tolist() == pytest.approx([-0.1344707, -0.2189118], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.1344707, 0.2189118], abs=1e-6)


def test_rpo_adds_the_chosen_mean_token_nll() -> None:
    # alpha 0.5 x (-(-1) / 2, -(-2) / 1) = (0.25, 1.0) on top of DPO's loss
    result = preference_loss(POLICY, REFERENCE, "sigmoid", BETA, rpo_alpha=0.5)
    assert result.losses.tolist() == pytest.approx([L1 + 0.25, L025 + 1.0], abs=1e-6)
    assert result.chosen_rewards.tolist() == pytest.approx([0.5, 0.0])  # the rewards stay DPO's
