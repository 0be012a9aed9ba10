"""PPO math against hand-computed numbers and plain Python reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    compute_token_rewards,
    explained_variance,
    gae_advantages,
    masked_columns,
    kl_estimate,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)
from rlhf.engine.logprobs import entropy_from_logits_chunked
from rlhf.engine.positions import last_token_index

# Three rows of different lengths: right padding, left padding, and a hole in the middle.
MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0]])


def _masked_items(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]


def _close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def _random(seed: int, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- masked statistics


def test_masked_mean_hand_numbers() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])
    # Empty mask (or an empty row) gives 0, not NaN.
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    assert masked_mean(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=1).tolist() == [1.0, 0.0]


def test_masked_var_matches_reference() -> None:
    x = _random(0)
    items = _masked_items(x, MASK)
    n, mean = len(items), sum(items) / len(items)
    biased = sum((v - mean) ** 2 for v in items) / n
    assert masked_var(x, MASK, unbiased=False).item() == pytest.approx(biased, rel=1e-5)
    assert masked_var(x, MASK, unbiased=True).item() == pytest.approx(biased * n / (n - 1), rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.tensor([[1, 0, 0, 0, 0], [0] * 5, [0] * 5]), unbiased=True)


def test_masked_whiten() -> None:
    x = _random(1) * 3.0 + 2.0
    x = x.masked_fill(MASK == 0, 1e6)  # padding values must not affect the statistics
    items = _masked_items(x, MASK)
    n, mean = len(items), sum(items) / len(items)
    std = math.sqrt(sum((v - mean) ** 2 for v in items) / (n - 1))
    whitened = masked_whiten(x, MASK, shift_mean=True)
    expected = [(v - mean) / std for v in items]
    assert _masked_items(whitened, MASK) == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert whitened[MASK == 0].abs().max().item() == 0.0
    kept_mean = masked_whiten(x, MASK, shift_mean=False)
    assert _masked_items(kept_mean, MASK) == pytest.approx([e + mean for e in expected], rel=1e-4)


def test_masked_whiten_hand_numbers() -> None:
    # Masked [1, 2, 3]: mean 2, unbiased variance (1 + 0 + 1) / 2 = 1; the padded 100 is ignored.
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    _close(masked_whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]])
    _close(masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])
    # [0, 4]: mean 2, unbiased variance (4 + 4) / 1 = 8, so +-2 / sqrt(8) = +-1 / sqrt(2).
    _close(masked_whiten(torch.tensor([[0.0, 4.0]]), torch.ones(1, 2)), [[-math.sqrt(0.5), math.sqrt(0.5)]])
    # One masked position has no variance: it whitens to 0 rather than failing the run.
    _close(masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[0, 1]])), [[0.0, 0.0]])
    assert masked_whiten(torch.randn(2, 3, dtype=torch.bfloat16), torch.ones(2, 3)).dtype == torch.float32


def test_masked_whiten_two_ranks_equal_one_rank_on_the_concatenation() -> None:
    """A fake 2-rank all-reduce (two threads summing through a barrier) gives each rank's share
    of what one rank computes on the whole batch: N ranks equal one rank."""
    import threading

    x = _random(6, (6, 5)) * 4.0 + 1.0
    mask = torch.cat([MASK, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 0], [1, 1, 0, 0, 0]])])
    whole = masked_whiten(x, mask)
    shares = [(x[:2], mask[:2]), (x[2:], mask[2:])]  # unequal token counts per rank
    deposited: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2)
    results: list[torch.Tensor | None] = [None, None]

    def rank(r: int) -> None:
        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            deposited[r] = t.clone()
            barrier.wait()
            total = deposited[0] + deposited[1]
            barrier.wait()
            return total

        results[r] = masked_whiten(*shares[r], all_reduce=all_reduce_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([results[0], results[1]]), whole, rtol=1e-6, atol=1e-6)
    # and each rank alone (no reducer) would NOT match: the reducer is what makes them agree
    assert not torch.allclose(masked_whiten(*shares[0]), whole[:2], atol=1e-3)


# ---------------------------------------------------------------------------- KL and rewards


def test_kl_estimators_hand_numbers() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # log_ratio = [0.5, -1.0]
    _close(kl_estimate(logprobs, ref, "k1"), [[0.5, -1.0]])
    _close(kl_estimate(logprobs, ref, "k2"), [[0.125, 0.5]])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    _close(kl_estimate(logprobs, ref, "k3"), [k3])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logprobs, ref, "k4")  # type: ignore[arg-type]


def test_last_token_index_any_padding() -> None:
    assert last_token_index(MASK).tolist() == [2, 4, 3]
    assert last_token_index(torch.tensor([[True, False], [True, True]])).tolist() == [0, 1]
    with pytest.raises(ValueError, match="1 row"):
        last_token_index(torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_compute_token_rewards_reference_loop(kind: str) -> None:
    logprobs, ref = _random(2) - 1.0, _random(3) - 1.0
    score = torch.tensor([3.0, -7.0, 0.25])
    kl_coef, clip = 0.1, 5.0
    rewards, kl = compute_token_rewards(score, logprobs, ref, MASK, kl_coef, kind, reward_clip=clip)
    for b in range(3):
        last = max(t for t in range(5) if MASK[b, t])
        s = min(max(score[b].item(), -clip), clip)
        for t in range(5):
            lr = logprobs[b, t].item() - ref[b, t].item()
            k = {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) - 1 + lr}[kind]
            k = k if MASK[b, t] else 0.0
            expected = -kl_coef * k + (s if t == last else 0.0)
            assert kl[b, t].item() == pytest.approx(k, rel=1e-5, abs=1e-6)
            assert rewards[b, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_compute_token_rewards_hand_numbers_no_clip() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.5, -1.0], [-1.0, -3.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    rewards, kl = compute_token_rewards(torch.tensor([10.0, -10.0]), logprobs, ref, mask, kl_coef=0.5)
    _close(kl, [[1.0, 0.5, 0.0], [0.0, 2.0, 8.0]])
    _close(rewards, [[-0.5, -0.25 + 10.0, 0.0], [0.0, -1.0, -4.0 - 10.0]])


# ---------------------------------------------------------------------------- GAE


def _gae_reference(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE over one unpadded sequence; the episode ends after the last token."""
    n = len(rewards)
    advantages = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.0, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_per_sequence(gamma: float, lam: float) -> None:
    rewards, values = _random(4), _random(5)
    # Garbage in padding must change nothing: no bootstrapping past the last response token.
    rewards = rewards.masked_fill(MASK == 0, 50.0)
    values = values.masked_fill(MASK == 0, -80.0)
    advantages, returns = gae_advantages(rewards, values, MASK, gamma, lam)
    for b in range(3):
        idx = [t for t in range(5) if MASK[b, t]]
        ref_adv, ref_ret = _gae_reference([rewards[b, t].item() for t in idx], [values[b, t].item() for t in idx], gamma, lam)
        assert [advantages[b, t].item() for t in idx] == pytest.approx(ref_adv, rel=1e-5, abs=1e-5)
        assert [returns[b, t].item() for t in idx] == pytest.approx(ref_ret, rel=1e-5, abs=1e-5)
    assert advantages[MASK == 0].abs().max().item() == 0.0
    assert returns[MASK == 0].abs().max().item() == 0.0


