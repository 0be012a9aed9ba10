"""Score rollouts with a reward model whose tokenizer differs from the actor's.

The actor's token ids mean nothing to such a reward model, so each response is decoded with the
actor's tokenizer and the (prompt, response) pair is rendered again with the reward model's own
chat template, through the same `render_prompt` / `render_continuation` that built the reward
model's training pairs: it scores the same text, ending at the same EOS token, as it was trained
on. Batched: one tokenizer call per batch.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.data.batching import pad_left
from rlhf.data.formats import Message
from rlhf.data.rendering import render_continuation, render_prompt
from rlhf.logging import get_logger

log = get_logger(__name__)


def same_vocabulary(a: Any, b: Any) -> bool:
    """True when both tokenizers map every token to the same id (ids can be scored as they are)."""
    return a is b or (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id)


def retokenize_for_reward(
    prompts: list[list[Message]], responses: list[str], tokenizer: Any, max_len: int,
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded ([B, T] ids, mask) of each prompt + response in `tokenizer`'s rendering (with
    each row's `tools` schemas, as the data row rendered them), and how many were cut to
    `max_len` (from the left: the scored last token is always kept)."""
    row_tools = tools or [None] * len(prompts)
    texts = [render_prompt(p, tokenizer, t) + render_continuation(p, [{"role": "assistant", "content": r}], tokenizer,
                                                                  t)
             for p, r, t in zip(prompts, responses, row_tools)]
    bos = tokenizer.bos_token
    encoded = [tokenizer(t, add_special_tokens=not (bos and t.startswith(bos)))["input_ids"] for t in texts]
    truncated = sum(len(ids) > max_len for ids in encoded)
    if truncated:
        log.debug("reward re-tokenisation: %d of %d sequences cut to their last %d tokens", truncated, len(texts), max_len)
    ids, mask = pad_left([ids[-max_len:] for ids in encoded], tokenizer.pad_token_id)
    return ids, mask, truncated
