"""Tool-using rollouts: prompts rendered with the tools, turns answered by running their calls.

    setup = load_tool_setup(config, tokenizer)        # --tools, --environment; None without both
    rollout = ToolRollout(setup, tokenizer, messages, fields)   # one batch of rollout rows
    out = generate_turns(model, *rollout.prompt_batch(), params, generator, rollout.respond)
    rollout.trajectories, rollout.responses, rollout.metrics()

`ToolRollout` makes one --environment instance per row and calls its `reset(**row)` (text it returns
is appended to the row's last user message), renders every prompt with the tool schemas, and
answers each model turn (engine/multi_turn.py): the turn's text is parsed for tool calls
(`rlhf.tools.parse_tool_calls`); a turn without one ends the row, so does one past
--max-tool-calls; the calls of every waiting row run at once (`run_tool_calls`), and the tool
messages are rendered by the chat template into the ids appended after the turn: what rendering
the conversation with the tool messages and the cue for the next assistant turn adds after the
assistant's turn (the template's end of that turn included when the model stopped at the end of
its call rather than at EOS). A template whose turns do not only append is refused, as in SFT.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlhf.config import PPOConfig
from rlhf.data.formats import Message
from rlhf.data.rendering import check_tools_rendered, render_messages
from rlhf.data.tokenization import encode_continuation, encode_prompt
from rlhf.engine.generation import GenerationOutput
from rlhf.engine.multi_turn import Turn, TurnEnd
from rlhf.errors import UserError
from rlhf.tools import (
    TOOL_CALL_CLOSE, ParsedTurn, Tool, environment_tools, load_environment, load_tools, make_environment,
    parse_tool_calls, run_tool_calls, tool_schemas,
)


@dataclass
class ToolSetup:
    """A run's tools: the --tools functions, the --environment factory, the limits."""

    tools: list[Tool]
    environment: Any  # the factory (a class), or None
    environment_spec: str | None
    schemas: list[dict[str, Any]]
    """What every prompt renders: the --tools' schemas, then the environment's methods'."""
    max_tool_calls: int
    timeout: float | None

    @property
    def environment_rewards(self) -> bool:
        """The environment scores its rollouts (it defines get_reward)."""
        return self.environment is not None and callable(getattr(self.environment, "get_reward", None))

    @property
    def environment_name(self) -> str:
        return getattr(self.environment, "__name__", "environment")


def grouped_tool_specs(specs: list[str]) -> list[str]:
    """--tools values as file:fn1,fn2 specs: a config file's `tools: a.py:f,g` arrives split at its commas."""
    grouped: list[str] = []
    for spec in specs:
        if ":" not in spec and grouped:
            grouped[-1] += f",{spec}"
        else:
            grouped.append(spec)
    return grouped


def load_tool_setup(config: PPOConfig) -> ToolSetup | None:
    """The tools of `config` (--tools, --environment), checked and their schemas made; None without any."""
    return tool_setup(config.tools, config.environment, config.max_tool_calls, config.tool_timeout)


def tool_setup(tool_specs: list[str], environment: str | None, max_tool_calls: int = 8,
               timeout: float = 30.0) -> ToolSetup | None:
    """`load_tool_setup` from the values of --tools, --environment, --max-tool-calls, --tool-timeout."""
    if not tool_specs and not environment:
        return None
    tools = [t for spec in grouped_tool_specs(tool_specs) for t in load_tools(spec)]
    factory = load_environment(environment) if environment else None
    schemas = tool_schemas(tools)
    if factory is not None:
        assert environment is not None
        probe = make_environment(factory, environment)
        schemas += tool_schemas(environment_tools(probe, environment))
    names = [s["function"]["name"] for s in schemas]
    duplicated = sorted(n for n, c in Counter(names).items() if c > 1)
    if duplicated:
        raise UserError(f"--tools / --environment: two tools are called {duplicated[0]!r}; tool names must be unique")
    if not schemas:
        raise UserError(f"--environment {environment}: the environment has no public method to call as a tool")
    return ToolSetup(tools, factory, environment, schemas, max_tool_calls, timeout or None)