def test_gae_edge_cases_hand_numbers() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.25, 0.75, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma = lam = 1: advantage = sum of future rewards - V_t (Monte Carlo), return = 1 everywhere.
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    _close(adv, [[0.5, 0.75, 0.25, 0.0]])
    _close(ret, [[1.0, 1.0, 1.0, 0.0]])
    # gamma = 0: advantage = r_t - V_t, return = r_t.
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.0, lam=0.95)
    _close(adv, [[-0.5, -0.25, 0.25, 0.0]])
    _close(ret, [[0.0, 0.0, 1.0, 0.0]])
    # lam = 0: one-step TD error r_t + gamma * V_{t+1} - V_t, V after the last token = 0.
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    _close(adv, [[0.125 - 0.5, 0.375 - 0.25, 1.0 - 0.75, 0.0]])


# ---------------------------------------------------------------------------- losses


def test_policy_loss_hand_numbers() -> None:
    # ratios e^{log 1.5}=1.5, 1.0, 0.5, and a padded token with a huge ratio.
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 0.5, 100.0]]))
    old = torch.zeros(1, 4)
    advantages = torch.tensor([[2.0, -1.0, -3.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac, approx_kl = policy_loss(logprobs, old, advantages, mask, clip_range=0.2)
    # token 0: max(-3.0, -2*1.2=-2.4) = -2.4 (clipped); token 1: 1.0; token 2: max(1.5, 3*0.8=2.4) = 2.4 (clipped)
    assert loss.item() == pytest.approx((-2.4 + 1.0 + 2.4) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)
    lr = [math.log(1.5), 0.0, math.log(0.5)]
    assert approx_kl.item() == pytest.approx(sum(0.5 * v * v for v in lr) / 3, rel=1e-5)


def test_policy_loss_gradient_vanishes_when_clipped() -> None:
    logprobs = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    loss, _, _ = policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    assert logprobs.grad is not None
    # token 0 is clipped (ratio 1.5 > 1.2, A > 0): no gradient; token 1: d(-ratio)/dlogp / 2 = -1.1 / 2.
    _close(logprobs.grad, [[0.0, -0.55]])


def test_value_loss_hand_numbers() -> None:
    values = torch.tensor([[1.0, 0.0, 2.0, 7.0]])
    old = torch.tensor([[0.0, 0.0, 1.5, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = value_loss(values, old, returns, mask, clip_range_value=0.2)
    # token 0: clipped V = 0.2: max(1, 0.04) = 1; token 1: 1; token 2: clipped V = 1.7: max(1, 1.69) = 1.69
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 1.69) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)


def test_entropy_from_logits_hand_numbers() -> None:
    # The PPO stage's entropy is the chunked one (rlhf.engine.logprobs); the unchunked duplicate
    # that used to live in rlhf.algorithms.ppo_math is gone, and its hand-computed cases moved here.
    uniform = torch.zeros(2, 3, 7)
    _close(entropy_from_logits_chunked(uniform), [[math.log(7)] * 3] * 2)
    _close(entropy_from_logits_chunked(uniform, chunk_size=1), [[math.log(7)] * 3] * 2)
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits_chunked(logits).item() == pytest.approx(expected, rel=1e-6)
    # Huge and -inf logits stay finite: masked vocabulary entries contribute nothing, and the
    # large common offset does not cancel H away.
    big = torch.tensor([[1e4, 1e4, float("-inf"), -1e4]], requires_grad=True)
    entropy = entropy_from_logits_chunked(big)
    assert entropy.item() == pytest.approx(math.log(2), rel=1e-6)
    (grad,) = torch.autograd.grad(entropy.sum(), big)
    _close(grad, [[0.0, 0.0, 0.0, 0.0]])  # uniform over the two survivors: a stationary point
    assert entropy_from_logits_chunked(torch.randn(4, 9, dtype=torch.bfloat16)).dtype == torch.float32


def test_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    constant = torch.full_like(returns, 2.0)
    assert explained_variance(constant, returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    # residual [1, 1, 1] - variance 0; off by [0.5, -0.5, 0]: var 1/6 vs var(returns) 2/3.
    assert explained_variance(returns - 1.0, returns, mask).item() == pytest.approx(1.0)
    shifted = returns - torch.tensor([[0.5, -0.5, 0.0, 0.0]])
    assert explained_variance(shifted, returns, mask).item() == pytest.approx(1 - (1 / 6) / (2 / 3))
    assert math.isnan(explained_variance(returns, torch.ones(1, 4), mask).item())


# ---------------------------------------------------------------------------- KL controllers


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
    ctl.update(current_kl=0.0, n_steps=5000)  # error -1 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.99 * 0.9)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_gae_scans_only_the_response_columns_with_the_same_result() -> None:
    # A prompt span no row's mask holds, a hole inside one response, a trailing padded column:
    # the scan skips the outside columns (masked_columns) and gives the per-sequence reference.
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 0, 0]])
    assert masked_columns(mask.bool()) == range(2, 6)
    rewards, values = torch.randn(3, 7).masked_fill(mask == 0, 7.0), torch.randn(3, 7).masked_fill(mask == 0, -3.0)
    advantages, returns = gae_advantages(rewards, values, mask, 0.99, 0.95)
    for b in range(3):
        idx = [t for t in range(7) if mask[b, t]]
        ref_adv, ref_ret = _gae_reference([rewards[b, t].item() for t in idx], [values[b, t].item() for t in idx], 0.99, 0.95)
        assert [advantages[b, t].item() for t in idx] == pytest.approx(ref_adv, rel=1e-6, abs=1e-6)
        assert [returns[b, t].item() for t in idx] == pytest.approx(ref_ret, rel=1e-6, abs=1e-6)
    assert advantages[mask == 0].abs().max().item() == 0.0
    nothing = torch.zeros(2, 4, dtype=torch.bool)
    assert masked_columns(nothing) == range(0)
    assert gae_advantages(torch.ones(2, 4), torch.ones(2, 4), nothing, 1.0, 1.0)[0].abs().max().item() == 0.0
