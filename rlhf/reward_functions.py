"""Reward functions: what `--reward-fn` names, loaded into one callable over a batch of rollouts.

A spec is one of three forms:

    sort                              a built-in task's ground-truth checker (rlhf.data.tasks.TASKS)
    path/to/file.py:function          a function in a Python file, imported by its path
    package.module:function           a function in an importable module

The function follows one of the two conventions users already have, told apart by its parameter
names (`inspect.signature`):

- TRL batch style, when a parameter is named `completions` (TRL's reward functions all take it,
  `prompts` often only through **kwargs): called once per batch as
  `f(prompts=[str], completions=[str], **columns) -> list[number]`, one list per column of the
  prompts' data rows (None where a row lacks it), exactly as TRL's GRPOTrainer calls it.
- Per sample, otherwise: `f(prompt, response, **fields) -> number`, called once per rollout with
  the prompt and response as the first two positional arguments and the row's other columns as
  keywords (a row {"prompt": ..., "answer": "42"} gives answer="42").

Only the columns a function accepts are passed (all of them when it takes **kwargs), so
`def f(prompt, response)` ignores the row's columns and `def f(prompt, response, answer)` gets
`answer`. A built-in task is just a per-sample function, `task.score(prompt, response)`.

The prompt a function sees is the text of the prompt's last user turn (the raw request, without
chat markup or earlier turns: what the built-in tasks check against); the response is the decoded
response. Both are plain strings, also in the batch style (TRL passes chat messages for
conversational datasets; here they are always strings).

A returned number may be an int, a float, a bool (True = 1.0, False = 0.0: `return answer in
response` is a natural exact-match reward) or a 0-d numpy/torch scalar; a batch may return a list,
a tuple or a 1-d array. Anything else, NaN or infinity, a wrong count, or an exception stops the
run with one `UserError` line naming the spec, the row and what came back; with RLHF_DEBUG=1 an
exception the function raised propagates as it is, traceback and all.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.data.formats import Message
from rlhf.errors import UserError, debug_enabled

SPEC_FORMS = "a built-in task name ({tasks}), path/to/file.py:function or package.module:function"

_module_ids = itertools.count()


@dataclass
class RewardFunction:
    """One loaded `--reward-fn`: scores a batch of (prompt, response, row fields) -> one float each."""

    name: str
    """Its name in the logs (`reward/<name>`): the function's name, or the task's; unique in a run."""
    spec: str
    """The spec as the user wrote it, for error messages."""
    fn: Callable[..., Any]
    batched: bool
    """TRL batch style (a parameter named `completions`); else per sample."""
    keywords: frozenset[str] | None
    """The keyword names it accepts besides the prompt and response; None: any (**kwargs)."""
    required: frozenset[str]
    """Keyword names without defaults: every row (batch: some row) must have these fields."""

    def __call__(self, prompts: list[str], responses: list[str], fields: list[dict[str, Any]]) -> list[float]:
        if not len(prompts) == len(responses) == len(fields):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and {len(fields)} field rows")
        if self.batched:
            return self._call_batch(prompts, responses, fields)
        return [self._call_one(i, p, r, f) for i, (p, r, f) in enumerate(zip(prompts, responses, fields))]

    def _accepted(self, fields: dict[str, Any]) -> dict[str, Any]:
        return dict(fields) if self.keywords is None else {k: v for k, v in fields.items() if k in self.keywords}

    def _call_one(self, row: int, prompt: str, response: str, fields: dict[str, Any]) -> float:
        kwargs = self._accepted(fields)
        missing = sorted(self.required - kwargs.keys())
        if missing:
            raise UserError(f"{self._where(row, prompt)}: the data row has no field {', '.join(map(repr, missing))} "
                            f"that the function requires (its fields: {sorted(fields) or 'none'}); add the column "
                            "or give the parameter a default")
        try:
            value = self.fn(prompt, response, **kwargs)
        except Exception as exc:
            if debug_enabled():
                raise
            raise self._raised(exc, self._where(row, prompt)) from exc
        return self._number(value, row, prompt)

    def _call_batch(self, prompts: list[str], responses: list[str], fields: list[dict[str, Any]]) -> list[float]:
        names = dict.fromkeys(k for row in fields for k in row if k not in ("prompts", "completions"))
        columns = self._accepted({k: [row.get(k) for row in fields] for k in names})
        missing = sorted(self.required - columns.keys())
        where = f"--reward-fn {self.spec}: on a batch of {len(prompts)} rows (first prompt {_short(prompts)})"
        if missing:
            raise UserError(f"{where}: no data row has the column {', '.join(map(repr, missing))} that the function "
                            f"requires (columns: {list(names) or 'none'}); add it or give the parameter a default")
        if self.keywords is None or "prompts" in self.keywords:
            columns["prompts"] = prompts
        try:
            values = self.fn(completions=responses, **columns)
        except Exception as exc:
            if debug_enabled():
                raise
            raise self._raised(exc, where) from exc
        if hasattr(values, "tolist") and getattr(values, "ndim", 0) == 1:
            values = values.tolist()  # a 1-d numpy array or torch tensor
        if not isinstance(values, (list, tuple)):
            raise UserError(f"{where}: returned {_shown(values)}, expected a list of {len(prompts)} numbers "
                            "(one per completion)")
        if len(values) != len(prompts):
            raise UserError(f"{where}: returned {len(values)} values for {len(prompts)} completions; return one "
                            "number per completion")
        return [self._number(v, i, p) for i, (v, p) in enumerate(zip(values, prompts))]

    def _number(self, value: Any, row: int, prompt: str) -> float:
        """`value` as a finite float, or a UserError naming the row and what came back."""
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()  # numpy / torch scalars
        if isinstance(value, (bool, numbers.Real)):
            number = float(value)
            if math.isfinite(number):
                return number
        raise UserError(f"{self._where(row, prompt)}: returned {_shown(value)}, expected a finite number "
                        "(int, float or bool)")

    def _where(self, row: int, prompt: str) -> str:
        return f"--reward-fn {self.spec}: row {row} of the batch (prompt {_short([prompt])})"

    def _raised(self, exc: Exception, where: str) -> UserError:
        """A one-line UserError for the function's own exception (without RLHF_DEBUG)."""
        return UserError(f"{where}: raised {type(exc).__name__}: {_one_line(str(exc), 200)} "
                         "(RLHF_DEBUG=1 shows the traceback)")


