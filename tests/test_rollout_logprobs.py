"""PPO's old log-probs from generation: equal to the training forward's, and what PPO does with them."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf.cli import main
from rlhf.engine.generation import generate
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.sampling import SamplingParams
from rlhf.models.loading import load_tokenizer
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, build_tiny_model
from tests.conftest import read_metrics, write_jsonl

PROMPTS = ["Hello", "a much longer prompt, with padding", "x", "The quick brown fox"]


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fast", ["auto", False])
def test_generation_logprobs_equal_the_forward_logprobs(tok, family: str, fast) -> None:
    """Sampled with temperature, top-k and a min_new_tokens EOS mask (none of which the training
    forward applies): generation's log-prob of each token is the raw forward's, group sampling too."""
    model = build_tiny_model(family, tok, seed=0).eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=12, min_new_tokens=3, temperature=0.7, top_k=20,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = generate(model, enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(0), fast=fast,
                   samples_per_prompt=2)
    with torch.no_grad():
        forward, _ = causal_lm_logprobs(model, out.sequences, out.attention_mask)
    actions = out.action_mask[:, 1:]
    assert actions.any()
    torch.testing.assert_close(out.logprobs[:, 1:][actions], forward[actions], atol=2e-5, rtol=0)
    assert (out.logprobs[~out.action_mask] == 0).all()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logprobs")
    rng = random.Random(0)
    rows = [{"prompt": "".join(rng.choice("bcdefgh") for _ in range(rng.randint(3, 8)))} for _ in range(64)]
    (folder / "vowels.py").write_text("def vowels(prompt, response):\n"
                                      "    return sum(c in 'aeiou' for c in response) / max(1, len(response))\n")
    return write_jsonl(folder / "prompts.jsonl", rows)


def _ppo(model, prompts, out, *extra: str, critic: bool = True) -> list[dict]:
    reward = f"{prompts.parent / 'vowels.py'}:vowels"
    main(["ppo", "--actor", str(model), *(["--critic", str(model)] if critic else []), "--reward-fn", reward,
          "--data", str(prompts), "--output", str(out), "--max-steps", "2", "--generation-batch-size", "8",
          "--max-new-tokens", "6",
          "--micro-batch-size", "4", "--report-to", "none", "--optimizer-impl", "torch", "--kl-coef", "0.1", *extra])
    return read_metrics(out)


def test_ppo_takes_generation_logprobs_and_logs_their_drift(tiny_model_dirs, prompts, tmp_path) -> None:
    model = tiny_model_dirs["llama"]
    taken = _ppo(model, prompts, tmp_path / "taken")
    recomputed = _ppo(model, prompts, tmp_path / "recomputed", "--recompute-old-logprobs")
    assert [r["old_logprobs_recomputed"] for r in taken] == [0.0, 0.0]
    assert [r["old_logprobs_recomputed"] for r in recomputed] == [1.0, 1.0]
    for row in taken:  # the first forward of the update scores the rollout policy: only rounding differs
        assert 0 <= row["old_logprob_diff_mean"] <= row["old_logprob_diff_max"] < 1e-4
    # One forward pass fewer in the experience phase, and the same training.
    assert taken[0]["experience_gflop"] < recomputed[0]["experience_gflop"]
    for a, b in zip(taken, recomputed):
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["default", "fp16"])
def test_fp16_kv_cache_rollouts_take_their_own_logprobs_within_the_looser_tolerance(tiny_model_dirs, prompts, tmp_path,
                                                                                     kv_cache_dtype: str) -> None:
    """A float16 KV cache (the CPU's default for a float32 Llama, `auto`, or `fp16`): generation's
    log-probs (of the policy that sampled, over the rounded cache) are PPO's old log-probs; their
    drift from the float32 training forward shows, below the 0.05 default tolerance, so nothing is
    recomputed. `--kv-cache-dtype model` keeps the float32 cache: the drift is a float32 rounding."""
    chosen = [] if kv_cache_dtype == "default" else ["--kv-cache-dtype", kv_cache_dtype]
    rows = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", *chosen)
    exact = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "exact", "--kv-cache-dtype", "model")
    assert [r["old_logprobs_recomputed"] for r in rows + exact] == [0.0] * 4
    for row, float32 in zip(rows, exact):
        # ~1e-6 against ~1e-5 here (6 tokens of a tiny model; ~4e-4 on a 4-layer tiny Llama at 64 tokens)
        assert float32["old_logprob_diff_max"] < 1e-5
        assert float32["old_logprob_diff_max"] < row["old_logprob_diff_max"] < 0.05


def test_drift_beyond_the_tolerance_switches_to_recomputing(tiny_model_dirs, prompts, tmp_path) -> None:
    rows = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", "--old-logprob-tolerance", "0")
    if rows[0]["old_logprob_diff_max"] == 0:
        pytest.skip("generation's log-probs were bit-identical here: nothing to exceed")
    assert [r["old_logprobs_recomputed"] for r in rows] == [0.0, 1.0]  # (and a warning says so)


def test_kept_critic_forward_trains_the_critic_as_a_second_forward_would(tiny_model_dirs, prompts, tmp_path) -> None:
    """One epoch, one minibatch, one micro-batch per rank: the values forward's graph is the value
    loss's (one critic forward fewer). Responses of a fixed length, so two micro-batches of 4
    average to the same loss as one of 8."""
    model = tiny_model_dirs["llama"]
    fixed = ("--min-new-tokens", "6", "--lr", "1e-3", "--critic-lr", "1e-3")
    kept = _ppo(model, prompts, tmp_path / "kept", *fixed, "--micro-batch-size", "8")
    twice = _ppo(model, prompts, tmp_path / "twice", *fixed, "--micro-batch-size", "4")
    for a, b in zip(kept, twice):
        for key in ("value_loss", "critic_grad_norm", "value_explained_variance", "policy_loss", "actor_grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert kept[0]["training_gflop"] < twice[0]["training_gflop"]


@pytest.mark.parametrize("fast", ["auto", False])
@pytest.mark.parametrize("do_sample", [True, False])
def test_dropping_finished_rows_changes_no_token(tok, fast, do_sample) -> None:
    """Rows that finished are dropped from the decode batch at sync points (KV cache rows too);
    every other row draws the tokens it draws without that, with the same log-probs."""
    model = build_tiny_model("llama", tok, seed=0).eval()
    enc = tok(PROMPTS * 3, return_tensors="pt", padding=True)
    stops = list(range(10, 30))  # 20 of ~100 ids end a response: rows finish at many different steps
    outs = []
    for drop in (True, False):
        params = SamplingParams(max_new_tokens=40, temperature=1.0, do_sample=do_sample, eos_token_id=stops,
                                pad_token_id=tok.pad_token_id, sync_every=2, drop_finished=drop)
        outs.append(generate(model, enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(3),
                             fast=fast, samples_per_prompt=2))
    dropped, kept = outs
    lengths = kept.response_lengths
    assert kept.finished.any() and lengths.min() < lengths.max() - 4
    assert torch.equal(dropped.sequences, kept.sequences)
    assert torch.equal(dropped.action_mask, kept.action_mask)
    torch.testing.assert_close(dropped.logprobs, kept.logprobs, atol=1e-5, rtol=0)


def test_token_budget_micro_batches_train_as_one_micro_batch(tiny_model_dirs, prompts, tmp_path) -> None:
    """--max-tokens-per-micro-batch: several length-sorted micro-batches, weighted, give the
    step of one micro-batch over the whole minibatch."""
    model = tiny_model_dirs["llama"]
    fixed = ("--lr", "1e-3", "--critic-lr", "1e-3", "--micro-batch-size", "8")
    whole = _ppo(model, prompts, tmp_path / "whole", *fixed)
    budget = _ppo(model, prompts, tmp_path / "budget", *fixed, "--max-tokens-per-micro-batch", "40")
    # (The logged losses are means over micro-batches, so only the steps are compared.)
    for a, b in zip(budget, whole):
        for key in ("critic_grad_norm", "actor_grad_norm", "kl", "score_mean", "value_explained_variance"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_packed_forwards_train_as_the_padded_ones(tiny_model_dirs, prompts, tmp_path, monkeypatch) -> None:
    """A budget that holds the whole minibatch of left-padded rows, sampled in pairs: the actor's,
    the critic's, the reference model's and the reward model's forwards run packed
    (--pack-sequences; each pair's prompt once where they share it) and the steps are the padded ones."""
    from rlhf.engine import inference
    from rlhf.stages.ppo import experience_phase as ppo

    from rlhf.engine import packing

    units: list[int] = []
    real_units = packing.pack_units
    monkeypatch.setattr(packing, "pack_units", lambda *a, **k: units.extend(
        len(u.rows) for u in real_units(*a, **k)) or real_units(*a, **k))
    calls = {"actor": 0, "ref": 0, "critic": 0, "reward": 0}
    for module, name, key in ((ppo, "packed_logprobs", "actor"), (inference, "packed_logprobs", "ref"),
                              (ppo, "packed_values", "critic"), (inference, "packed_scores", "reward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, real=real, key=key, **k: calls.__setitem__(key, calls[key] + 1) or real(*a, **k))
    from rlhf.models.value_model import ValueModel

    model = tiny_model_dirs["llama"]
    reward_model = tmp_path / "rm"
    ValueModel.from_causal_lm_dir(model, head_init_std=0.5).save_pretrained(reward_model)
    load_tokenizer(str(model)).save_pretrained(reward_model)
    fixed = ("--lr", "1e-3", "--critic-lr", "1e-3", "--micro-batch-size", "8", "--max-tokens-per-micro-batch", "400",
             "--reward", str(reward_model), "--samples-per-prompt", "2", "--temperature", "1.0",
             "--share-prompt-min-gflop", "0")  # a tiny model's pairs share their prompt (the path under test)
    padded = _ppo(model, prompts, tmp_path / "padded", *fixed, "--no-pack-sequences")
    assert calls == {"actor": 0, "ref": 0, "critic": 0, "reward": 0}
    packed = _ppo(model, prompts, tmp_path / "packed", *fixed)
    assert all(calls.values()), calls
    assert max(units) == 2  # a pair's prompt runs once
    for a, b in zip(packed, padded):
        for key in ("critic_grad_norm", "actor_grad_norm", "kl", "score_mean", "policy_loss", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_group_packs_train_as_the_padded_ones(tiny_model_dirs, prompts, tmp_path, monkeypatch) -> None:
    """GRPO with groups of 4: the actor's and reference's packed forwards run each group's prompt
    once (one unit per group) and the steps are the padded ones (--no-pack-sequences)."""
    from rlhf.engine import packing

    units: list[int] = []
    real = packing.pack_units
    monkeypatch.setattr(packing, "pack_units", lambda *a, **k: units.extend(
        len(u.rows) for u in real(*a, **k)) or real(*a, **k))
    model = tiny_model_dirs["llama"]
    fixed = ("--advantage-estimator", "grpo", "--samples-per-prompt", "4", "--lr", "1e-3", "--micro-batch-size", "8",
             "--max-tokens-per-micro-batch", "400", "--temperature", "1.0",
             "--share-prompt-min-gflop", "0")  # a tiny model's groups share their prompt (the path under test)
    padded = _ppo(model, prompts, tmp_path / "padded", *fixed, "--no-pack-sequences", critic=False)
    assert units == []
    packed = _ppo(model, prompts, tmp_path / "packed", *fixed, critic=False)
    assert max(units) == 4
    for a, b in zip(packed, padded):
        for key in ("actor_grad_norm", "kl", "score_mean", "policy_loss", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_token_budget_on_two_ranks_matches_one(tmp_path, prompts, estimator: str) -> None:
    """Ranks cut their rows into as many micro-batches (the most any rank needs) and weight them
    by the global token count: 2 ranks with ZeRO-3 take the step one rank takes (the forwards
    packed; with GRPO, pairs sampled per prompt run their prompt once)."""
    from tests.conftest import one_and_two_rank_metrics, tiny_actor_and_reward

    actor, reward = tiny_actor_and_reward(tmp_path)
    sampling = ["--greedy"] if estimator == "gae" else ["--samples-per-prompt", "2", "--temperature", "1.0"]
    args = ["ppo", "--actor", str(actor), "--reward", str(reward), "--data", str(prompts), "--max-steps", "1",
            "--max-new-tokens", "6", "--dtype", "fp32", "--zero-stage", "3", "--report-to", "none",
            "--optimizer-impl", "torch", "--lr", "1e-3", "--max-tokens-per-micro-batch", "30",
            "--advantage-estimator", estimator, "--kv-cache-dtype", "model", *sampling]
    # The model's KV cache: a float16 one rounds keys and values that differ in their last bit
    # between 1 and 2 ranks (different GEMM blockings) to values a half-ulp apart, ~1e-5 in the metrics.
    a, b = one_and_two_rank_metrics(args, tmp_path)
    keys = ("score_mean", "kl", "actor_grad_norm") + (("critic_grad_norm",) if estimator == "gae" else ())
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
