"""Model FLOPs (engine/flops.py): hand-counted on a tiny shape, read from each family's config,
and counted per phase by `rlhf ppo`'s metrics."""

from __future__ import annotations

import pytest

from rlhf.engine.flops import (
    TransformerShape, decode_flops, forward_flops, generation_flops, prefill_flops, training_flops,
)
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, tiny_config
from rlhf.stages.throughput import IterationModels, IterationWork, iteration_flops

# 1 layer, hidden 4, 2 query heads of 2, 1 kv head, MLP 8 (gated), vocab 10.
SHAPE = TransformerShape(layers=1, hidden=4, q_dim=4, kv_dim=2, intermediate=8, gated_mlp=True, vocab=10)
LINEAR = 2 * (4 * 4 + 4 * 2 + 4 * 2 + 4 * 4 + 3 * 4 * 8)  # q, k, v, o, gate/up/down: 2 FLOPs per multiply-add
HEAD = 2 * 4 * 10


def test_hand_counted_forward() -> None:
    assert SHAPE.layer_linear_flops == LINEAR == 288
    # One row of 2 prompt + 1 response tokens: 3 tokens through the linears, causal pairs
    # 1 + 2 + 3 = 6 (4 * q_dim FLOPs each: QK^T and AV), one logit position (the one that scores
    # the response token).
    assert forward_flops(SHAPE, [2], [1]) == 3 * LINEAR + 4 * 4 * 6 + HEAD
    # A value head is 1 wide.
    assert forward_flops(SHAPE, [2], [1], "value") == 3 * LINEAR + 4 * 4 * 6 + 2 * 4
    assert training_flops(100) == 300


def test_padding_is_not_counted_and_shared_prompts_run_once() -> None:
    rows = forward_flops(SHAPE, [2, 5], [3, 1])
    assert rows == forward_flops(SHAPE, [2], [3]) + forward_flops(SHAPE, [5], [1])
    # A group of 2 rows sharing a 3-token prompt: the prompt's tokens and their pairs once.
    shared = forward_flops(SHAPE, [3, 3], [2, 4], shared_prompt_rows=2)
    prompt = 3 * LINEAR + 4 * 4 * 6
    assert shared == forward_flops(SHAPE, [3, 3], [2, 4]) - prompt


def test_generation_counts_prefill_once_per_group_and_one_step_per_fed_token() -> None:
    # Prompt of 2: prefill = 2 tokens, pairs 1 + 2, one head. Response of 3 tokens: tokens 1 and 2
    # are fed back (the last is not), at positions 2 and 3: pairs 3 + 4, two heads.
    assert prefill_flops(SHAPE, [2]) == 2 * LINEAR + 4 * 4 * 3 + HEAD
    assert decode_flops(SHAPE, [2], [3]) == 2 * LINEAR + 4 * 4 * 7 + 2 * HEAD
    assert generation_flops(SHAPE, [2, 2], [3, 3], samples_per_prompt=2) == (
        prefill_flops(SHAPE, [2]) + 2 * decode_flops(SHAPE, [2], [3]))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_config_is_read(family: str) -> None:
    config = tiny_config(family, len(build_char_tokenizer()))
    shape = TransformerShape.from_config(config)
    assert shape.layers >= 1 and shape.hidden >= 1 and shape.vocab == config.vocab_size
    assert shape.kv_dim <= shape.q_dim
    assert shape.gated_mlp == (family not in ("gpt2", "opt"))


def test_iteration_phases() -> None:
    models = IterationModels(actor=SHAPE, critic=SHAPE, reward=SHAPE)
    work = IterationWork(samples_per_prompt=1, shared_prompt=False, old_logprob_forward=True, ppo_epochs=2)
    flops = iteration_flops(models, work, [2, 3], [1, 4])
    actor = forward_flops(SHAPE, [2, 3], [1, 4])
    critic = forward_flops(SHAPE, [2, 3], [1, 4], "value")
    assert flops["experience"] == 2 * actor + critic  # reference, old log-probs, values
    assert flops["training"] == 2 * 3 * (actor + critic)
    assert flops["reward"] == critic
    assert flops["prefill"] + flops["decode"] == generation_flops(SHAPE, [2, 3], [1, 4])
    no_old = iteration_flops(models, IterationWork(1, False, False, 2), [2, 3], [1, 4])
    assert no_old["experience"] == actor + critic
