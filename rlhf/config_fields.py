"""The machinery behind the typed configs: field docstrings, leaf fields, values parsed and checked.

Generic over any config dataclass: `rlhf.config` defines the stage configs and re-exports these
names; nothing here knows a stage.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from rlhf.engine.config import FINITE, FieldRule
from rlhf.errors import UserError


# ---------------------------------------------------------------- introspection


def doc_paragraphs(text: str) -> tuple[str, ...]:
    """A docstring's paragraphs (split at blank lines), each joined into one line."""
    return tuple(" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(text)) if p.strip())


@cache
def field_doc_paragraphs(cls: type) -> dict[str, tuple[str, ...]]:
    """The attribute docstrings (the string literal after each field) of a dataclass and its bases,
    as paragraphs: the first is the field's help (its CLI flag's), the others the longer
    explanation that only docs/config.md shows."""
    docs: dict[str, tuple[str, ...]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = doc_paragraphs(nxt.value.value)
    return docs


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's help: the first paragraph of its docstring (`field_doc_paragraphs` has the rest)."""
    return {name: paragraphs[0] if paragraphs else "" for name, paragraphs in field_doc_paragraphs(cls).items()}


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field of a config: its section path, name, type, help, default and rule."""

    section: str | None
    name: str
    type: Any
    doc: str
    """The help: the docstring's first paragraph, what the field's CLI flag shows."""
    default: Any
    rule: FieldRule | None = None
    """The field's own constraint (from `bounded` / `checked`); a float field without one must be finite."""
    details: tuple[str, ...] = ()
    """The docstring's further paragraphs: the longer explanation, shown in docs/config.md only."""

    @property
    def base_type(self) -> Any:
        """The type without `| None`: what a flag parses."""
        return strip_optional(self.type)[0]

    @property
    def flag(self) -> str:
        """The command-line flag: `micro_batch_size` -> `--micro-batch-size`."""
        return "--" + self.name.replace("_", "-")


def _resolved_hints(cls: type) -> dict[str, Any]:
    module = inspect.getmodule(cls)
    return typing.get_type_hints(cls, globalns=vars(module) if module else None)


def _field_info(section: str | None, f: dataclasses.Field, hints: dict[str, Any],
                docs: dict[str, tuple[str, ...]]) -> FieldInfo:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_text, *details = docs.get(f.name) or ("",)
    return FieldInfo(section, f.name, hints[f.name], help_text, default, f.metadata.get("rule"), tuple(details))


def leaf_fields(cls: type) -> list[FieldInfo]:
    """All leaf fields of a stage config, sections flattened (names are unique across sections)."""
    hints = _resolved_hints(cls)
    out: list[FieldInfo] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub_hints, sub_docs = _resolved_hints(tp), field_doc_paragraphs(tp)
            out += [_field_info(f.name, sf, sub_hints, sub_docs) for sf in dataclasses.fields(tp)]
        else:
            out.append(_field_info(None, f, hints, field_doc_paragraphs(cls)))
    names = [fi.name for fi in out]
    duplicates = {n for n in names if names.count(n) > 1}
    assert not duplicates, f"config field names must be unique across sections: {duplicates}"
    return out


@cache
def fields_by_name(cls: type) -> dict[str, FieldInfo]:
    """`leaf_fields(cls)` by name: the key a file, a flag or a ds_config sets."""
    return {fi.name: fi for fi in leaf_fields(cls)}


# ---------------------------------------------------------------- values


def strip_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None`, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _literal(value: Any, choices: tuple[Any, ...], where: str) -> Any:
    """The choice equal to `value` or to its text (CLI "3" -> 3); a bool never matches a number."""
    for choice in choices:
        if (type(value) is type(choice) and value == choice) or (isinstance(value, str) and value == str(choice)):
            return choice
    raise UserError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a value from YAML/JSON/CLI text to the field type, or raise a UserError naming `where`."""
    base, optional = strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(f"{where}: a value is required")
    origin = typing.get_origin(base)
    try:
        if origin is Literal:
            return _literal(value, typing.get_args(base), where)
        if origin is list:
            (item_tp,) = typing.get_args(base)
            items = value.split(",") if isinstance(value, str) else list(value)
            if item_tp is not str:  # repeated flags may each hold a comma-separated list: --reward-weights 1,0.5
                items = [part for v in items for part in (v.split(",") if isinstance(v, str) else [v])]
            return [coerce(v, item_tp, where) for v in items]
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if base in (int, float) and isinstance(value, bool):
            raise ValueError(value)
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: expected {getattr(base, '__name__', base)}, got {value!r}") from None
    return value


def parse_value(info: FieldInfo, value: Any, where: str) -> Any:
    """`value` in the field's type and within its rule, or one UserError "<where>: <value> must be <rule>"."""
    value = coerce(value, info.type, where)
    rule = info.rule or (FINITE if isinstance(value, float) else None)
    problem = rule.violation(value) if rule is not None and value is not None else None
    if problem:
        shown = repr(value) if isinstance(value, str) else str(value)
        raise UserError(f"{where}: {shown} must be {problem}")
    return value


def set_field(config: Any, info: FieldInfo, value: Any, where: str) -> None:
    """Set one leaf field, converted to its type and checked against its rule."""
    target = getattr(config, info.section) if info.section else config
    setattr(target, info.name, parse_value(info, value, where))
