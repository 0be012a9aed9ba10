"""Micro-batches without their all-padding columns (engine/micro_batches.py, Experience.trimmed):
the same log-probs, values and losses as the padded forward."""

from __future__ import annotations

import pytest
import torch

from rlhf.algorithms.ppo_math import policy_loss, value_loss
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.micro_batches import column_span, forward_in_micro_batches, length_sorted_micro_batches
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.prompt_sharing import response_logprobs
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, build_tiny_model
from rlhf.models.value_model import ValueModel
from rlhf.stages.experience import Experience
from tests.conftest import RAGGED_PROMPT as PROMPT
from tests.conftest import ragged_batch


def test_column_span_and_sorted_micro_batches() -> None:
    _, mask = ragged_batch()
    assert column_span(mask) == (0, 17)
    assert column_span(mask[3:4]) == (2, PROMPT + 1 + 15 % 14)  # prompt of 4 from column 2, response of 2
    batches = length_sorted_micro_batches(mask, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    lengths = mask.sum(-1)[torch.cat(batches)]
    assert torch.all(lengths[1:] >= lengths[:-1])
    assert sorted(torch.cat(batches).tolist()) == list(range(7))
    assert torch.equal(torch.cat(length_sorted_micro_batches(mask, 3, sort=False)), torch.arange(7))


@pytest.mark.parametrize("family", FAMILIES)
def test_trimmed_micro_batches_give_the_padded_forward(family: str) -> None:
    model = build_tiny_model(family, build_char_tokenizer(), seed=0).eval()
    sequences, mask = ragged_batch()
    actions = mask.clone()
    actions[:, :PROMPT] = 0
    with torch.no_grad():
        plain, _ = causal_lm_logprobs(model, sequences, mask)
        trimmed = forward_in_micro_batches(
            lambda s, m, lo: response_logprobs(model, s, m, PROMPT - lo)[0], sequences, mask, size=3)
    scored = actions[:, 1:].bool()
    assert trimmed.shape == plain.shape
    torch.testing.assert_close(trimmed[scored], plain[scored], atol=1e-5, rtol=1e-5)


def test_trimmed_values_and_losses_equal_the_padded_ones() -> None:
    torch.manual_seed(0)
    critic = ValueModel(build_tiny_model("llama", build_char_tokenizer(), seed=1).model, head_init_std=0.1).eval()
    actor = build_tiny_model("llama", build_char_tokenizer(), seed=0).train()
    sequences, mask = ragged_batch()
    actions = mask.clone().bool()
    actions[:, :PROMPT] = False

    def values(s: torch.Tensor, m: torch.Tensor, lo: int = 0) -> torch.Tensor:
        return critic(s, m, position_ids=position_ids_from_mask(m))

    with torch.no_grad():
        plain_values = values(sequences, mask)
        trimmed_values = forward_in_micro_batches(values, sequences, mask, size=2)
    torch.testing.assert_close(trimmed_values[mask.bool()], plain_values[mask.bool()], atol=1e-5, rtol=1e-5)

    shifted = actions[:, 1:]
    gen = torch.Generator().manual_seed(1)
    noise = lambda: torch.randn(shifted.shape, generator=gen)  # noqa: E731
    exp = Experience(sequences, mask, shifted, noise() - 4, noise() - 4, noise(), noise(), noise(), noise(),
                     torch.zeros(len(sequences)), noise())

    def losses(e: Experience) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        actor.zero_grad()
        logprobs, _ = causal_lm_logprobs(actor, e.sequences, e.attention_mask)
        p_loss, _, _ = policy_loss(logprobs, e.old_logprobs, e.advantages, e.action_mask, 0.2, 0.2)
        v_loss, _ = value_loss(e.old_values + 0.1, e.old_values, e.returns, e.action_mask, 0.2)
        p_loss.backward()
        return p_loss.detach(), v_loss.detach(), [p.grad.clone() for p in actor.parameters()]

    part = exp.select(torch.tensor([3, 0, 1]))
    short = part.trimmed()
    assert short.sequences.shape[1] < part.sequences.shape[1]
    (p_full, v_full, g_full), (p_short, v_short, g_short) = losses(part), losses(short)
    torch.testing.assert_close(p_short, p_full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v_short, v_full, atol=1e-6, rtol=1e-5)
    for a, b in zip(g_short, g_full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_token_budget_micro_batches() -> None:
    _, mask = ragged_batch()
    from rlhf.engine.micro_batches import padded_tokens, token_budget_micro_batches

    parts = token_budget_micro_batches(mask, budget=40)
    assert sorted(torch.cat(parts).tolist()) == list(range(7))
    for rows in parts:  # within the budget, unless a single row is longer than it
        assert padded_tokens(mask[rows]) <= 40 or len(rows) == 1
    lengths = [mask[rows].sum(-1) for rows in parts]  # longest first, similar lengths together
    assert all(a.min() >= b.max() for a, b in zip(lengths, lengths[1:]))
    assert len(token_budget_micro_batches(mask, budget=10**6)) == 1
    assert len(token_budget_micro_batches(mask, budget=10**6, at_least=3)) == 3  # another rank needs 3
    assert [len(p) for p in token_budget_micro_batches(mask, budget=1)] == [1] * 7


def test_weighted_micro_batches_give_the_whole_minibatch_gradient() -> None:
    """Token-mean policy loss and value loss over a ragged minibatch, cut into length-sorted
    micro-batches and weighted by `micro_batch_weights` (then averaged, as the engine does): the
    gradient of one micro-batch holding everything; the plain mean of micro-batch means is not."""
    from rlhf.engine.micro_batches import micro_batch_weights, token_budget_micro_batches

    actor = build_tiny_model("llama", build_char_tokenizer(), seed=0).train()
    sequences, mask = ragged_batch()
    actions = mask.clone().bool()
    actions[:, :PROMPT] = False
    shifted = actions[:, 1:]
    gen = torch.Generator().manual_seed(1)
    old, advantages = torch.randn(shifted.shape, generator=gen) - 4, torch.randn(shifted.shape, generator=gen)

    def grads(parts: list[torch.Tensor], weights: list[float]) -> list[torch.Tensor]:
        actor.zero_grad()
        for rows, weight in zip(parts, weights):
            logprobs, _ = causal_lm_logprobs(actor, sequences[rows], mask[rows])
            loss, _, _ = policy_loss(logprobs, old[rows], advantages[rows], shifted[rows], 0.2, 0.2)
            (weight * loss / len(parts)).backward()
        return [p.grad.clone() for p in actor.parameters()]

    whole = grads([torch.arange(7)], [1.0])
    parts = token_budget_micro_batches(mask, budget=40)
    assert len(parts) >= 3
    tokens = [float(shifted[rows].sum()) for rows in parts]
    weighted = grads(parts, micro_batch_weights(tokens, sum(tokens), world_size=1))
    for a, b in zip(weighted, whole):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    unweighted = grads(parts, [1.0] * len(parts))
    assert not all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(unweighted, whole))
