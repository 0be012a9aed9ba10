"""The reward stage and PPO score the same last token: one rendering of a scored response.

A rollout stops at EOS. The pairs the reward model trains on must end there too, whatever the
chat template writes after its end-of-turn token (ChatML: `<|im_end|>\\n`).
"""

from __future__ import annotations

from typing import Any

import pytest

from rlhf.data.rendering import render_prompt, render_response
from rlhf.data.tokenization import encode_continuation, encode_prompt, tokenize_pairs, tokenize_sft
from rlhf.data.formats import parse_row
from rlhf.data.sources import RawRow
from rlhf.models.tiny import build_char_tokenizer

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer() -> Any:
    """The tiny character tokenizer with ChatML's special tokens and template (EOS = <|im_end|>)."""
    tok = build_char_tokenizer(add_bos=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize("make_tokenizer", [chatml_tokenizer, build_char_tokenizer], ids=["chatml", "tiny-template"])
def test_rendered_response_ends_at_the_token_a_rollout_stops_at(make_tokenizer) -> None:
    tok = make_tokenizer()
    messages = [{"role": "user", "content": "sort: cab"}]
    text = render_response(messages, "abc", tok)
    assert text.endswith(tok.eos_token)
    # What generation produces: the prompt, the response tokens, then EOS and nothing after it.
    prompt_ids = encode_prompt(render_prompt(messages, tok), tok)
    rollout = prompt_ids + encode_continuation(text, tok)
    assert rollout[-1] == tok.eos_token_id
    rows, _ = tokenize_pairs([parse_row(RawRow({"prompt": messages, "chosen": "abc", "rejected": "cab"}, "t", 0))], tok, 256)
    assert rows[0]["chosen_ids"] == rollout
    assert rows[0]["rejected_ids"][-1] == tok.eos_token_id
    sft_rows, _ = tokenize_sft([parse_row(RawRow({"prompt": messages, "completion": "abc"}, "t", 0))], tok, 256)
    assert sft_rows[0]["input_ids"] == rollout


def test_chatml_tail_after_end_of_turn_is_cut() -> None:
    tok = chatml_tokenizer()
    full = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                   tokenize=False)
    assert full.endswith("<|im_end|>\n")  # the template's own tail, which a rollout never produces
    assert render_response([{"role": "user", "content": "hi"}], "yo", tok) == "yo<|im_end|>"
