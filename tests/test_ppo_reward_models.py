"""PPO with reward models from elsewhere: a Hugging Face `LlamaForSequenceClassification`, one
whose tokenizer differs from the actor's (re-tokenised rollouts), a degenerate one (warning,
clipped rewards), and folders checked before any model is loaded."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf.cli import main
from rlhf.config import PPOConfig
from rlhf.data.formats import parse_row
from rlhf.data.sources import RawRow
from rlhf.data.rendering import render_prompt
from rlhf.data.tokenization import encode_prompt, tokenize_pairs
from rlhf.engine.distributed import DistributedContext
from rlhf.models.tiny import build_char_tokenizer, tiny_config
from rlhf.models.value_model import load_value_model
from rlhf.reward_batch import RewardBatch
from rlhf.stages.reward_sources import DEGENERATE_SCORE_STD, build_reward_source
from tests.conftest import read_metrics, write_jsonl
from tests.test_scored_sequence import chatml_tokenizer

FAST = ["--max-steps", "2", "--generation-batch-size", "4", "--micro-batch-size", "4", "--max-new-tokens", "6",
        "--report-to", "none", "--optimizer-impl", "torch", "--sample-log-interval", "0"]


def classifier_dir(path: Path, tokenizer: Any, head_std: float = 1.0, seed: int = 0) -> Path:
    """A Hugging Face LlamaForSequenceClassification (num_labels 1, pad_token_id set) built by
    transformers from a tiny config, its vocabulary sized to `tokenizer`, saved with it."""
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, head_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = [{"prompt": "sort: " + "".join(rng.sample("bcdefgh", rng.randint(3, 6)))} for _ in range(32)]  # `sort` task prompts
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def test_hf_llama_classifier_as_reward_and_default_critic(tiny_model_dirs, prompts, tmp_path: Path) -> None:
    actor = tiny_model_dirs["llama"]
    reward = classifier_dir(tmp_path / "rm", build_char_tokenizer())
    out = tmp_path / "ppo"
    main(["ppo", "--actor", str(actor), "--reward", str(reward), "--data", str(prompts), "--output", str(out), *FAST])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and (out / "DONE").is_file()
    assert all(0.0 <= r["reward_clipped_fraction"] <= 1.0 for r in rows)
    assert not (out / "checkpoints").exists()  # no --save-final-checkpoint
    # The critic started from the classifier with its trained score head (then trained 2 steps).
    critic = load_value_model(out / "critic")
    start = load_value_model(reward)
    cos = torch.nn.functional.cosine_similarity(critic.value_head.weight.flatten(), start.value_head.weight.flatten(),
                                                dim=0)
    assert cos > 0.9


def test_reward_model_with_another_tokenizer_scores_retokenised_rollouts(tiny_model_dirs, prompts,
                                                                          tmp_path: Path) -> None:
    actor = tiny_model_dirs["llama"]
    reward_tok = chatml_tokenizer()  # the char vocabulary plus <|im_start|>, <|im_end|>: ids differ from the actor's
    reward = classifier_dir(tmp_path / "rm", reward_tok)
    assert len(reward_tok) > len(build_char_tokenizer())
    out = tmp_path / "ppo"
    main(["ppo", "--actor", str(actor), "--critic", str(actor), "--reward", str(reward), "--data", str(prompts),
          "--output", str(out), "--save-final-checkpoint", *FAST])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_retokenize_truncated"] == 0 for r in rows)
    assert (out / "checkpoints" / "step_00000002").is_dir()  # --save-final-checkpoint

    # The source, fed rollouts in the actor's ids, scores what the reward model reads in its own.
    actor_tok = build_char_tokenizer()
    messages = [[{"role": "user", "content": "sort: cab"}], [{"role": "user", "content": "sort: hgfed"}]]
    responses = ["abc", "defgh"]
    seqs = [encode_prompt(render_prompt(m, actor_tok), actor_tok) + actor_tok(r, add_special_tokens=False)["input_ids"]
            + [actor_tok.eos_token_id] for m, r in zip(messages, responses)]
    width = max(map(len, seqs))
    ids = torch.tensor([[actor_tok.pad_token_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    decoded = [t.strip() for t in actor_tok.batch_decode([s[len(s) - len(r) - 1:] for s, r in zip(seqs, responses)],
                                                         skip_special_tokens=True)]
    assert decoded == responses
    config = PPOConfig(actor=str(actor), reward=str(reward), critic=str(actor), normalize_reward=False)
    source = build_reward_source(config, DistributedContext.initialize(), actor_tok, "fp32")
    got = source.score(ids, mask, RewardBatch(messages, decoded))
    model = load_value_model(reward).eval()
    expected = []
    for m, r in zip(messages, responses):
        pair, _ = tokenize_pairs([parse_row(RawRow({"prompt": m, "chosen": r, "rejected": r + "!"}, "t", 0))], reward_tok, 256)
        chosen = torch.tensor([pair[0]["chosen_ids"]])
        with torch.no_grad():
            expected.append(model.score(chosen, torch.ones_like(chosen)))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_degenerate_reward_model_warns_and_its_rewards_are_clipped(tiny_model_dirs, prompts, tmp_path: Path) -> None:
    actor = tiny_model_dirs["llama"]
    reward = classifier_dir(tmp_path / "rm" / "model", build_char_tokenizer(), head_std=1.0)
    # As the reward stage writes it: score statistics beside the model, here a spread of 0.001.
    (tmp_path / "rm" / "summary.json").write_text(json.dumps({"score_mean": 0.0, "score_std": 1e-3}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("rlhf").addHandler(handler)
    try:
        out = tmp_path / "ppo"
        main(["ppo", "--actor", str(actor), "--reward", str(reward), "--critic", str(actor), "--data", str(prompts),
              "--output", str(out), "--reward-clip", "5", *FAST])
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "score_std" in r.getMessage()]
    assert len(warnings) == 1 and "0.001" in warnings[0] and str(DEGENERATE_SCORE_STD) in warnings[0]
    # Scores of a random head of std 1 spread far more than 5 x 0.001: every normalised reward is clipped.
    assert [r["reward_clipped_fraction"] for r in read_metrics(out)] == [1.0, 1.0]


def test_reward_clipped_fraction_counts_only_clipped_scores(tiny_model_dirs, prompts, tmp_path: Path) -> None:
    actor = tiny_model_dirs["llama"]
    out = tmp_path / "ppo"
    # The sort task scores 0 or 1; a missing-EOS penalty of 10 pushes exactly the responses that
    # never reached EOS beyond the clip of 5: the clipped share is the share without EOS.
    main(["ppo", "--actor", str(actor), "--critic", str(actor), "--reward-fn", "sort", "--data", str(prompts),
          "--output", str(out), "--reward-clip", "5", "--missing-eos-penalty", "10", *FAST])
    rows = read_metrics(out)
    assert [r["reward_clipped_fraction"] for r in rows] == pytest.approx([1 - r["ended_with_eos"] for r in rows])
    assert any(r["reward_clipped_fraction"] > 0 for r in rows)


@pytest.mark.parametrize("flag", ["--reward", "--critic"])
def test_bad_model_folders_fail_before_any_model_loads(tiny_model_dirs, prompts, tmp_path: Path, capsys, flag: str,
                                                       monkeypatch) -> None:
    import rlhf.stages.ppo.loop as ppo

    def no_loading(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded before the folders were checked")

    monkeypatch.setattr(ppo, "deferred_causal_lm", no_loading)
    actor = tiny_model_dirs["llama"]
    bad = str(actor) if flag == "--reward" else str(tmp_path / "missing")  # a causal LM is no reward model
    args = ["--reward", bad, "--critic", str(actor)] if flag == "--reward" else \
        ["--reward-fn", "sort", "--critic", bad]
    with pytest.raises(SystemExit) as exc:
        main(["ppo", "--actor", str(actor), *args, "--data", str(prompts), "--output", str(tmp_path / "o"), *FAST])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {bad}" in err