def prompt_text(messages: list[Message]) -> str:
    """What a reward function gets as the prompt: the content of the last user turn."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    return messages[-1]["content"] if messages else ""


def load_reward_function(spec: str) -> RewardFunction:
    """The function that `spec` names (see the module docstring), checked to be callable with one
    of the two conventions; a one-line UserError otherwise."""
    from rlhf.data.tasks import TASKS

    forms = SPEC_FORMS.format(tasks=", ".join(sorted(TASKS)))
    if ":" not in spec:
        if spec in TASKS:
            return _wrap(spec, spec, TASKS[spec]().score)
        hint = f"; name the function: {spec}:FUNCTION" if spec.endswith(".py") else ""
        raise UserError(f"--reward-fn {spec!r}: not {forms}{hint}")
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute or not all(part.isidentifier() for part in attribute.split(".")):
        raise UserError(f"--reward-fn {spec!r}: expected {forms}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where), spec)
    elif all(part.isidentifier() for part in where.split(".")):
        module = _import_module(where, spec)
    else:
        raise UserError(f"--reward-fn {spec!r}: {where!r} is neither a .py file nor a module name; expected {forms}")
    fn: Any = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                               and getattr(v, "__module__", None) == module.__name__)
            raise UserError(f"--reward-fn {spec}: {where} has no function {attribute!r} "
                            f"(its functions: {', '.join(available[:12]) or 'none'})")
        fn = getattr(fn, part)
    if not callable(fn):
        raise UserError(f"--reward-fn {spec}: {attribute!r} in {where} is a {type(fn).__name__}, not a function")
    return _wrap(attribute.rsplit(".", 1)[-1], spec, fn)


def load_reward_functions(specs: Sequence[str], reserved: Collection[str] = ()) -> list[RewardFunction]:
    """Each spec loaded in order, names made unique (`f`, `f_2`, ...) and distinct from `reserved`."""
    functions, taken = [], set(reserved)
    for spec in specs:
        function = load_reward_function(spec)
        name, n = function.name, 1
        while name in taken:
            n += 1
            name = f"{function.name}_{n}"
        function.name = name
        taken.add(name)
        functions.append(function)
    return functions


def _wrap(name: str, spec: str, fn: Callable[..., Any]) -> RewardFunction:
    """Tell the convention from the parameter names and record which keywords `fn` accepts."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: assume f(prompt, response)
        return RewardFunction(name, spec, fn, False, frozenset(), frozenset())
    names = [p.name for p in params]
    batched = "completions" in names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not batched and len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise UserError(f"--reward-fn {spec}: {name}{inspect.signature(fn)} takes neither (prompt, response, "
                        "**fields) nor TRL's (prompts, completions, **columns)")
    fixed = {"completions"} if batched else {p.name for p in positional[:2]}
    keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed]
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params)
    required = frozenset(p.name for p in keyword if p.default is p.empty and p.name != "prompts")
    return RewardFunction(name, spec, fn, batched, None if accepts_any else frozenset(p.name for p in keyword),
                          required)


def _import_file(path: Path, spec: str) -> Any:
    """Import a .py file by its path, under a module name of its own (two files called
    rewards.py never clash, nor shadow an installed `rewards` module)."""
    if not path.is_file():
        raise UserError(f"--reward-fn {spec}: no file {path} (path relative to {Path.cwd()})")
    name = f"_rlhf_reward_fn_{next(_module_ids)}_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"--reward-fn {spec}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling in the file look their module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        if debug_enabled():
            raise
        raise UserError(f"--reward-fn {spec}: importing {path} failed: {type(exc).__name__}: "
                        f"{_one_line(str(exc), 200)} (RLHF_DEBUG=1 shows the traceback)") from exc
    return module


def _import_module(module: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:
        if debug_enabled():
            raise
        hint = " (is it installed, or on PYTHONPATH?)" if isinstance(exc, ModuleNotFoundError) else ""
        raise UserError(f"--reward-fn {spec}: importing module {module} failed: {type(exc).__name__}: "
                        f"{_one_line(str(exc), 200)}{hint}") from exc


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(prompts: list[str]) -> str:
    return repr(_one_line(prompts[0], 60)) if prompts else "none"


def _shown(value: Any) -> str:
    return f"{_one_line(repr(value), 60)} ({type(value).__name__})"


__all__ = ["RewardFunction", "SPEC_FORMS", "load_reward_function", "load_reward_functions", "prompt_text"]
