"""The `calculator` task: products of two 3-digit numbers, which a small model cannot work out in
its head, with a `calculate` tool that can.

    "What is 482 times 317?"
      assistant: <tool_call>{"name": "calculate", "arguments": {"expression": "482 * 317"}}</tool_call>
      tool:      152794
      assistant: 152794

Why it shows what tool use is for: without the tool, a 135M model answers about 0% of these right
(a product has 5-6 digits and no shortcut); with it, the task becomes copying the operands into
a call and the result into the answer, which SFT on demonstrations teaches in part and RL then
makes reliable. Its SFT demonstrations are conversations with tool calls (TRL's prompt-completion
rows with a `tools` column); the wrong share of them answers without the tool (a plausible wrong
product) or calls it with an operand off by a digit, so the SFT model is imperfect on purpose.
The checker reads the first number of the final answer.

`calculate` is a plain function in TRL's tools convention (type hints, Google-style docstring):
`--tools rlhf.data.tasks.calculator:calculate`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from rlhf.data.tasks.base import first_number_is, user_request
from rlhf.errors import UserError

TOOL_SPEC = "rlhf.data.tasks.calculator:calculate"
"""The --tools spec of the task's tool."""

_OPERATORS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}
_MAX_DIGITS = 40  # a result longer than this is refused (no 9**9**9)


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError("only numbers, + - * / // % and parentheses are allowed")
    if abs(value) >= 10**_MAX_DIGITS:
        raise ValueError("the result is too large")
    return value


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "482 * 317".
    """
    try:
        value = _evaluate(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


@dataclass(frozen=True)
class CalculatorTask:
    """a times b with a, b in [low, high] (3-digit numbers by default)."""

    name: str = "calculator"
    low: int = 100
    high: int = 999

    _PROMPT = re.compile(r"What is (\d+) times (\d+)\?")

    def sample_prompt(self, rng: random.Random) -> str:
        return f"What is {rng.randint(self.low, self.high)} times {rng.randint(self.low, self.high)}?"

    def operands(self, prompt: str) -> tuple[int, int]:
        match = self._PROMPT.search(user_request(prompt))
        if match is None:
            raise UserError(f"prompt {prompt[:60]!r} is not a '{self.name}' task prompt ('What is <a> times <b>?')")
        return int(match.group(1)), int(match.group(2))

    def answer(self, prompt: str) -> int:
        a, b = self.operands(prompt)
        return a * b

    def correct_response(self, prompt: str) -> str:
        return str(self.answer(prompt))

    def wrong_response(self, prompt: str, rng: random.Random) -> str:
        """A plausible wrong product: a digit of the right one changed."""
        digits = list(self.correct_response(prompt))
        at = rng.randrange(len(digits))
        digits[at] = rng.choice([d for d in "0123456789" if d != digits[at] and (at or d != "0")])
        return "".join(digits)

    def score(self, prompt: str, response: str) -> float:
        return first_number_is(response, self.answer(prompt))

    def is_correct(self, prompt: str, response: str) -> bool:
        return self.score(prompt, response) == 1.0

    def tool_specs(self) -> list[str]:
        """The --tools specs of the task's tools."""
        return [TOOL_SPEC]

    def tools(self) -> list[dict[str, Any]]:
        """The JSON schemas of the task's tools, as its demonstrations' `tools` column holds them."""
        from rlhf.tools import tool_from_function  # rlhf.tools imports the reward functions, which import the tasks

        return [tool_from_function(calculate, self.name).schema]

    def demonstration(self, prompt: str, wrong: bool, rng: random.Random) -> dict[str, Any]:
        """An SFT row (TRL's conversational prompt-completion with tools): the tool called with the
        operands and its result copied; a wrong one answers in its head or mistypes an operand."""
        a, b = self.operands(prompt)
        user = [{"role": "user", "content": prompt}]
        if wrong and rng.random() < 0.5:
            completion = [{"role": "assistant", "content": self.wrong_response(prompt, rng)}]
        else:
            if wrong:
                a = a + rng.choice([-10, 10, -1, 1]) if self.low < a + 10 < self.high else a + 1
            expression = f"{a} * {b}"
            call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
            result = calculate(expression)
            completion = [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "name": "calculate", "content": result},
                          {"role": "assistant", "content": result}]
        return {"prompt": user, "completion": completion, "tools": self.tools()}