def check_template_renders_tools(tokenizer: Any, schemas: list[dict[str, Any]], where: str) -> None:
    """Refuse a chat template that renders no tools (the model would never see what it may call)."""
    probe: list[Message] = [{"role": "user", "content": "Hi"}]
    text = render_messages(probe, tokenizer, schemas, add_generation_prompt=True, where=where)
    check_tools_rendered(text, probe, schemas, where)


def trajectory_text(messages: list[Message]) -> str:
    """A rollout's turns as one readable text (the sample table's `trajectory`)."""
    lines = []
    for m in messages:
        if m["role"] == "tool":
            lines.append(f"[{m.get('name') or 'tool'}] -> {m['content']}")
            continue
        calls = "".join(f" <call {c['function']['name']}({c['function']['arguments']})>" for c in m.get("tool_calls", ()))
        lines.append(f"assistant: {m['content']}{calls}")
    return "\n".join(lines)


def cut_after(tokens: list[int], chars: int, tokenizer: Any) -> int:
    """The fewest leading tokens whose text holds the first `chars` characters of the turn's."""
    for k in range(1, len(tokens) + 1):
        if len(tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= chars:
            return k
    return len(tokens)


def response_ids(out: GenerationOutput) -> list[list[int]]:
    """Each row's response ids as TRL's completion_ids: every token after the prompt up to the
    end, sampled or appended (a tool response), up to and including EOS."""
    start = out.prompt_length
    sequences, mask = out.sequences[:, start:].cpu(), out.attention_mask[:, start:].bool().cpu()
    return [s[m].tolist() for s, m in zip(sequences, mask)]


class ToolRollout:
    """One batch of tool rollouts (see the module docstring): row i's prompt `messages[i]`, data `fields[i]`."""

    def __init__(self, setup: ToolSetup, tokenizer: Any, messages: list[list[Message]],
                 fields: list[dict[str, Any]]) -> None:
        self.setup, self.tokenizer = setup, tokenizer
        self.environments: list[Any] | None = None
        self.prompts = [list(m) for m in messages]
        tools = {t.name: t for t in setup.tools}
        self.tools: list[dict[str, Tool]] = [tools] * len(messages)
        if setup.environment is not None:
            assert setup.environment_spec is not None
            self.environments = [make_environment(setup.environment, setup.environment_spec) for _ in messages]
            self.tools = []
            for i, (environment, row) in enumerate(zip(self.environments, fields)):
                self.tools.append({**tools, **{t.name: t for t in environment_tools(environment,
                                                                                    setup.environment_spec)}})
                suffix = environment.reset(**row)
                if suffix is not None:
                    self.prompts[i] = self._appended(self.prompts[i], suffix)
        self.trajectories: list[list[Message]] = [[] for _ in messages]
        self.responses = [""] * len(messages)
        self.calls = [0] * len(messages)
        self.outcomes: Counter[str] = Counter()
        self.over_limit = 0

    def _appended(self, prompt: list[Message], suffix: Any) -> list[Message]:
        if not isinstance(suffix, str):
            raise UserError(f"--environment {self.setup.environment_spec}: reset() returned {type(suffix).__name__}; "
                            "return None or the text to append to the last user message")
        last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=len(prompt) - 1)
        return [*prompt[:last], {**prompt[last], "content": prompt[last]["content"] + suffix}, *prompt[last + 1:]]

    def prompt_text(self, row: int) -> str:
        return render_messages(self.prompts[row], self.tokenizer, self.setup.schemas, add_generation_prompt=True,
                               where="a tool rollout's prompt")

    def prompt_ids(self) -> list[list[int]]:
        """Each row's prompt, rendered with the tools, as ids."""
        return [encode_prompt(self.prompt_text(i), self.tokenizer) for i in range(len(self.prompts))]

    def respond(self, turns: list[Turn]) -> list[TurnEnd | None]:
        """Each turn's end (engine/multi_turn.py): None for a final answer, else its calls' responses as ids."""
        ends: list[TurnEnd | None] = [None] * len(turns)
        waiting: list[tuple[int, Turn, ParsedTurn]] = []
        for k, turn in enumerate(turns):
            text = self.tokenizer.decode(turn.tokens, skip_special_tokens=True)
            templated = getattr(self.tokenizer, "response_template", None) is not None
            parsed = parse_tool_calls(text, self.tokenizer, prefix=self.prompt_text(turn.row) if templated else "")
            row = turn.row
            if parsed.calls and self.calls[row] >= self.setup.max_tool_calls:
                self.over_limit += 1
            if not parsed.calls or self.calls[row] >= self.setup.max_tool_calls or turn.remaining == 0:
                self.trajectories[row].append({"role": "assistant", "content": text.strip()})
                self.responses[row] = text.strip()
                continue
            waiting.append((k, turn, parsed))
        outcomes = run_tool_calls([p.calls for _, _, p in waiting], [self.tools[t.row] for _, t, _ in waiting],
                                  self.setup.timeout)
        for (k, turn, parsed), results in zip(waiting, outcomes):
            row = turn.row
            self.calls[row] += 1
            self.outcomes.update(o.status for o in results)
            assistant: Message = {"role": "assistant", "content": parsed.content,
                                  "tool_calls": [c.as_message_call() for c in parsed.calls if c.error is None]}
            answers: list[Message] = [{"role": "tool", "name": o.name, "content": o.text} for o in results]
            keep = len(turn.tokens) if turn.ended_with_eos else cut_after(turn.tokens, parsed.end, self.tokenizer)
            suffix = self._tool_suffix(row, assistant, answers, stopped_at_eos=keep == len(turn.tokens)
                                       and turn.ended_with_eos)
            self.trajectories[row] += [assistant, *answers]
            ends[k] = TurnEnd(keep, encode_continuation(suffix, self.tokenizer))
        return ends

    def _tool_suffix(self, row: int, assistant: Message, answers: list[Message], stopped_at_eos: bool) -> str:
        """The text after the model's turn: the rest of its assistant turn as the template writes it
        (after its EOS, or after the end of its last call), the tool messages and the next cue."""
        where = "a tool rollout"
        before = [*self.prompts[row], *self.trajectories[row], assistant]
        with_turn = render_messages(before, self.tokenizer, self.setup.schemas, where=where)
        with_answers = render_messages([*before, *answers], self.tokenizer, self.setup.schemas,
                                       add_generation_prompt=True, where=where)
        if not with_answers.startswith(with_turn):
            raise UserError(f"{where}: the chat template renders the assistant's tool-call turn differently once tool "
                            "messages follow, so their tokens cannot be appended exactly; pass --chat-template "
                            "FILE.jinja with a template whose turns only append")
        eos = self.tokenizer.eos_token or ""
        at_eos = with_turn.rfind(eos) if eos else -1
        at_call = with_turn.rfind(TOOL_CALL_CLOSE)
        if stopped_at_eos:
            close = with_turn[at_eos + len(eos):] if at_eos >= 0 else ""
        elif at_call >= 0:
            close = with_turn[at_call + len(TOOL_CALL_CLOSE):]
        else:
            close = with_turn[at_eos:] if at_eos >= 0 else ""
        return close + with_answers[len(with_turn):]

    def metrics(self) -> dict[str, float]:
        """This batch's tool counts (sums; the caller reduces them over ranks)."""
        counts = {f"tool_calls_{status}": float(self.outcomes[status])
                  for status in ("ok", "error", "timeout", "unknown", "malformed")}
        return {"tool_calls": float(sum(self.outcomes.values())), **counts,
                "tool_turns": float(sum(self.calls)), "tool_calls_over_limit": float(self.over_limit)}


__all__ = ["ToolRollout", "ToolSetup", "check_template_renders_tools", "cut_after", "grouped_tool_specs",
           "load_tool_setup", "response_ids", "tool_setup", "trajectory_text"]
