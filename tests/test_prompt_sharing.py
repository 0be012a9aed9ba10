"""Shared-prompt forwards: each group's prompt runs once, and the log-probs, entropies and
gradients equal the plain forward's over the whole rows (every tiny family, tied embeddings,
left padding, a padded response token)."""

from __future__ import annotations

import pytest
import torch

from rlhf.engine.fsdp import enable_activation_checkpointing
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.logprobs import entropy_from_logits_chunked
from rlhf.engine.prompt_sharing import prompt_groups, response_logprobs, response_prefix, shared_prompt_logprobs
from rlhf.models.loading import load_causal_lm
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, build_tiny_model

PROMPT, RESPONSE = 5, 4


def grouped_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts (the first left-padded by 2) x 2 samples each, one response with a pad at its end."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 50, (3, PROMPT), generator=gen)
    prompt_mask = torch.ones(3, PROMPT, dtype=torch.long)
    prompts[0, :2], prompt_mask[0, :2] = 0, 0
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    sequences = torch.cat([prompts[rows], torch.randint(3, 50, (6, RESPONSE), generator=gen)], dim=1)
    mask = torch.cat([prompt_mask[rows], torch.ones(6, RESPONSE, dtype=torch.long)], dim=1)
    mask[1, -1] = 0
    return sequences, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2", "opt"])
@pytest.mark.usefixtures("one_thread")
def test_shared_prompt_matches_the_plain_forward(tiny_model_dirs, family):
    model = load_causal_lm(str(tiny_model_dirs[family])).float()
    sequences, mask = grouped_batch()
    response = slice(PROMPT - 1, None)  # the positions that score response tokens

    plain, logits = causal_lm_logprobs(model, sequences, mask)
    plain_entropy = entropy_from_logits_chunked(logits[:, :-1])
    (plain[:, response].sum() + plain_entropy[:, response].sum()).backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    shared, entropy = shared_prompt_logprobs(model, sequences, mask, PROMPT, with_entropy=True)
    (shared[:, response].sum() + entropy[:, response].sum()).backward()
    torch.testing.assert_close(shared[:, response], plain[:, response], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[:, response], plain_entropy[:, response], atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


def test_groups_and_prefix() -> None:
    sequences, mask = grouped_batch()
    unique, unique_mask, inverse = prompt_groups(sequences, mask, PROMPT)
    assert unique.shape == (3, PROMPT) and unique_mask.shape == (3, PROMPT)
    assert torch.equal(unique[inverse], sequences[:, :PROMPT])
    assert prompt_groups(sequences[::2], mask[::2], PROMPT) is None  # no two rows share a prompt
    action = torch.zeros(2, 6, dtype=torch.bool)
    action[0, 3:], action[1, 4:] = True, True
    assert response_prefix(action) == 3


@pytest.mark.usefixtures("one_thread")
def test_rows_without_a_shared_prompt_take_the_plain_forward(tiny_model_dirs):
    model = load_causal_lm(str(tiny_model_dirs["llama"])).float()
    sequences, mask = grouped_batch()
    with torch.no_grad():
        shared, entropy = shared_prompt_logprobs(model, sequences[::2], mask[::2], PROMPT)
        plain, _ = causal_lm_logprobs(model, sequences[::2], mask[::2])
    assert entropy is None
    # The LM head runs only where a response token is scored: those positions are bit-equal, the
    # prompt's are 0.
    assert torch.equal(shared[:, PROMPT - 1 :], plain[:, PROMPT - 1 :])
    assert (shared[:, : PROMPT - 1] == 0).all()


@pytest.mark.usefixtures("one_thread")
def test_activation_checkpointing_takes_the_plain_forward(tiny_model_dirs):
    """transformers' checkpointed layers drop past_key_values in training: sharing must not run there."""
    model = load_causal_lm(str(tiny_model_dirs["llama"])).float()
    enable_activation_checkpointing(model)
    model.train()
    sequences, mask = grouped_batch()
    shared, _ = shared_prompt_logprobs(model, sequences, mask, PROMPT)
    plain, _ = causal_lm_logprobs(model, sequences, mask)
    torch.testing.assert_close(shared[:, PROMPT - 1 :], plain[:, PROMPT - 1 :])


@pytest.mark.parametrize("family", FAMILIES)
def test_response_logprobs_run_the_head_only_where_responses_are_scored(family):
    """Every family (logits_to_keep, or full logits sliced where the forward lacks it): the
    response positions' log-probs and entropies are the full forward's, the prompt's are 0."""
    model = build_tiny_model(family, build_char_tokenizer(), seed=0).eval()
    sequences, mask = grouped_batch()
    with torch.no_grad():
        logprobs, entropy = response_logprobs(model, sequences, mask, PROMPT, with_entropy=True)
        plain, logits = causal_lm_logprobs(model, sequences, mask)
    torch.testing.assert_close(logprobs[:, PROMPT - 1 :], plain[:, PROMPT - 1 :])
    torch.testing.assert_close(entropy[:, PROMPT - 1 :], entropy_from_logits_chunked(logits[:, :-1])[:, PROMPT - 1 :])
    assert (logprobs[:, : PROMPT - 1] == 0).all() and (entropy[:, : PROMPT - 1] == 0).all()
