"""Tools a policy calls during its rollouts, in TRL's conventions, and their calls run safely.

    --tools path/to/file.py:fn1,fn2        plain functions (sync or async) with type hints and a
                                           Google-style docstring: their JSON schemas come from
                                           `transformers.utils.get_json_schema`, as TRL's `tools=`
    --environment path/to/file.py:Class    TRL's `environment_factory`: one instance per rollout;
                                           its public methods are the tools, `reset(**row)` returns
                                           None or text appended to the last user message, and an
                                           optional `get_reward()` scores the finished rollout

A model's turn is parsed for tool calls (`parse_tool_calls`) with the tokenizer's `response_template`
(transformers' `parse_response`) where it has one, else in the common format of Hermes, Qwen2.5 and
SmolLM3, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Every call becomes one tool
message for the model (`run_tool_calls`): the function's result, or its error as text - an
exception, arguments that do not fit its signature, an unknown name, a malformed call, or a call
that ran past --tool-timeout. Calls of one turn, and of every row waiting on a tool, run at once:
sync functions each in a daemon thread (a hung one is left behind, never joined), async ones
together on the reward functions' event loop.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.errors import UserError
from rlhf.reward_batch import run_concurrently
from rlhf.user_code import CallTimedOut, bounded_await, import_user_module

TOOL_SPEC_FORMS = "path/to/file.py:fn1,fn2 or package.module:fn1,fn2"
ENVIRONMENT_SPEC_FORMS = "path/to/file.py:Class or package.module:Class"
# The methods of an environment that are not tools (TRL's).
ENVIRONMENT_METHODS = ("reset", "get_reward")
# <tool_call>{...}</tool_call>: Hermes, Qwen2.5, SmolLM3 and the templates in rlhf/data/templates.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass(frozen=True)
class Tool:
    """One callable tool: its name, the function (a bound method for an environment's) and its schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    """{"type": "function", "function": {"name", "description", "parameters"}}, as chat templates read it."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


@dataclass
class ToolCall:
    """A parsed call: a name and its arguments, or why it could not be parsed (`error`)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """A model turn: its text outside the tool calls, the calls, and where the last call ends."""

    content: str
    calls: list[ToolCall]
    end: int
    """Characters of the turn up to the end of its last complete call (the whole turn without one)."""


def tool_from_function(fn: Callable[..., Any], where: str) -> Tool:
    """`fn` as a tool, its schema from its type hints and docstring (a UserError naming `where` otherwise)."""
    from transformers.utils import get_json_schema  # transformers' import time, paid only by runs with tools

    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # TypeHintParsingException, DocstringParsingException
        raise UserError(f"{where}: tool {name!r} has no JSON schema ({' '.join(str(exc).split())[:160]}); give every "
                        "argument a type hint and describe it in a Google-style docstring (Args: ...)") from None
    return Tool(name, fn, schema)


def load_tools(spec: str) -> list[Tool]:
    """The functions `spec` names (file.py:fn1,fn2 or module:fn1,fn2), each as a tool."""
    where, _, names = spec.rpartition(":")
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not where or not wanted or not all(n.isidentifier() for n in wanted):
        raise UserError(f"--tools {spec!r}: expected {TOOL_SPEC_FORMS}")
    module = import_user_module(where, spec, "--tools", TOOL_SPEC_FORMS)
    tools = []
    for name in wanted:
        fn = getattr(module, name, None)
        if not callable(fn):
            raise UserError(f"--tools {spec}: {where} has no function {name!r}")
        tools.append(tool_from_function(fn, f"--tools {spec}"))
    return tools


def load_environment(spec: str) -> Callable[[], Any]:
    """The environment class (or factory) `spec` names; its instances must have a callable `reset`."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise UserError(f"--environment {spec!r}: expected {ENVIRONMENT_SPEC_FORMS}")
    module = import_user_module(where, spec, "--environment", ENVIRONMENT_SPEC_FORMS)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserError(f"--environment {spec}: {where} has no class {name!r}")
    return factory


def make_environment(factory: Callable[[], Any], spec: str) -> Any:
    """One environment instance, checked to have a callable `reset` (TRL's contract)."""
    try:
        environment = factory()
    except Exception as exc:
        raise UserError(f"--environment {spec}: creating an instance raised {type(exc).__name__}: {exc}") from None
    if not callable(getattr(environment, "reset", None)):
        raise UserError(f"--environment {spec}: an environment needs a method reset(**row) returning None or text")
    return environment


def environment_tools(environment: Any, spec: str) -> list[Tool]:
    """An environment instance's public methods (not reset / get_reward) as tools bound to it."""
    names = [n for n, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in ENVIRONMENT_METHODS]
    return [tool_from_function(getattr(environment, n), f"--environment {spec}") for n in names]


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.schema for t in tools]


def _json_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg}); write "
                                f'{TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'the tool call has no "name"')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, f"the arguments of {call['name']!r} are not a JSON object")
    return ToolCall(call["name"], arguments)


