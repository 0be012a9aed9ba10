"""Tools in TRL's conventions: loading, schemas, parsing calls, running them (errors, timeouts, async)."""

from __future__ import annotations

import time

import pytest

from rlhf.errors import UserError
from rlhf.tools import (
    ToolCall, environment_tools, load_environment, load_tools, parse_tool_calls, run_tool_calls, tool_from_function,
)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("disk on fire")


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


async def async_add(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first
        b: the second
    """
    return a + b


def tools_by_name(*fns):
    return {t.name: t for t in (tool_from_function(f, "test") for f in fns)}


def test_schema_from_type_hints_and_docstring():
    schema = tool_from_function(add, "test").schema
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"


def test_function_without_docstring_is_refused_in_one_line():
    def bare(a: int) -> int:
        return a

    with pytest.raises(UserError, match="bare.*type hint.*docstring"):
        tool_from_function(bare, "--tools x.py:bare")


def test_load_tools_from_a_file_by_names(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text('def up(text: str) -> str:\n    """Upper.\n\n    Args:\n        text: the text\n    """\n'
                    '    return text.upper()\n\n\ndef down(text: str) -> str:\n    """Lower.\n\n    Args:\n'
                    '        text: the text\n    """\n    return text.lower()\n')
    tools = load_tools(f"{path}:up,down")
    assert [t.name for t in tools] == ["up", "down"]
    with pytest.raises(UserError, match="has no function 'sideways'"):
        load_tools(f"{path}:up,sideways")


def test_parse_the_common_tool_call_format():
    turn = parse_tool_calls('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> tail')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert turn.content == "Let me see."
    assert turn.end == len('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    # Arguments written as a JSON string, and a malformed call, which becomes an error for the model.
    turn = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>')
    assert turn.calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert turn.calls[1].error is not None and "not valid JSON" in turn.calls[1].error
    assert parse_tool_calls("42").calls == []


def test_calls_run_and_every_failure_is_text_for_the_model():
    tools = tools_by_name(add, broken, slow, async_add)
    calls = [[ToolCall("add", {"a": 2, "b": 3}), ToolCall("broken", {"x": "y"})],
             [ToolCall("add", {"a": 1}), ToolCall("nope", {}), ToolCall("", {}, "the tool call is not valid JSON")],
             [ToolCall("async_add", {"a": 4, "b": 5})]]
    outcomes = run_tool_calls(calls, [tools] * 3, timeout=5.0)
    assert [(o.text, o.status) for o in outcomes[0]] == [("5", "ok"), ('{"error": "RuntimeError: disk on fire"}', "error")]
    assert [o.status for o in outcomes[1]] == ["error", "unknown", "malformed"]
    assert "bad arguments for add" in outcomes[1][0].text and "the tools are add" in outcomes[1][1].text
    assert (outcomes[2][0].text, outcomes[2][0].status) == ("9", "ok")


def test_a_hung_tool_times_out_without_blocking_the_other_rows():
    tools = tools_by_name(add, slow)
    started = time.monotonic()
    outcomes = run_tool_calls([[ToolCall("slow", {"seconds": 30})], [ToolCall("add", {"a": 1, "b": 1})]],
                              [tools, tools], timeout=0.5)
    assert time.monotonic() - started < 5
    assert outcomes[0][0].status == "timeout" and "timed out after 0.5 s" in outcomes[0][0].text
    assert outcomes[1][0].text == "2"


def test_environment_methods_are_its_tools(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def reset(self, **row):\n"
                    "        self.n = 0\n\n    def bump(self, by: int) -> int:\n        \"\"\"Bump.\n\n        Args:\n"
                    "            by: how much\n        \"\"\"\n        self.n += by\n        return self.n\n\n"
                    "    def get_reward(self):\n        return float(self.n)\n\n    def _hidden(self):\n"
                    "        pass\n")
    factory = load_environment(f"{path}:Counter")
    env = factory()
    tools = {t.name: t for t in environment_tools(env, "env")}
    assert list(tools) == ["bump"]
    run_tool_calls([[ToolCall("bump", {"by": 3})]], [tools], timeout=None)
    assert env.get_reward() == 3.0
