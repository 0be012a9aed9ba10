"""A TRL-convention reward function: 1.0 when a completion's first word is the row's answer.

    answer_match(completions, answer, **kwargs) -> list[float]

`completions` are what TRL's GRPOTrainer passes: for conversational rows a list of messages per
completion ([{"role": "assistant", "content": ...}]), for standard rows a string per completion;
both are handled. `answer` is the dataset column of that name, one value per completion. The
first whitespace-separated word of the completion, stripped of surrounding punctuation
(.,!?;:'"), must equal str(answer); an empty completion or a missing answer scores 0.0.

Self-contained (no rlhf import): the same file runs unchanged under rlhf ppo (`--reward-fn
scripts/rewards/answer_match.py:answer_match`), under TRL (the peer venv has no rlhf) and in
scripts/bench_learning.py's evaluator.
"""

from __future__ import annotations

from typing import Any

PUNCTUATION = ".,!?;:'\""


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, (list, tuple)) and completion:
        return completion_text(completion[-1])
    return ""


def first_word(text: str) -> str:
    """The first whitespace-separated word of `text` without surrounding punctuation ('' if none)."""
    words = text.split()
    return words[0].strip(PUNCTUATION) if words else ""


def answer_match(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for each completion whose first word equals its answer, else 0.0."""
    return [float(a is not None and first_word(completion_text(c)) == str(a).strip())
            for c, a in zip(completions, answer, strict=True)]
