"""The `arithmetic_words` task: small sums, differences and products written in words.

    "What is seven plus eight? Answer with the number only."  ->  "15"

Why it suits a real model with a real (BPE) tokenizer, where `sort` suits a character-level one:
- the prompt is plain English, which a pretrained chat model reads without any fine-tuning, and
  the answer is one or two number tokens, so PPO rollouts stay short and cheap on a CPU;
- the wrong answers below are the ones small models make (off by one or two, the wrong operation,
  the operands' digits instead of the result), so SFT demonstrations with a share of them leave an
  imperfect model, and preference pairs teach a reward model what "right" means;
- the checker reads the first number of the response, so "15", "15." and "The answer is 15"
  all count, and it is exact: a wrong number never scores.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rlhf.data.tasks.base import NUMBER_ONLY, first_number_is, user_request
from rlhf.errors import UserError

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)
OPERATIONS: dict[str, str] = {"plus": "+", "minus": "-", "times": "*"}
MISTAKES: tuple[str, ...] = ("off_by_one", "off_by_two", "wrong_operation", "operand")


@dataclass(frozen=True)
class ArithmeticWordsTask:
    """a OP b with a, b in [0, max_operand] written as words; minus never goes below zero."""

    name: str = "arithmetic_words"
    max_operand: int = 20
    """Largest operand (at most 20: the operands are written as words)."""
    max_product_operand: int = 10
    """Largest operand of a product, so products stay small numbers."""

    def __post_init__(self) -> None:
        if not 2 <= self.max_operand < len(NUMBER_WORDS) or not 2 <= self.max_product_operand <= self.max_operand:
            raise ValueError(f"arithmetic_words needs 2 <= max_product_operand <= max_operand <= {len(NUMBER_WORDS) - 1}")

    @property
    def _prompt_re(self) -> re.Pattern[str]:
        words = "|".join(NUMBER_WORDS)
        ops = "|".join(OPERATIONS)
        return re.compile(rf"What is ({words}) ({ops}) ({words})\? {re.escape(NUMBER_ONLY)}")

    def sample_prompt(self, rng: random.Random) -> str:
        op = rng.choice(tuple(OPERATIONS))
        top = self.max_product_operand if op == "times" else self.max_operand
        a, b = rng.randint(0, top), rng.randint(0, top)
        if op == "minus" and b > a:
            a, b = b, a
        return f"What is {NUMBER_WORDS[a]} {op} {NUMBER_WORDS[b]}? {NUMBER_ONLY}"

    def operands(self, prompt: str) -> tuple[int, str, int]:
        """(a, operation, b) of a prompt (raw or rendered as a dialog); a UserError otherwise."""
        match = self._prompt_re.fullmatch(user_request(prompt))
        if match is None:
            raise UserError(f"prompt {prompt[:60]!r} is not an '{self.name}' task prompt "
                            f"('What is <number> plus|minus|times <number>? {NUMBER_ONLY}')")
        return NUMBER_WORDS.index(match.group(1)), match.group(2), NUMBER_WORDS.index(match.group(3))

    def answer(self, prompt: str) -> int:
        a, op, b = self.operands(prompt)
        return a + b if op == "plus" else a - b if op == "minus" else a * b

    def correct_response(self, prompt: str) -> str:
        return str(self.answer(prompt))

    def wrong_response(self, prompt: str, rng: random.Random) -> str:
        """A plausible wrong number: never the answer."""
        a, op, b = self.operands(prompt)
        answer = self.answer(prompt)
        kind = rng.choice(MISTAKES)
        if kind == "wrong_operation":
            candidates = [a + b, abs(a - b), a * b]
        elif kind == "operand":
            candidates = [a, b, int(f"{a}{b}")]
        else:
            step = 1 if kind == "off_by_one" else 2
            candidates = [answer + step, answer - step]
        wrong = [c for c in candidates if c != answer and c >= 0]
        return str(rng.choice(wrong) if wrong else answer + 1)

    def score(self, prompt: str, response: str) -> float:
        """1.0 when the first number in the response is the answer, else 0.0."""
        return first_number_is(response, self.answer(prompt))

    def is_correct(self, prompt: str, response: str) -> bool:
        return self.score(prompt, response) == 1.0
