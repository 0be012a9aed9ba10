"""Packed (padding-free) forwards: log-probs equal the padded forward's at every scored real
token, for the families that pack (tied embeddings, GQA, left-padded prompts, responses of
different lengths ending in right padding), whatever the pack budget; the fused attention
kernels take the block-diagonal mask."""

from __future__ import annotations

import pytest
import torch

from rlhf.engine.backends.cpu import fused_layers
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.micro_batches import real_spans
from rlhf.engine.packing import pack_rows, packed_logprobs, packing_unsupported_reason
from rlhf.models.loading import load_causal_lm
from tests.conftest import RAGGED_PROMPT as PROMPT
from tests.conftest import ragged_batch


def grouped_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """`ragged_batch` whose rows 0-2 share row 0's prompt and rows 3-5 row 3's (sampled groups), row 6 alone."""
    sequences, mask = ragged_batch()
    groups = torch.tensor([0, 0, 0, 3, 3, 3, 6])
    sequences[:, :PROMPT], mask[:, :PROMPT] = sequences[groups, :PROMPT], mask[groups, :PROMPT]
    return sequences, mask


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def assert_grads(module: torch.nn.Module, want: list[torch.Tensor]) -> None:
    """Every parameter's gradient is `want`'s (the padded forward's) up to rounding."""
    for p, g in zip(module.parameters(), want, strict=True):
        # 3e-5: a gradient summed over a pack's tokens in another order (1.6e-5 seen on an AVX2-only CPU).
        torch.testing.assert_close(p.grad, g, atol=3e-5, rtol=1e-4)