def parse_tool_calls(text: str, tokenizer: Any = None, prefix: str = "") -> ParsedTurn:
    """The tool calls of a model turn `text` (decoded without special tokens): with the tokenizer's
    `response_template`, transformers' `parse_response` (`prefix`: the prompt before the turn),
    else every `<tool_call>{json}</tool_call>` block."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix=prefix)
        except Exception as exc:  # a turn the template's parser cannot read: one malformed call
            return ParsedTurn(text, [ToolCall("", {}, f"the turn cannot be parsed ({type(exc).__name__})")], len(text))
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            calls.append(ToolCall(str(function.get("name", "")), arguments) if isinstance(arguments, dict)
                         else ToolCall(str(function.get("name", "")), {}, "the arguments are not a JSON object"))
        return ParsedTurn(str(message.get("content") or ""), calls, len(text))
    matches = list(_TOOL_CALL.finditer(text))
    if not matches:
        return ParsedTurn(text.strip(), [], len(text))
    content = _TOOL_CALL.sub("", text[: matches[-1].end()]).strip()
    return ParsedTurn(content, [_json_call(m.group(1).strip()) for m in matches], matches[-1].end())


def result_text(result: Any) -> str:
    """What the model reads of a tool's result: text as is, JSON for dicts and lists, else str()."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def _error(text: str) -> str:
    return json.dumps({"error": text})


@dataclass
class ToolOutcome:
    """One call's text for the model and how it went: ok, error, timeout, unknown or malformed."""

    name: str
    text: str
    status: str


def _check_call(call: ToolCall, tools: dict[str, Tool]) -> ToolOutcome | None:
    """The outcome of a call that cannot run (malformed, unknown, arguments that do not fit); None if it can."""
    if call.error is not None:
        return ToolOutcome(call.name, _error(call.error), "malformed")
    tool = tools.get(call.name)
    if tool is None:
        return ToolOutcome(call.name, _error(f"no tool {call.name!r}; the tools are {', '.join(sorted(tools))}"),
                           "unknown")
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolOutcome(call.name, _error(f"bad arguments for {call.name}: {exc}"), "error")
    return None


class _Running:
    """A sync call in a daemon thread: its result or exception once it returns."""

    def __init__(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
        self.result: Any = None
        self.exception: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, arguments), daemon=True, name="rlhf-tool")
        self.thread.start()

    def _run(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
        try:
            self.result = fn(**arguments)
        except BaseException as exc:  # reported to the model, never raised in the run
            self.exception = exc


async def _awaited(tool: Tool, arguments: dict[str, Any], timeout: float | None) -> tuple[str, str]:
    try:
        return result_text(await bounded_await(tool.fn(**arguments), timeout)), "ok"
    except CallTimedOut:
        return _error(f"{tool.name} timed out after {timeout:g} s"), "timeout"
    except BaseException as exc:
        return _error(f"{type(exc).__name__}: {exc}"), "error"


def run_tool_calls(calls: list[list[ToolCall]], tools: list[dict[str, Tool]], timeout: float | None
                   ) -> list[list[ToolOutcome]]:
    """Every row's calls (`tools[i]`: row i's tools by name) run at once, each bounded by `timeout`
    seconds (None: no limit); -> per row, one outcome per call in order."""
    outcomes: list[list[ToolOutcome | None]] = [[_check_call(c, t) for c in row] for row, t in zip(calls, tools)]
    threads: dict[tuple[int, int], _Running] = {}
    coroutines: dict[tuple[int, int], Any] = {}
    for i, row in enumerate(calls):
        for j, call in enumerate(row):
            if outcomes[i][j] is None:
                tool = tools[i][call.name]
                if tool.is_async:
                    coroutines[i, j] = _awaited(tool, call.arguments, timeout)
                else:
                    threads[i, j] = _Running(tool.fn, call.arguments)
    if coroutines:
        results = run_concurrently(list(coroutines.values()), timeout, "--tools (async)")
        for (i, j), (text, status) in zip(coroutines, results):
            outcomes[i][j] = ToolOutcome(calls[i][j].name, text, status)
    deadline = None if not timeout else time.monotonic() + timeout
    for (i, j), running in threads.items():
        running.thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        name = calls[i][j].name
        if running.thread.is_alive():
            outcomes[i][j] = ToolOutcome(name, _error(f"{name} timed out after {timeout:g} s"), "timeout")
        elif running.exception is not None:
            exc = running.exception
            outcomes[i][j] = ToolOutcome(name, _error(f"{type(exc).__name__}: {exc}"), "error")
        else:
            outcomes[i][j] = ToolOutcome(name, result_text(running.result), "ok")
    return [[o for o in row if o is not None] for row in outcomes]


def call_reward(environment: Any) -> float | None:
    """An environment's get_reward() (awaited when async), as a float, or None."""
    value = environment.get_reward()
    if inspect.isawaitable(value):
        value = run_concurrently([_as_coroutine(value)])[0]
    return None if value is None else float(value)


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


__all__ = [
    "ENVIRONMENT_METHODS", "ParsedTurn", "Tool", "ToolCall", "ToolOutcome", "call_reward", "environment_tools",
    "load_environment", "load_tools", "make_environment", "parse_tool_calls", "result_text", "run_tool_calls",
    "tool_from_function", "tool_schemas",
]
