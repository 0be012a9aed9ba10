"""Data rows -> their dataset type and chat messages (parsing; rendering is rlhf/data/rendering.py).

The types are those of TRL's dataset-formats guide, each standard (strings) or conversational
(lists of chat messages `{"role", "content", ...}`):

    language modeling     {"text": str}                 {"messages": [...]}
    prompt-only           {"prompt": str}               {"prompt": [...]}
    prompt-completion     {"prompt": str, "completion": str}   (or "response")
                          {"prompt": [...], "completion": [...]}
    preference            {"prompt", "chosen", "rejected"}      explicit prompt
                          {"chosen", "rejected"}                 implicit prompt: the common
                                                                 prefix of chosen and rejected
    unpaired preference   {"prompt", "completion", "label"}      refused: no stage trains on it
    stepwise supervision  {"prompt", "completions", "labels"}    refused: no stage trains on it

plus "\\n\\nHuman: ... \\n\\nAssistant: ..." dialog strings (Anthropic HH) wherever a prompt,
chosen, rejected or text is a string, and an optional `tools` column (JSON schemas, a list or a
JSON string) for conversations with tool calls. A message may carry `tool_calls` (arguments as a
dict or a JSON string; stored as dicts, as Hugging Face chat templates read them), `role: tool`
turns, and multimodal content lists whose text parts are joined in order; an image, audio or
video part is refused (these are text models). `content: None` (an assistant turn that only
calls tools) becomes "" and never the text "None".

Each stage takes the types it can train on (`STAGE_KINDS`) and refuses the others with one line
naming the type and the stage that takes it (`require_kind`). A row is parsed exactly or refused:
never silently changed. (A number where text is expected reaches this module as its text already:
`rlhf.data.sources.numbers_as_text` converts and counts it.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf.data.sources import RawRow
from rlhf.errors import UserError

Message = dict[str, Any]
RowKind = Literal["language modeling", "prompt-only", "prompt-completion", "preference"]

# Columns a format reads that are never passed on to reward functions (TRL passes every other one).
NOT_PASSED_ON = frozenset({"prompt", "completion", "completion_ids"})

_TURN = re.compile(r"(?:^|\n)\s*(Human|Assistant):", re.MULTILINE)
# The roles a chat message may have (those chat templates render); any other is a malformed row.
ROLES = ("system", "user", "assistant", "tool")
_MEDIA_PARTS = ("image", "image_url", "audio", "input_audio", "video", "video_url", "file")

STAGE_KINDS: dict[str, tuple[str, ...]] = {
    "sft": ("language modeling", "prompt-completion", "preference"),
    "reward": ("preference",),
    "dpo": ("preference",),
    "ppo": ("prompt-only", "prompt-completion", "preference", "language modeling"),
}
"""The dataset types each stage trains on (sft on a preference row trains on prompt + chosen; ppo
takes the prompt of any row that has one)."""


@dataclass(frozen=True)
class ParsedRow:
    """A row reduced to its type, its prompt and its completion turns, before rendering."""

    kind: RowKind
    prompt: list[Message]
    """The messages before the first completion turn (for `messages` rows: before the first
    assistant turn; empty for a `text` row)."""
    completion: list[Message] | None = None
    """What follows the prompt in an SFT example: its assistant turns are trained (for a
    preference row: the chosen turns)."""
    chosen: list[Message] | None = None
    rejected: list[Message] | None = None
    text: str | None = None
    """A standard language-modeling row's text: trained whole, no chat template."""
    tools: list[dict[str, Any]] | None = None
    """The row's `tools` column (JSON schemas), rendered by the chat template."""
    margin: float | None = None
    conversational: bool = False
    """The row's prompt (or messages) came as chat messages, not a string (TRL's conversational
    type): reward functions in TRL's convention then get message lists."""
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The row's columns but prompt and completion (what TRL passes a reward function), e.g. a
    ground-truth `answer`."""
    where: str = field(default="a row", compare=False)
    """Where the row came from (file and row), for error messages."""

    @property
    def generation_prompt(self) -> list[Message] | None:
        """What PPO generates after: the prompt, or for a `messages` row every turn before its
        last assistant turn; None for a `text` row."""
        if self.text is not None:
            return None
        if self.kind == "language modeling" and self.completion:
            turns = self.prompt + self.completion
            last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
            return turns[:last]
        return self.prompt

    @property
    def response(self) -> str | None:
        """The content of the completion's last assistant turn (None without one)."""
        return last_assistant_content(self.completion)


def last_assistant_content(messages: list[Message] | None) -> str | None:
    for message in reversed(messages or []):
        if message["role"] == "assistant":
            return message["content"]
    return None


