"""The `larger_number` task: pick the larger of two two-digit numbers.

    "Which number is larger, 37 or 52? Answer with the number only."  ->  "52"

Why it is the real-model preset's task (SmolLM2-135M-Instruct, measured on 48 held-out prompts):
- the base model has signal when sampled but little greedily: greedy 0.00 (it starts "To solve
  this problem, ..."), sampled 0.11, at least one of 8 samples right 0.67;
- 64 SFT demonstrations (a third of them the smaller number) teach the answer format but not the
  comparison: greedy 0.56, sampled 0.54, a coin flip between the two numbers;
- so a group of 8 samples almost always holds both a right and a wrong answer (1 - 2 x 0.5^8 ~
  0.99 of the groups at p = 0.5), every group carries a learning signal, and GRPO turns the
  comparison the model can make into its greedy answer (0.56 -> 0.98 in 40 steps);
- the answer is two digit tokens and EOS, so rollouts are 3-6 tokens and cheap on a CPU;
- the checker reads the first number of the response, so "52", "52." and "The answer is 52"
  all count; the other number never scores, and nor does a number that is neither.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rlhf.data.tasks.base import NUMBER_ONLY, first_number_is, user_request
from rlhf.errors import UserError

_PROMPT = re.compile(rf"Which number is larger, (\d+) or (\d+)\? {re.escape(NUMBER_ONLY)}")


@dataclass(frozen=True)
class LargerNumberTask:
    """Two distinct numbers in [low, high]; the response must be the larger one."""

    name: str = "larger_number"
    low: int = 10
    """Smallest number shown."""
    high: int = 99
    """Largest number shown."""

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"larger_number needs 0 <= low < high, got {self.low}, {self.high}")

    def sample_prompt(self, rng: random.Random) -> str:
        a, b = rng.sample(range(self.low, self.high + 1), 2)
        return f"Which number is larger, {a} or {b}? {NUMBER_ONLY}"

    def numbers(self, prompt: str) -> tuple[int, int]:
        """The two numbers of a prompt (raw or rendered as a dialog); a UserError otherwise."""
        match = _PROMPT.fullmatch(user_request(prompt))
        if match is None:
            raise UserError(f"prompt {prompt[:60]!r} is not a '{self.name}' task prompt "
                            f"('Which number is larger, <a> or <b>? {NUMBER_ONLY}')")
        return int(match.group(1)), int(match.group(2))

    def correct_response(self, prompt: str) -> str:
        return str(max(self.numbers(prompt)))

    def wrong_response(self, prompt: str, rng: random.Random) -> str:
        """The smaller number: the mistake a model that has not compared them makes half the time."""
        return str(min(self.numbers(prompt)))

    def rejected_response(self, prompt: str, rng: random.Random) -> str:
        """A preference pair's rejected answer: half the time the smaller number, else a number of
        the range that is not in the question. Against the smaller number alone a reward model
        ranks every pair right by preferring larger numbers whatever the question says, and PPO
        then learns to answer large numbers that are not in it (measured: SFT 0.62 -> 0.30)."""
        a, b = self.numbers(prompt)
        if rng.random() < 0.5:
            return str(min(a, b))
        others = [n for n in range(self.low, self.high + 1) if n not in (a, b)]
        return str(rng.choice(others))

    def score(self, prompt: str, response: str) -> float:
        """1.0 when the first number in the response is the larger one, else 0.0."""
        return first_number_is(response, max(self.numbers(prompt)))

    def is_correct(self, prompt: str, response: str) -> bool:
        return self.score(prompt, response) == 1.0
