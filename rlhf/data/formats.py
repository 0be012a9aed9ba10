"""Row formats -> rendered text examples.

Accepted rows (field names as in the common public datasets):

    {"prompt": str, "response": str}              SFT ("completion" is accepted for "response")
    {"prompt": str, "chosen": str, "rejected": str}   pairs; SFT trains on prompt + chosen
    {"chosen": dialog, "rejected": dialog}        "Human: ... Assistant: ..." dialogs (Anthropic HH);
                                                  the prompt is everything before the last
                                                  "Assistant:" turn
    {"text": dialog}                              one dialog for SFT
    {"messages": [{"role", "content"}, ...]}      chat; last assistant turn is the response
    {"prompt": [...], "chosen": [...], "rejected": [...]}   chat-format pairs
    {"prompt": str | messages}                    prompts only (PPO)

Every prompt becomes a list of chat messages and is rendered with the tokenizer's chat template
when it has one, else in the "\\n\\nHuman: ...\\n\\nAssistant:" format with an EOS after the
response. Prompt and response are rendered separately so the boundary between them is exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf.data.sources import RawRow
from rlhf.errors import UserError

Message = dict[str, str]

# Columns the formats read; every other column of a row is kept in ParsedRow.fields.
CONSUMED_FIELDS = frozenset({"prompt", "messages", "text", "response", "completion", "chosen", "rejected", "margin"})

_TURN = re.compile(r"(?:^|\n)\s*(Human|Assistant):", re.MULTILINE)
# The roles a chat message may have (those chat templates render); any other is a malformed row.
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ParsedRow:
    """A row reduced to a prompt (chat messages) and its responses, before rendering."""

    prompt: list[Message]
    response: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    margin: float | None = None
    conversational: bool = False
    """The row's prompt (or messages) came as chat messages, not a string (TRL's conversational
    type): reward functions in TRL's convention then get message lists."""
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The row's other columns (all but CONSUMED_FIELDS), e.g. a ground-truth `answer` that a reward
    function reads."""


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


def _as_messages(value: Any, where: str, field: str) -> list[Message]:
    if isinstance(value, str):
        if _TURN.search(value):
            msgs = parse_dialog(value, f"{where} field '{field}'")
            if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
                msgs = msgs[:-1]  # a trailing empty "Assistant:" cue
            return msgs
        if not value.strip():
            raise UserError(f"{where}: field '{field}' is empty")
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        for m in value:
            if m["role"] not in ROLES:
                raise UserError(f"{where}: field '{field}' has a message with role {m['role']!r}; accepted roles: "
                                f"{', '.join(ROLES)}")
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise UserError(f"{where}: field '{field}' must be a string or a list of {{role, content}} messages")


def _split_last_assistant(messages: list[Message], where: str, field: str) -> tuple[list[Message], str]:
    if not messages or messages[-1]["role"] != "assistant":
        raise UserError(f"{where}: field '{field}' must end with an assistant turn")
    if len(messages) < 2:
        raise UserError(f"{where}: field '{field}' has no prompt before the assistant turn")
    return messages[:-1], messages[-1]["content"]


def _response_text(value: Any, where: str, field: str) -> str:
    if isinstance(value, str):
        return value.strip() if _TURN.search(value) is None else _split_last_assistant(
            _as_messages(value, where, field), where, field)[1]
    if isinstance(value, list):
        msgs = _as_messages(value, where, field)
        if msgs and msgs[-1]["role"] == "assistant":
            return msgs[-1]["content"]
    raise UserError(f"{where}: field '{field}' must be a string (or messages ending with an assistant turn)")


def parse_row(row: RawRow) -> ParsedRow:
    """Recognise the row's format; raise a UserError naming file, row and field when malformed.
    The columns no format reads are kept in `fields`."""
    parsed = _parse_format(row)
    return replace(parsed, fields={k: v for k, v in row.data.items() if k not in CONSUMED_FIELDS})


def _parse_format(row: RawRow) -> ParsedRow:
    d, where = row.data, row.where
    margin = d.get("margin")
    if margin is not None and not isinstance(margin, (int, float)):
        raise UserError(f"{where}: field 'margin' must be a number")
    if "messages" in d:
        msgs = _as_messages(d["messages"], where, "messages")
        if msgs and msgs[-1]["role"] == "assistant":
            prompt, response = _split_last_assistant(msgs, where, "messages")
            return ParsedRow(prompt, response=response)
        return ParsedRow(msgs)
    if "chosen" in d and "rejected" in d:
        if "prompt" in d and d["prompt"] is not None:
            prompt = _as_messages(d["prompt"], where, "prompt")
        else:
            chosen_msgs = _as_messages(d["chosen"], where, "chosen")
            prompt, _ = _split_last_assistant(chosen_msgs, where, "chosen")
        chosen = _response_text(d["chosen"], where, "chosen")
        rejected = _response_text(d["rejected"], where, "rejected")
        return ParsedRow(prompt, response=chosen, chosen=chosen, rejected=rejected,
                         margin=float(margin) if margin is not None else None)
    if "prompt" in d:
        prompt = _as_messages(d["prompt"], where, "prompt")
        response_field = "response" if "response" in d else "completion" if "completion" in d else None
        if response_field is None:
            return ParsedRow(prompt)
        value = d[response_field]
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{where}: field '{response_field}' must be a non-empty string (got {value!r})")
        return ParsedRow(prompt, response=value.strip())
    if "text" in d:
        prompt, response = _split_last_assistant(_as_messages(d["text"], where, "text"), where, "text")
        return ParsedRow(prompt, response=response)
    raise UserError(
        f"{where}: unrecognised row with fields {sorted(d)}; expected prompt/response, prompt/chosen/rejected, "
        "chosen/rejected dialogs, messages, or text"
    )


# ------------------------------------------------------------------ rendering


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(messages: list[Message], tokenizer: Any) -> str:
    """The prompt text, ending with the cue for the assistant's reply."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [f"\n\n{'Human' if m['role'] != 'assistant' else 'Assistant'}: {m['content']}" for m in messages]
    return "".join(parts) + "\n\nAssistant:"


def render_response(messages: list[Message], response: str, tokenizer: Any) -> str:
    """The response text as it follows `render_prompt(messages)`, ending with the EOS token.

    This is the one rendering of a scored (or trained) response: it ends exactly where a rollout
    stops, at the tokenizer's EOS. Chat templates often add text after the end-of-turn token
    (ChatML writes `<|im_end|>\n`); that tail is cut, so the reward model is trained on the same
    last token that PPO scores, and SFT teaches the model to stop there.
    """
    if has_chat_template(tokenizer):
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False
        )
        if full.startswith(prompt):
            return cut_after_eos(full[len(prompt):], tokenizer.eos_token)
        # Templates that rewrite earlier turns: fall back to the plain continuation.
    return f" {response}{tokenizer.eos_token or ''}"


def cut_after_eos(text: str, eos_token: str | None) -> str:
    """`text` up to and including its last EOS token (unchanged when it has none)."""
    if not eos_token:
        return text
    end = text.rfind(eos_token)
    return text if end < 0 else text[: end + len(eos_token)]