def require_kind(row: ParsedRow, stage: str, where: str) -> None:
    """A one-line UserError when `stage` does not train on the row's type, naming who does."""
    if row.kind in STAGE_KINDS[stage] and not (stage == "ppo" and row.generation_prompt is None):
        return
    kind = "standard language-modeling ('text')" if row.text is not None else row.kind
    takers = [s for s, kinds in STAGE_KINDS.items() if row.kind in kinds and s != stage
              and not (s == "ppo" and row.text is not None)]
    wants = {"sft": "demonstrations (text, messages, prompt/completion, or pairs: prompt + chosen)",
             "reward": "preference pairs (chosen/rejected, with or without a prompt)",
             "dpo": "preference pairs (chosen/rejected, with or without a prompt)",
             "ppo": "prompts (prompt, messages, or any row with a prompt)"}[stage]
    takes = f"; rlhf {' or rlhf '.join(takers)} takes it" if takers else ""
    raise UserError(f"{where}: a {kind} row; rlhf {stage} trains on {wants}{takes}")


def parse_dialog(text: str, where: str) -> list[Message]:
    """Split a "Human: ... Assistant: ..." string into chat messages."""
    matches = list(_TURN.finditer(text))
    if not matches:
        raise UserError(f"{where}: dialog has no 'Human:' or 'Assistant:' turns")
    messages = []
    for m, nxt in zip(matches, [*matches[1:], None]):
        end = nxt.start() if nxt else len(text)
        role = "user" if m.group(1) == "Human" else "assistant"
        messages.append({"role": role, "content": text[m.end() : end].strip()})
    return messages


def is_dialog(text: str) -> bool:
    """An Anthropic-HH dialog string: it starts with a 'Human:' turn."""
    return bool(re.match(r"\s*Human:", text)) and _TURN.search(text) is not None


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, None (-> ""), or a list of parts whose text parts
    are joined in order; media parts are refused."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in _MEDIA_PARTS:
                raise UserError(f"{where}: has a {kind} part; this project trains text models: drop the "
                                "non-text parts or the row")
            else:
                raise UserError(f"{where}: content part {_short(part)} is not {{'type': 'text', 'text': ...}}")
        return "".join(texts)
    raise UserError(f"{where}: content must be a string or a list of text parts, got {type(value).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call as chat templates read it: {"type": "function", "function": {"name", "arguments": dict}}."""
    if not isinstance(call, dict):
        raise UserError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: a tool call has no function name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: tool call {name!r} has arguments that are not valid JSON ({exc.msg})") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise UserError(f"{where}: tool call {name!r} arguments must be a JSON object, got {_short(arguments)}")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": _without_nulls(arguments)}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _message(m: Any, where: str) -> Message:
    if not isinstance(m, dict) or "role" not in m:
        raise UserError(f"{where}: must be a {{role, content}} message")
    role = m["role"]
    if role not in ROLES:
        raise UserError(f"{where}: has role {role!r}; accepted roles: {', '.join(ROLES)}")
    calls = m.get("tool_calls")
    if "content" not in m and not calls:
        raise UserError(f"{where}: a {role} message has no content")
    if m.get("content") is None and not calls:
        raise UserError(f"{where}: a {role} message has content None (only an assistant turn with tool_calls may)")
    message: Message = {"role": role, "content": _content(m.get("content"), where)}
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise UserError(f"{where}: tool_calls must be a list on an assistant message")
        message["tool_calls"] = [_tool_call(c, f"{where} tool call {i}") for i, c in enumerate(calls)]
    # Other keys templates read (name, tool_call_id, reasoning_content, ...); a None is a column
    # that this row does not use (Arrow gives every struct all keys).
    for key, value in m.items():
        if key not in ("role", "content", "tool_calls") and value is not None:
            message[key] = value
    return message


def _messages(value: list[Any], where: str, field_name: str) -> list[Message]:
    if not value:
        raise UserError(f"{where}: field '{field_name}' is an empty list of messages")
    return [_message(m, f"{where} field '{field_name}' message {i}") for i, m in enumerate(value)]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _prompt(value: Any, where: str, field_name: str = "prompt") -> list[Message]:
    """A prompt column: a string (one user turn, or a dialog) or chat messages."""
    if isinstance(value, str):
        if is_dialog(value):
            msgs = parse_dialog(value, f"{where} field '{field_name}'")
            if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
                msgs = msgs[:-1]  # a trailing empty "Assistant:" cue
            return msgs
        if not value.strip():
            raise UserError(f"{where}: field '{field_name}' is empty")
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return _messages(value, where, field_name)
    raise UserError(f"{where}: field '{field_name}' must be a string or a list of {{role, content}} messages")


def _turns(value: Any, where: str, field_name: str) -> list[Message]:
    """A completion-like column (completion, response, chosen, rejected): a plain string is one
    assistant turn (stripped, as the HH data is), a dialog string or messages as they are."""
    if isinstance(value, str):
        if is_dialog(value):
            return parse_dialog(value, f"{where} field '{field_name}'")
        if not value.strip():
            raise UserError(f"{where}: field '{field_name}' is empty")
        return [{"role": "assistant", "content": value.strip()}]
    if isinstance(value, list):
        return _messages(value, where, field_name)
    raise UserError(f"{where}: field '{field_name}' must be a string or a list of {{role, content}} messages "
                    f"(got {_short(value)})")


def parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: field 'tools' is a string that is not JSON ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise UserError(f"{where}: field 'tools' must be a list of JSON schemas (objects)")
    return [_without_nulls(t) for t in value] or None


def _common_prefix(a: list[Message], b: list[Message]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _has_assistant(messages: list[Message]) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def _preference(d: dict[str, Any], where: str) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen, rejected) turns: an explicit prompt, plus the common prefix of chosen
    and rejected (chosen and rejected that repeat the prompt, as ultrafeedback_binarized's do,
    lose it; a multi-turn pair's shared turns join the prompt)."""
    explicit = d.get("prompt") is not None
    prompt = _prompt(d["prompt"], where) if explicit else []
    chosen, rejected = _turns(d["chosen"], where, "chosen"), _turns(d["rejected"], where, "rejected")
    if explicit and chosen[: len(prompt)] == prompt and rejected[: len(prompt)] == prompt:
        chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    shared = _common_prefix(chosen, rejected)
    if shared == len(chosen) == len(rejected):
        shared = max(i for i, m in enumerate(chosen) if m["role"] == "assistant") if _has_assistant(chosen) else 0
    prompt, chosen, rejected = prompt + chosen[:shared], chosen[shared:], rejected[shared:]
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not turns or turns[0]["role"] != "assistant":
            raise UserError(f"{where}: field '{name}' must continue the prompt with an assistant turn (chosen and "
                            "rejected differ first at a non-assistant turn, or one is a prefix of the other)")
    if not prompt:
        raise UserError(f"{where}: no prompt: add a 'prompt' column, or give chosen/rejected as dialogs or messages "
                        "that start with the user's turn")
    return prompt, chosen, rejected


def parse_row(row: RawRow) -> ParsedRow:
    """Recognise the row's type; raise a UserError naming file, row and field when malformed.
    Every column but prompt and completion is kept in `fields` (for reward functions)."""
    d, where = row.data, row.where
    fields = {k: v for k, v in d.items() if k not in NOT_PASSED_ON}
    tools = parse_tools(d.get("tools"), where)
    margin = d.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise UserError(f"{where}: field 'margin' must be a number")
    if "chosen" in d and "rejected" in d:
        prompt, chosen, rejected = _preference(d, where)
        conversational = any(isinstance(d.get(k), list) for k in ("prompt", "chosen", "rejected"))
        return ParsedRow("preference", prompt, completion=chosen, chosen=chosen, rejected=rejected, tools=tools,
                         margin=float(margin) if margin is not None else None, conversational=conversational,
                         fields=fields, where=where)
    if "messages" in d:
        if not isinstance(d["messages"], list):
            raise UserError(f"{where}: field 'messages' must be a list of {{role, content}} messages")
        msgs = _messages(d["messages"], where, "messages")
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        return ParsedRow("language modeling", msgs[:first], completion=msgs[first:] or None, tools=tools,
                         conversational=True, fields=fields, where=where)
    if "completions" in d and "labels" in d:
        raise UserError(f"{where}: a stepwise-supervision row (prompt, completions, labels); no stage trains on this "
                        "type (process reward models): convert it to preference pairs for rlhf reward")
    if "completion" in d and "label" in d:
        raise UserError(f"{where}: an unpaired-preference row (prompt, completion, label), as KTO trains on; no stage "
                        "trains on this type: pair the completions into chosen/rejected for rlhf reward")
    if "prompt" in d:
        prompt = _prompt(d["prompt"], where)
        conversational = isinstance(d["prompt"], list)
        response_field = "response" if "response" in d else "completion" if "completion" in d else None
        if response_field is None:
            return ParsedRow("prompt-only", prompt, tools=tools, conversational=conversational, fields=fields,
                             where=where)
        value = d[response_field]
        if not (isinstance(value, list) or (isinstance(value, str) and value.strip())):
            raise UserError(f"{where}: field '{response_field}' must be a non-empty string or a list of messages "
                            f"(got {_short(value)})")
        completion = _turns(value, where, response_field)
        if not _has_assistant(completion):
            raise UserError(f"{where}: field '{response_field}' has no assistant turn to train on")
        return ParsedRow("prompt-completion", prompt, completion=completion, tools=tools,
                         conversational=conversational, fields=fields, where=where)
    if "text" in d:
        text = d["text"]
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: field 'text' must be a non-empty string")
        if is_dialog(text):
            msgs = parse_dialog(text, f"{where} field 'text'")
            first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
            return ParsedRow("language modeling", msgs[:first], completion=msgs[first:] or None, fields=fields,
                             where=where)
        return ParsedRow("language modeling", [], text=text, fields=fields, where=where)
    raise UserError(
        f"{where}: unrecognised row with fields {sorted(d)}; expected text, messages, prompt (+ completion), or "
        "chosen/rejected (+ prompt); rename columns with --data-columns NEW=OLD"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["Message", "ParsedRow", "RowKind", "STAGE_KINDS", "is_dialog", "last_assistant_content", "parse_dialog",
           "parse_row", "parse_tools", "require_kind"]
