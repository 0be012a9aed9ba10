"""docs/config.md is generated from the config docstrings and cannot drift; every option's help
is at most two lines; the longer explanation of a field is in the docs, not in --help."""

from __future__ import annotations

import re
from dataclasses import dataclass

from click.testing import CliRunner

from rlhf.cli import cli
from rlhf.config import E2EConfig, PPOConfig, RewardConfig, SFTConfig, field_docs, fields_by_name, leaf_fields
from rlhf.config_docs import command_paths, generate, options
from tests.conftest import REPO

HELP_CHARS = 160
"""An option's help: one or two sentences, at most two lines of a terminal's help column."""
DOCS = REPO / "docs" / "config.md"


def test_docs_config_md_is_what_the_generator_writes():
    assert DOCS.read_text() == generate(), "docs/config.md is stale: run python -m rlhf.config_docs > docs/config.md"


def test_every_option_of_every_command_is_in_the_docs():
    text = DOCS.read_text()
    for path in command_paths():
        for option in options(path):
            assert f"`{option.opts[0]}`" in text, f"rlhf {path} {option.opts[0]}"


def _own_help(help_text: str) -> str:
    """An option's help without what click's option adds: ` [default: X]`, ` (repeatable)`."""
    return re.sub(r"( \[default: .*\])?( \(repeatable\))?$", "", help_text)


def test_every_option_help_is_at_most_two_lines():
    too_long = []
    for path in command_paths():
        for option in options(path):
            text = _own_help(option.help or "")
            assert text, f"rlhf {path} {option.opts[0]} has no help"
            if len(text) > HELP_CHARS or "\n" in text:
                too_long.append(f"rlhf {path} {option.opts[0]}: {len(text)} characters")
    assert not too_long, "help texts over two lines (put the rest in a second paragraph):\n" + "\n".join(too_long)


def test_every_field_help_is_one_short_paragraph():
    for cls in (SFTConfig, RewardConfig, PPOConfig, E2EConfig):
        for info in leaf_fields(cls):
            assert 0 < len(info.doc) <= HELP_CHARS, f"{cls.__name__}.{info.name}: {len(info.doc)} characters"
            assert all(info.details), f"{cls.__name__}.{info.name}: an empty paragraph"


@dataclass
class _Documented:
    size: int = 1
    """The help, on one line.

    The longer explanation,
    over two lines.

    A third paragraph.
    """
    plain: str = ""
    """Only a help."""


def test_the_help_is_the_first_paragraph_and_the_details_the_rest():
    assert field_docs(_Documented) == {"size": "The help, on one line.", "plain": "Only a help."}
    size, plain = leaf_fields(_Documented)
    assert size.doc == "The help, on one line."
    assert size.details == ("The longer explanation, over two lines.", "A third paragraph.")
    assert plain.details == ()


def test_the_longer_explanation_is_in_the_docs_not_in_the_help():
    info = fields_by_name(PPOConfig)["kv_cache_dtype"]
    assert info.details
    result = CliRunner().invoke(cli, ["ppo", "--help"], terminal_width=200)
    assert result.exit_code == 0
    shown = " ".join(result.output.split())
    assert info.doc[:60] in shown and info.details[0][:60] not in shown
    assert info.details[0][:60] in DOCS.read_text()
