"""A reward model with another tokenizer scores what it was trained on: re-tokenised rollouts."""

from __future__ import annotations

from rlhf.data.formats import parse_row
from rlhf.data.sources import RawRow
from rlhf.data.retokenize import retokenize_for_reward, same_vocabulary
from rlhf.data.tokenization import tokenize_pairs
from rlhf.models.tiny import build_char_tokenizer
from tests.test_scored_sequence import chatml_tokenizer


def test_rollouts_are_rendered_as_the_reward_model_was_trained() -> None:
    actor_tok, reward_tok = build_char_tokenizer(), chatml_tokenizer()
    assert not same_vocabulary(actor_tok, reward_tok) and same_vocabulary(actor_tok, build_char_tokenizer())
    prompts = [[{"role": "user", "content": "sort: cab"}], [{"role": "user", "content": "sort: zyxw"}]]
    responses = ["abc", "wxyz"]
    ids, mask, truncated = retokenize_for_reward(prompts, responses, reward_tok, max_len=256)
    assert truncated == 0 and ids.shape[0] == 2
    for i, (p, r) in enumerate(zip(prompts, responses)):
        trained, _ = tokenize_pairs([parse_row(RawRow({"prompt": p, "chosen": r, "rejected": r + "!"}, "t", 0))], reward_tok, 256)
        assert ids[i][mask[i].bool()].tolist() == trained[0]["chosen_ids"]
    assert (ids[:, -1] == reward_tok.eos_token_id).all()  # left-padded: every row ends at its EOS


def test_over_long_sequences_keep_their_end() -> None:
    tok = chatml_tokenizer()
    ids, mask, truncated = retokenize_for_reward([[{"role": "user", "content": "x" * 50}]], ["abc"], tok, max_len=10)
    assert truncated == 1 and ids.shape == (1, 10) and ids[0, -1] == tok.eos_token_id
