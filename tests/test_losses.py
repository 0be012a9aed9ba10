"""SFT and pairwise reward losses against hand-computed numbers and reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.losses import IGNORE_INDEX, pairwise_reward_loss, sft_loss, sft_loss_sum


def test_sft_loss_hand_numbers_with_shift() -> None:
    # V = 2. Position 0 predicts labels[1] = 1 with p = 0.5; position 1 predicts labels[2] = 0
    # with p = 0.75; position 2 predicts nothing (last), labels[0] is never a target.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [50.0, -50.0]]])
    labels = torch.tensor([[1, 1, 0]])
    loss, n = sft_loss(logits, labels)
    assert n.item() == 2 and n.dtype == torch.int64
    assert loss.item() == pytest.approx((math.log(2.0) - math.log(0.75)) / 2)
    loss_sum, n_sum = sft_loss_sum(logits, labels)
    assert loss_sum.item() == pytest.approx(math.log(2.0) - math.log(0.75))
    assert n_sum.item() == 2
    # Ignoring the second target leaves only the first token.
    loss, n = sft_loss(logits, torch.tensor([[1, 1, IGNORE_INDEX]]))
    assert (loss.item(), n.item()) == (pytest.approx(math.log(2.0)), 1)


def test_sft_loss_matches_reference_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 6), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # prompt
    labels[2, 4:] = IGNORE_INDEX  # padding
    total, count = 0.0, 0
    for b in range(3):
        for t in range(5):
            target = int(labels[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            row = logits[b, t].tolist()
            total += math.log(sum(math.exp(v) for v in row)) - row[target]
            count += 1
    loss, n = sft_loss(logits, labels)
    assert n.item() == count
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    # bf16 logits are upcast before the cross entropy.
    assert sft_loss(logits.bfloat16(), labels)[0].dtype == torch.float32


def test_sft_loss_sum_gives_token_weighted_accumulation() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[1, 2:] = IGNORE_INDEX  # micro-batch 2 has 1 target, micro-batch 1 has 4
    full, _ = sft_loss(logits, labels)
    sums = [sft_loss_sum(logits[i : i + 1], labels[i : i + 1]) for i in range(2)]
    accumulated = sum(s for s, _ in sums) / sum(n for _, n in sums)
    assert accumulated.item() == pytest.approx(full.item(), rel=1e-6)
    mean_of_means = sum(sft_loss(logits[i : i + 1], labels[i : i + 1])[0] for i in range(2)) / 2
    assert mean_of_means.item() != pytest.approx(full.item(), rel=1e-3)


def test_sft_loss_without_targets_is_zero_not_nan() -> None:
    logits = torch.randn(1, 4, 5, requires_grad=True)
    loss, n = sft_loss(logits, torch.full((1, 4), IGNORE_INDEX))
    loss.backward()
    assert (loss.item(), n.item()) == (0.0, 0)
    assert logits.grad is not None and logits.grad.abs().sum().item() == 0.0


def test_pairwise_reward_loss_hand_numbers() -> None:
    chosen = torch.tensor([2.0, 0.0, 1.0])
    rejected = torch.tensor([0.0, 0.0, 3.0])
    loss, acc = pairwise_reward_loss(chosen, rejected)
    # -log sigmoid(d) = log(1 + e^{-d}) for d = 2, 0, -2
    expected = (math.log1p(math.exp(-2.0)) + math.log(2.0) + math.log1p(math.exp(2.0))) / 3
    assert loss.item() == pytest.approx(expected)
    assert acc.item() == pytest.approx(1 / 3)  # a tie is not a win


def test_pairwise_reward_loss_margin_and_extremes() -> None:
    chosen, rejected = torch.tensor([2.0, 1.0]), torch.tensor([0.0, 0.0])
    loss, acc = pairwise_reward_loss(chosen, rejected, margin=torch.tensor([2.0, 0.0]))
    assert loss.item() == pytest.approx((math.log(2.0) + math.log1p(math.exp(-1.0))) / 2)
    assert acc.item() == 1.0
    loss_f, _ = pairwise_reward_loss(chosen, rejected, margin=1.0)
    assert loss_f.item() == pytest.approx((math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2)
    # A huge wrong-way gap stays finite (logsigmoid, not log(sigmoid)).
    huge, _ = pairwise_reward_loss(torch.tensor([-1000.0]), torch.tensor([1000.0]))
    assert huge.item() == pytest.approx(2000.0)


def test_pairwise_reward_loss_gradient() -> None:
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    loss, _ = pairwise_reward_loss(chosen, rejected)
    loss.backward()
    # d/dc -log sigmoid(c - r) = -(1 - sigmoid(0)) = -0.5
    assert chosen.grad is not None and rejected.grad is not None
    assert (chosen.grad.item(), rejected.grad.item()) == (pytest.approx(-0.5), pytest.approx(0.5))