def scored_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T-1]: position t scores real column t + 1 after a real token, in the response only."""
    scored = mask[:, 1:].bool() & mask[:, :-1].bool()
    scored[:, : PROMPT - 1] = False
    return scored


def padded_reference(model: torch.nn.Module, sequences: torch.Tensor, mask: torch.Tensor):
    """What packed forwards must reproduce: (scored positions, their loss weights, the padded
    forward's log-probs and entropies, the gradients of their weighted sum)."""
    from rlhf.engine.prompt_sharing import response_logprobs

    scored = scored_positions(mask)
    weights = torch.rand(scored.shape, generator=torch.Generator().manual_seed(3)) * scored
    padded, padded_entropy = response_logprobs(model, sequences, mask, PROMPT, with_entropy=True)
    ((padded * weights).sum() + (padded_entropy * weights).sum()).backward()
    want = grads(model)
    model.zero_grad()
    return scored, weights, padded.detach(), padded_entropy.detach(), want



@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("budget", [1, 20, 4096])
@pytest.mark.usefixtures("one_thread")
def test_packed_logprobs_match_the_padded_forward(tiny_model_dirs, family, budget):
    """Packs through the fused kernels against Hugging Face's padded forward; a model packs only
    where its attention is the fused kernels (which skip what the pack's mask hides)."""
    model = load_causal_lm(str(tiny_model_dirs[family])).float().eval()
    assert "fused" in packing_unsupported_reason(model)
    sequences, mask = ragged_batch()
    with torch.no_grad():
        padded = causal_lm_logprobs(model, sequences, mask)[0]
        assert fused_layers.fuse_layer_ops(model) > 0 and packing_unsupported_reason(model) is None
        packed = packed_logprobs(model, sequences, mask, PROMPT, budget)[0]
    scored = scored_positions(mask)
    assert int(scored.sum()) > 20
    torch.testing.assert_close(packed[scored], padded[scored], atol=2e-5, rtol=1e-5)
    assert not bool(packed[~scored].any())  # nothing written where nothing is scored


@pytest.mark.usefixtures("one_thread")
def test_packed_forward_runs_the_fused_attention_on_the_block_mask(tiny_model_dirs, monkeypatch):
    model = load_causal_lm(str(tiny_model_dirs["llama"])).float().eval()
    assert fused_layers.fuse_layer_ops(model) > 0
    calls: list[tuple[int, ...]] = []
    real = fused_layers._FusedAttention.apply
    monkeypatch.setattr(fused_layers._FusedAttention, "apply",
                        lambda q, k, v, m, *rest: calls.append(tuple(m.shape)) or real(q, k, v, m, *rest))
    sequences, mask = ragged_batch()
    with torch.no_grad():
        packed = packed_logprobs(model, sequences, mask, PROMPT, 4096)[0]
        padded = causal_lm_logprobs(model, sequences, mask)[0]
    total = int(mask.sum())
    assert calls[0] == (1, 1, total, total)  # one pack, real tokens only
    scored = scored_positions(mask)
    torch.testing.assert_close(packed[scored], padded[scored], atol=2e-5, rtol=1e-5)


def test_spans_and_packs() -> None:
    _, mask = ragged_batch()
    starts, lengths = real_spans(mask)
    assert lengths == mask.sum(1).tolist() and all(mask[r, s] == 1 for r, s in enumerate(starts))
    holes = mask.clone()
    holes[2, PROMPT] = 0  # a row with a hole is not one run
    assert real_spans(holes) is None
    packs = pack_rows([5, 9, 0, 3, 7, 12], budget=12)
    assert sorted(r for p in packs for r in p) == [0, 1, 3, 4, 5]  # the empty row is left out
    assert all(sum([5, 9, 0, 3, 7, 12][r] for r in p) <= 12 for p in packs)
    assert pack_rows([20], budget=8) == [[0]]  # a row over the budget is a pack of its own
    with pytest.raises(ValueError, match="budget"):
        pack_rows([1], budget=0)


def test_packed_micro_batches_hold_the_tokens_their_packs_run() -> None:
    """Cut by what the packed forwards run: a budget holds more rows than padded micro-batches, a
    sampled group's rows stay together and count their prompt once."""
    from rlhf.engine.micro_batches import token_budget_micro_batches
    from rlhf.engine.packing import packed_micro_batches, packed_tokens

    sequences, mask = ragged_batch()
    padded = token_budget_micro_batches(mask, budget=40)
    packed = packed_micro_batches(sequences, mask, budget=40)
    assert sorted(torch.cat(packed).tolist()) == list(range(7))
    assert len(packed) < len(padded)
    assert all(int(mask[rows].sum()) <= 40 or len(rows) == 1 for rows in packed)
    sequences, mask = grouped_batch()
    shared = packed_micro_batches(sequences, mask, budget=30, shared_prefix=PROMPT)  # groups of 19 and 24 tokens
    assert [sorted(rows.tolist()) for rows in shared] == [[3, 4, 5], [0, 1, 2, 6]]
    assert [packed_tokens(sequences[rows], mask[rows], PROMPT) for rows in shared] == [24, 23]


def test_families_that_do_not_pack(tiny_model_dirs) -> None:
    """Other families, and a model that computes off the CPU (offloaded weights on the CPU,
    activations on a GPU: SDPA would compute every pair of the pack's mask), keep padded forwards."""
    for family in ("gpt2", "opt"):
        reason = packing_unsupported_reason(load_causal_lm(str(tiny_model_dirs[family])))
        assert reason is not None and family in reason
    model = load_causal_lm(str(tiny_model_dirs["llama"])).float()
    fused_layers.fuse_layer_ops(model)
    assert packing_unsupported_reason(model, torch.device("cpu")) is None
    assert "cuda" in packing_unsupported_reason(model, torch.device("cuda"))


@pytest.fixture(scope="module")
def ctx(one_thread: None) -> DistributedContext:
    return DistributedContext.initialize()


def test_frozen_model_packs_where_that_runs_fewer_tokens(tiny_model_dirs, ctx, monkeypatch):
    """FrozenModel.logprobs with a token budget runs packed when the padded micro-batches (shared
    prompts counted once) would run more tokens, and gives the padded path's log-probs."""
    from rlhf.engine import inference

    model = load_causal_lm(str(tiny_model_dirs["qwen2"])).float()
    frozen = inference.FrozenModel(model, ctx, zero_stage=3, dtype="fp32", offload=False,
                                   micro_batch_size=64, name="ref")
    packed_calls: list[int] = []
    real = inference.packed_logprobs
    monkeypatch.setattr(inference, "packed_logprobs", lambda *a, **k: packed_calls.append(1) or real(*a, **k))
    # Groups of 2 sharing a prompt, responses of very different lengths: packing runs fewer tokens.
    sequences, mask = ragged_batch(rows=6, width=40)
    pairs = torch.tensor([0, 0, 2, 2, 4, 4])
    sequences[:, :PROMPT], mask[:, :PROMPT] = sequences[pairs, :PROMPT], mask[pairs, :PROMPT]
    padded = frozen.logprobs(sequences, mask, shared_prefix=PROMPT, response_start=PROMPT)
    assert packed_calls == []
    packed = frozen.logprobs(sequences, mask, shared_prefix=PROMPT, response_start=PROMPT, pack_budget=64)
    assert packed_calls == [1]
    scored = scored_positions(mask)
    torch.testing.assert_close(packed[scored], padded[scored], atol=2e-5, rtol=1e-5)
    # Rows of one length sharing one full prompt: the padded path runs it once (packs: once per two
    # rows), so it runs fewer tokens and is kept.
    same, even = sequences.clone(), mask.clone()
    same[:, :PROMPT], even[:, :PROMPT] = sequences[5, :PROMPT], mask[5, :PROMPT]
    even[:, PROMPT:] = 1
    frozen.logprobs(same, even, shared_prefix=PROMPT, response_start=PROMPT, pack_budget=64)
    assert packed_calls == [1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.usefixtures("one_thread")
def test_packed_training_forward_has_the_padded_gradients(tiny_model_dirs, family):
    """One packed forward (log-probs and entropy of the response) back-propagates the padded
    forward's gradients into every parameter."""
    model = load_causal_lm(str(tiny_model_dirs[family])).float()
    sequences, mask = ragged_batch()
    scored, weights, _, padded_entropy, want = padded_reference(model, sequences, mask)
    packed, entropy = packed_logprobs(model, sequences, mask, PROMPT, int(mask.sum()), with_entropy=True)
    ((packed * weights).sum() + (entropy * weights).sum()).backward()
    torch.testing.assert_close(entropy[scored], padded_entropy[scored], atol=2e-5, rtol=1e-5)
    assert_grads(model, want)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.usefixtures("one_thread")
def test_shared_prompt_packs_have_the_padded_logprobs_and_gradients(tiny_model_dirs, fused):
    """Rows of a sampled group packed as one unit that runs their prompt once ([prompt | response 1
    | response 2 | ...], a group over the budget cut into units within it): the log-probs,
    entropies and gradients are the padded forward's (HF attention and the fused kernels)."""
    from rlhf.engine.packing import pack_units

    model = load_causal_lm(str(tiny_model_dirs["llama"])).float()
    if fused:
        assert fused_layers.fuse_layer_ops(model) > 0
    sequences, mask = grouped_batch()  # two prompts of three rows, one row alone
    units = pack_units(sequences, mask, PROMPT)
    assert sorted(u.rows for u in units) == [(0, 1, 2), (3, 4, 5), (6,)]
    assert sum(u.tokens for u in units) == int(mask.sum()) - 2 * int(mask[0, :PROMPT].sum() + mask[3, :PROMPT].sum())
    assert max(len(u.rows) for u in pack_units(sequences, mask, PROMPT, budget=16)) == 2
    scored, weights, padded, padded_entropy, want = padded_reference(model, sequences, mask)
    for budget in (1, 16, int(mask.sum())):
        model.zero_grad()
        packed, entropy = packed_logprobs(model, sequences, mask, PROMPT, budget, with_entropy=True,
                                          shared_prefix=PROMPT)
        ((packed * weights).sum() + (entropy * weights).sum()).backward()
        torch.testing.assert_close(packed[scored], padded[scored], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[scored], padded_entropy[scored], atol=2e-5, rtol=1e-5)
        assert not bool(packed[~scored].any())
        assert_grads(model, want)


@pytest.mark.usefixtures("one_thread")
def test_packed_sft_loss_equals_the_padded_loss(tiny_model_dirs, monkeypatch):
    """rlhf sft's packed loss: the same summed cross entropy, token count and gradients as the padded
    forward's, over right-padded rows whose prompts are not supervised."""
    from rlhf.data.batching import collate_sft
    from rlhf.stages import sft

    model = load_causal_lm(str(tiny_model_dirs["mistral"])).float()
    gen = torch.Generator().manual_seed(5)
    rows = []
    for n, prompt in ((14, 4), (5, 2), (9, 3), (3, 1)):
        ids = torch.randint(3, 50, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    batch = collate_sft(rows, pad_token_id=0)
    calls: list[int] = []
    real = sft.packed_logprobs
    monkeypatch.setattr(sft, "packed_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))

    want, want_n, _ = sft.sft_loss(model, batch)  # Hugging Face's padded forward
    want.backward()
    padded_grads = grads(model)
    model.zero_grad()
    fused_layers.fuse_layer_ops(model)  # packs run where attention is the fused kernels
    got, got_n, _ = sft.packed_sft_loss(model, batch)
    got.backward()
    assert calls == [1] and got_n == want_n == float(batch["num_units"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert_grads(model, padded_grads)


@pytest.mark.usefixtures("one_thread")
def test_a_pack_that_scores_nothing_still_runs_one_forward_with_a_graph(tiny_model_dirs):
    """Rows with no token at or after response_start: the forward runs (sharded ranks must run as many
    as the others) and its zero log-probs still back-propagate (zero gradients), as the padded path's."""
    model = load_causal_lm(str(tiny_model_dirs["llama"])).float()
    sequences, mask = ragged_batch()
    logprobs, _ = packed_logprobs(model, sequences, mask, sequences.shape[1] + 5, int(mask.sum()))
    assert not bool(logprobs.any()) and logprobs.requires_grad
    logprobs.sum().backward()
    assert all(p.grad is None or not bool(p.grad.any()) for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.usefixtures("one_thread")
def test_packed_values_match_the_padded_value_model(tiny_model_dirs, family):
    """A value model's per-token values (and their gradients) from packed forwards equal the padded
    forward's at every real token (budgets of one row per pack and of all rows in one; rows of a
    group running their prompt once)."""
    from rlhf.engine.packing import packed_values
    from rlhf.models.value_model import ValueModel

    critic = ValueModel.from_causal_lm_dir(tiny_model_dirs[family], head_init_std=0.5).float()
    for shared in (0, PROMPT):
        sequences, mask = grouped_batch() if shared else ragged_batch()
        real = mask.bool()
        weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)) * real
        critic.zero_grad()
        padded = critic(sequences, mask)
        (padded * weights).sum().backward()
        want = grads(critic)
        for budget in (1, int(mask.sum())):
            critic.zero_grad()
            packed = packed_values(critic, sequences, mask, budget, shared)
            (packed * weights).sum().backward()
            torch.testing.assert_close(packed[real], padded[real].detach(), atol=2e-5, rtol=1e-5)
            assert not bool(packed[~real].any())
            assert_grads(critic, want)


@pytest.mark.usefixtures("one_thread")
def test_packed_scores_match_the_padded_reward_model(tiny_model_dirs, ctx):
    """Sequence scores (a reward model's, at each row's last real token) and their gradients from
    packed forwards equal `ValueModel.score`'s; FrozenModel.scores packs with a token budget where
    that runs fewer tokens; a row without real tokens is an error."""
    from rlhf.engine.inference import FrozenModel
    from rlhf.engine.packing import packed_scores
    from rlhf.models.value_model import ValueModel

    scorer = ValueModel.from_causal_lm_dir(tiny_model_dirs["qwen2"], head_init_std=0.5).float()
    sequences, mask = ragged_batch()
    weights = torch.rand(len(sequences), generator=torch.Generator().manual_seed(5))
    padded = scorer.score(sequences, mask)
    (padded * weights).sum().backward()
    want = grads(scorer)
    for budget in (1, int(mask.sum())):
        scorer.zero_grad()
        packed = packed_scores(scorer, sequences, mask, budget)
        (packed * weights).sum().backward()
        torch.testing.assert_close(packed, padded.detach(), atol=2e-5, rtol=1e-5)
        assert_grads(scorer, want)
    grouped, grouped_mask = grouped_batch()  # rows of a prompt: its tokens run once, the same scores
    with torch.no_grad():
        torch.testing.assert_close(packed_scores(scorer, grouped, grouped_mask, 64, PROMPT),
                                   scorer.score(grouped, grouped_mask), atol=2e-5, rtol=1e-5)
    frozen = FrozenModel(scorer, ctx, zero_stage=3, dtype="fp32", offload=False, micro_batch_size=64, name="reward")
    assert frozen._packs_fewer_tokens(sequences, mask, 0, 64, 0)
    torch.testing.assert_close(frozen.scores(sequences, mask, pack_budget=64), padded.detach(), atol=2e-5, rtol=1e-5)
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match="no real token"):
        packed_scores(scorer, sequences, empty, 64)
