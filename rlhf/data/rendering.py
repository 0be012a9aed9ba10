"""Chat messages -> the exact text a stage tokenizes, in pieces that are trained or not.

Every rendering goes through `render_messages`: the tokenizer's chat template (with the row's
`tools`) when it has one, else the plain "\\n\\nHuman: ...\\n\\nAssistant: ...<eos>" format, which
cannot show tool calls (such a row is refused). A conversation is cut into pieces at its
assistant turns by rendering its prefixes: the text before assistant turn i is the rendering of
turns [0, i) with the generation prompt, the turn itself is what rendering [0, i] adds to it, up to
and including the EOS token. Chat templates often add text after the end-of-turn token (ChatML
writes `<|im_end|>\\n`); after the last assistant turn that tail is cut, so a trained response
ends exactly where a rollout stops, at the tokenizer's EOS. A template that renders earlier turns
differently once later ones follow cannot be cut exactly: the row is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.data.formats import Message, ParsedRow
from rlhf.errors import UserError


@dataclass(frozen=True)
class Piece:
    """A stretch of rendered text; `trained` pieces are in the loss (SFT) or scored (reward)."""

    text: str
    trained: bool


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _plain(messages: list[Message], tokenizer: Any, add_generation_prompt: bool, where: str) -> str:
    """The "Human: / Assistant:" rendering of a tokenizer without a chat template."""
    parts = []
    for m in messages:
        if m["role"] == "tool" or m.get("tool_calls"):
            raise UserError(f"{where}: the tokenizer has no chat template, and the plain Human/Assistant format cannot "
                            "show tool calls; pass --chat-template FILE.jinja with a template that renders them")
        if m["role"] == "assistant":
            parts.append(f"\n\nAssistant: {m['content']}{tokenizer.eos_token or ''}")
        else:
            parts.append(f"\n\nHuman: {m['content']}")
    return "".join(parts) + ("\n\nAssistant:" if add_generation_prompt else "")


def render_messages(messages: list[Message], tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False, where: str = "a row") -> str:
    """The text of `messages` (ending with the cue for the assistant's reply when
    `add_generation_prompt`), or one UserError naming `where` when the template cannot render it."""
    if not has_chat_template(tokenizer):
        if tools:
            raise UserError(f"{where}: has a 'tools' column but the tokenizer has no chat template to render it; "
                            "pass --chat-template FILE.jinja")
        return _plain(messages, tokenizer, add_generation_prompt, where)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja2's TemplateError, or what a template raises itself
        raise UserError(f"{where}: the chat template cannot render this row ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:200]}); fix the row or pass --chat-template FILE.jinja"
                        ) from None


def check_tools_rendered(text: str, messages: list[Message], tools: list[dict[str, Any]] | None, where: str) -> None:
    """Refuse a template that drops the row's tool calls or tool schemas (it renders the turns
    without them, silently): every called function's and every tool's name must be in the text."""
    names = [c["function"]["name"] for m in messages for c in m.get("tool_calls", ())]
    names += [t.get("function", t).get("name") for t in tools or () if isinstance(t.get("function", t), dict)]
    missing = [n for n in names if isinstance(n, str) and n not in text]
    if missing:
        raise UserError(f"{where}: the chat template does not render tool calls or tools (the name {missing[0]!r} is "
                        "missing from the rendered text); pass --chat-template FILE.jinja with one that does")


def cut_after_eos(text: str, eos_token: str | None) -> str:
    """`text` up to and including its last EOS token (unchanged when it has none)."""
    if not eos_token:
        return text
    end = text.rfind(eos_token)
    return text if end < 0 else text[: end + len(eos_token)]


def _inconsistent(where: str, turn: int) -> UserError:
    return UserError(f"{where}: the chat template renders the turns before message {turn} differently once that "
                     "turn follows (e.g. it drops earlier reasoning), so the trained text cannot be cut out exactly; "
                     "pass --chat-template FILE.jinja with a template whose turns only append")


def render_conversation(messages: list[Message], trained: list[int], tokenizer: Any,
                        tools: list[dict[str, Any]] | None = None, where: str = "a row") -> list[Piece]:
    """`messages` as pieces whose concatenation is their rendering, the assistant turns at the
    indices `trained` (ascending) as trained pieces, each ending with the EOS. The text after the
    last trained turn's EOS is cut when that turn ends the conversation; the first piece is the
    untrained text before the first trained turn (the prompt)."""
    full = render_messages(messages, tokenizer, tools, where=where)
    check_tools_rendered(full, messages, tools, where)
    pieces, at = [], 0
    for i in trained:
        before = render_messages(messages[:i], tokenizer, tools, add_generation_prompt=True, where=where)
        through = render_messages(messages[: i + 1], tokenizer, tools, where=where)
        if len(before) < at or not (through.startswith(before) and full.startswith(through)):
            raise _inconsistent(where, i)
        turn = cut_after_eos(through[len(before):], tokenizer.eos_token)
        pieces += [Piece(full[at : len(before)], False), Piece(turn, True)]
        at = len(before) + len(turn)
    if not trained or trained[-1] != len(messages) - 1:
        pieces.append(Piece(full[at:], False))
    return [p for p in pieces if p.text or p.trained] if len(pieces) > 1 else pieces


def render_prompt(messages: list[Message], tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                  where: str = "a row") -> str:
    """The prompt text, ending with the cue for the assistant's reply."""
    text = render_messages(messages, tokenizer, tools, add_generation_prompt=True, where=where)
    check_tools_rendered(text, messages, tools, where)
    return text


def render_continuation(prompt: list[Message], turns: list[Message], tokenizer: Any,
                        tools: list[dict[str, Any]] | None = None, where: str = "a row") -> str:
    """What rendering `prompt + turns` adds after `render_prompt(prompt)`, cut after the last EOS
    when the turns end with an assistant's: the one rendering of a scored (or trained) response."""
    messages = [*prompt, *turns]
    head = render_messages(prompt, tokenizer, tools, add_generation_prompt=True, where=where)
    full = render_messages(messages, tokenizer, tools, where=where)
    if not full.startswith(head):
        raise _inconsistent(where, len(prompt))
    check_tools_rendered(full, messages, tools, where)
    tail = full[len(head):]
    return cut_after_eos(tail, tokenizer.eos_token) if turns and turns[-1]["role"] == "assistant" else tail


def render_response(messages: list[Message], response: str, tokenizer: Any) -> str:
    """One assistant `response` after `render_prompt(messages)`, ending with the EOS token."""
    return render_continuation(messages, [{"role": "assistant", "content": response}], tokenizer)


def sft_pieces(row: ParsedRow, tokenizer: Any, last_turn_only: bool = False, where: str = "a row") -> list[Piece]:
    """An SFT example's pieces: the prompt untrained, then the completion with every assistant turn
    trained (only the last with `last_turn_only`); a standard `text` row is one trained piece
    ending with EOS, rendered without a template."""
    if row.text is not None:
        return [Piece(row.text + (tokenizer.eos_token or ""), True)]
    messages = [*row.prompt, *(row.completion or [])]
    trained = [i for i in range(len(row.prompt), len(messages)) if messages[i]["role"] == "assistant"]
    if last_turn_only:
        trained = trained[-1:]
    return render_conversation(messages, trained, tokenizer, row.tools, where)


__all__ = ["Piece", "check_tools_rendered", "cut_after_eos", "has_chat_template", "render_continuation",
           "render_conversation", "render_messages", "render_prompt", "render_response", "sft_pieces"]
