"""Reward functions: what `--reward-fn` names, loaded into one callable over a batch of rollouts.

A spec is one of three forms:

    sort                              a built-in task's ground-truth checker (rlhf.data.tasks.TASKS)
    path/to/file.py:function          a function in a Python file, imported by its path
    package.module:function           a function in an importable module

The function follows one of the two conventions users already have, told apart by its parameter
names (`inspect.signature`):

- TRL's, when a parameter is named `prompts`, `completions` or `completion_ids`, or the function
  takes only **kwargs: called once per batch exactly as TRL's GRPOTrainer calls it, by keyword,

      f(prompts=..., completions=..., completion_ids=[[int]], trainer_state=..., log_extra=...,
        log_metric=..., **columns) -> list[number | None]

  `prompts` and `completions` are strings for a standard row; for a conversational row (its data
  row's prompt was a list of chat messages) the prompt's message list and `[{"role":
  "assistant", "content": response}]`. `completion_ids` are each response's token ids up to and
  including EOS, without padding. Every data column (`ParsedRow.fields`) comes as a list, one
  value per row (None where a row lacks it). `trainer_state` has `global_step`, `max_steps`,
  `epoch` and `num_train_epochs`, counted in PPO iterations (`RewardTrainerState`).
  `log_metric(name, value)` logs a number with the iteration's metrics as `reward_fn/<name>`
  (the mean of the iteration's values over all ranks; TRL logs it as plain `<name>`), and
  `log_extra(column, values)` adds a column, one value per row, to the logged sample table.
- Per sample, otherwise: `f(prompt, response, **fields) -> number | None`, called once per
  rollout with the prompt and response as the first two positional arguments (strings, also for
  conversational rows) and the row's columns as keywords (a row {"prompt": ..., "answer": "42"}
  gives answer="42").

Only the arguments a function accepts are passed (all of them when it takes **kwargs), so
`def f(prompt, response)` ignores the row's columns and `def f(completions, answer, **kwargs)`
gets both. A built-in task is just a per-sample function, `task.score(prompt, response)`.

The prompt text (per sample, and TRL's `prompts` for a standard row) is the content of the
prompt's last user turn (the raw request, without chat markup or earlier turns: what the built-in
tasks check against); the response is the decoded response, stripped.

`async def` functions (either convention) are awaited: the async functions of one batch run
together (asyncio.gather, as TRL), and a per-sample async function's rows run together too.

A returned number may be an int, a float, a bool (True = 1.0, False = 0.0: `return answer in
response` is a natural exact-match reward) or a 0-d numpy/torch scalar; a batch may return a list,
a tuple or a 1-d array. None (as in TRL) leaves the sample unscored by this function: the
weighted reward sums the sources that scored it, and a sample that no source scores stops the run
(`rlhf.stages.reward_sources`). Anything else, NaN or infinity (return None to skip a sample), a
wrong count, or an exception stops the run with one `UserError` line naming the spec, the row and
what came back; with RLHF_DEBUG=1 an exception the function raised propagates as it is, traceback
and all. So does a SystemExit or KeyboardInterrupt that the function raised (`sys.exit(0)` ends
no run; one that a signal to the process raised, a real Ctrl-C, passes as it is), and a call that
runs past `timeout` seconds (--reward-timeout): a sync function is interrupted on the main thread
where it runs, an async one cancelled (`rlhf.user_code`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlhf.data.tasks import TASKS
from rlhf.errors import UserError, debug_enabled
from rlhf.reward_batch import TRL_ARGUMENTS, RewardBatch, prompt_text, run_concurrently
from rlhf.user_code import CallTimedOut, UserCall, bounded_await, import_user_module, user_call

SPEC_FORMS = "a built-in task name ({tasks}), path/to/file.py:function or package.module:function"

# A parameter of one of these names makes a function TRL-style.
TRL_DATA_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids"})

Score = float | None  # None: the function leaves the sample unscored


@dataclass
class RewardFunction:
    """One loaded `--reward-fn`: scores a `RewardBatch` -> one float (or None) per row."""

    name: str
    """Its name in the logs (`reward/<name>`): the function's name, or the task's; unique in a run."""
    spec: str
    """The spec as the user wrote it, for error messages."""
    fn: Callable[..., Any]
    batched: bool
    """TRL's convention (see `_wrap`); else per sample."""
    keywords: frozenset[str] | None
    """The keyword names it accepts besides a per-sample prompt and response; None: any (**kwargs)."""
    required: frozenset[str]
    """Keyword names without defaults: every row (batch: some row) must have these fields."""
    is_async: bool = False
    """An `async def` function (or callable): `acall` awaits it."""
    timeout: float | None = None
    """Seconds one call may take (--reward-timeout) before the run stops with a line naming the row; None: no limit."""

    def __call__(self, batch: RewardBatch) -> list[Score]:
        if self.is_async:
            return run_concurrently([self.acall(batch)], self.timeout, f"--reward-fn {self.spec}")[0]
        if self.batched:
            kwargs, where = self._batch_arguments(batch)
            with self._guard(where):
                values = self.fn(**kwargs)
            return self._batch_values(values, batch, where)
        scores = []
        for row in range(len(batch)):
            args, kwargs = self._row_arguments(row, batch)
            with self._guard(self._where(row, batch)):
                value = self.fn(*args, **kwargs)
            scores.append(self._number(value, row, batch))
        return scores

    async def acall(self, batch: RewardBatch) -> list[Score]:
        """An async function's scores (a per-sample one's rows awaited together)."""
        if self.batched:
            kwargs, where = self._batch_arguments(batch)
            with self._guard(where):
                values = await bounded_await(self.fn(**kwargs), self.timeout)
            return self._batch_values(values, batch, where)

        async def one(row: int) -> Score:
            args, kwargs = self._row_arguments(row, batch)
            with self._guard(self._where(row, batch)):
                value = await bounded_await(self.fn(*args, **kwargs), self.timeout)
            return self._number(value, row, batch)

        return list(await asyncio.gather(*(one(row) for row in range(len(batch)))))

    def _accepted(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return dict(arguments) if self.keywords is None else {k: v for k, v in arguments.items() if k in self.keywords}

    def _row_arguments(self, row: int, batch: RewardBatch) -> tuple[tuple[str, str], dict[str, Any]]:
        assert batch.fields is not None
        fields = batch.fields[row]
        kwargs = self._accepted(fields)
        missing = sorted(self.required - kwargs.keys())
        if missing:
            raise UserError(f"{self._where(row, batch)}: the data row has no field {', '.join(map(repr, missing))} "
                            f"that the function requires (its fields: {sorted(fields) or 'none'}); add the column "
                            "or give the parameter a default")
        return (batch.prompt_text(row), batch.responses[row]), kwargs

    def _batch_arguments(self, batch: RewardBatch) -> tuple[dict[str, Any], str]:
        """TRL's keyword arguments for the batch (those the function accepts), and the batch's
        description for error messages."""
        assert batch.fields is not None
        first = repr(_one_line(batch.prompt_text(0), 60)) if len(batch) else "none"
        where = f"--reward-fn {self.spec}: on a batch of {len(batch)} rows (first prompt {first})"
        names = dict.fromkeys(k for row in batch.fields for k in row if k not in TRL_ARGUMENTS)
        arguments: dict[str, Any] = {k: [row.get(k) for row in batch.fields] for k in names}
        wanted = set(TRL_ARGUMENTS) if self.keywords is None else self.keywords
        trl = {
            "prompts": batch.trl_prompts, "completions": batch.trl_completions,
            "completion_ids": lambda: batch.completion_ids, "trainer_state": lambda: batch.trainer_state,
            "log_extra": lambda: batch.log.extra_logger(where), "log_metric": lambda: batch.log.metric_logger(where),
            "environments": lambda: batch.environments,
        }
        if batch.environments is None:  # as TRL: only a run with an --environment passes them
            del trl["environments"]
        arguments.update({k: make() for k, make in trl.items() if k in wanted})
        kwargs = self._accepted(arguments)
        missing = sorted(self.required - kwargs.keys())
        if missing:
            raise UserError(f"{where}: no data row has the column {', '.join(map(repr, missing))} that the function "
                            f"requires (columns: {list(names) or 'none'}); add it or give the parameter a default")
        return kwargs, where

    def _batch_values(self, values: Any, batch: RewardBatch, where: str) -> list[Score]:
        if hasattr(values, "tolist") and getattr(values, "ndim", 0) == 1:
            values = values.tolist()  # a 1-d numpy array or torch tensor
        if not isinstance(values, (list, tuple)):
            raise UserError(f"{where}: returned {_shown(values)}, expected a list of {len(batch)} numbers "
                            "(one per completion)")
        if len(values) != len(batch):
            raise UserError(f"{where}: returned {len(values)} values for {len(batch)} completions; return one "
                            "number per completion")
        return [self._number(v, row, batch) for row, v in enumerate(values)]

    def _number(self, value: Any, row: int, batch: RewardBatch) -> Score:
        """`value` as a finite float or None, or a UserError naming the row and what came back."""
        if value is None:
            return None
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()  # numpy / torch scalars
        if isinstance(value, (bool, numbers.Real)):
            number = float(value)
            if math.isfinite(number):
                return number
            raise UserError(f"{self._where(row, batch)}: returned {_shown(value)}, expected a finite number "
                            "(return None to leave the sample unscored)")
        raise UserError(f"{self._where(row, batch)}: returned {_shown(value)}, expected a finite number "
                        "(int, float or bool) or None")

    def _where(self, row: int, batch: RewardBatch) -> str:
        return f"--reward-fn {self.spec}: row {row} of the batch (prompt {_short(batch.prompt_text(row))})"

    @contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """The call as a `user_call`: its own exception as one UserError line (as it is with
        RLHF_DEBUG=1), a SystemExit or KeyboardInterrupt it raised too (one that a signal raised
        passes), and a call past `timeout` as the line naming the row."""
        timed_out = (f"{where}: no result after --reward-timeout {self.timeout or 0:g} s (the function hangs or is "
                     "too slow); make it faster, or raise --reward-timeout (0: no limit)")
        call = UserCall(f"{timed_out}; it did not stop when interrupted, so the run ends here")
        try:
            with user_call(call, self.timeout):
                yield
        except UserError:
            raise  # ours, e.g. from a bad log_metric call: already one line naming the spec
        except CallTimedOut:
            raise UserError(timed_out) from None
        except BaseException as exc:
            if call.expired:  # interrupted at the deadline inside code that turned it into another error
                raise UserError(timed_out) from exc
            if not call.raised_by_function(exc):
                raise  # a real Ctrl-C (or SIGTERM): the run stops as the signal says
            if isinstance(exc, Exception):
                if debug_enabled():
                    raise
                raise UserError(f"{where}: raised {type(exc).__name__}: {_one_line(str(exc), 200)} "
                                "(RLHF_DEBUG=1 shows the traceback)") from exc
            shown = f"{type(exc).__name__}({_one_line(', '.join(map(repr, exc.args)), 60)})"
            raise UserError(f"{where}: raised {shown}, which would end the run; a reward function returns a number "
                            "or None (raise an exception for a real error)") from exc


def load_reward_function(spec: str) -> RewardFunction:
    """The function that `spec` names (see the module docstring), checked to be callable with one
    of the two conventions; a one-line UserError otherwise."""
    forms = SPEC_FORMS.format(tasks=", ".join(sorted(TASKS)))
    if ":" not in spec:
        if spec in TASKS:
            return _wrap(spec, spec, TASKS[spec]().score)
        hint = f"; name the function: {spec}:FUNCTION" if spec.endswith(".py") else ""
        raise UserError(f"--reward-fn {spec!r}: not {forms}{hint}")
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute or not all(part.isidentifier() for part in attribute.split(".")):
        raise UserError(f"--reward-fn {spec!r}: expected {forms}")
    module = import_user_module(where, spec, "--reward-fn", forms)
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
    """Tell the convention from the parameter names and record which keywords `fn` accepts.

    TRL's: a parameter named prompts, completions or completion_ids, or nothing but **kwargs (TRL
    passes every argument by keyword); per sample: two positional parameters first."""
    is_async = _is_async(fn)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: assume f(prompt, response)
        return RewardFunction(name, spec, fn, False, frozenset(), frozenset(), is_async)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind == p.VAR_POSITIONAL for p in params)
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params)
    batched = bool(TRL_DATA_ARGUMENTS & {p.name for p in params}) or (
        accepts_any and not positional and not var_positional)
    if not batched and len(positional) < 2 and not var_positional:
        raise UserError(f"--reward-fn {spec}: {name}{inspect.signature(fn)} takes neither (prompt, response, "
                        "**fields) nor TRL's (prompts, completions, completion_ids, **kwargs)")
    fixed = set() if batched else {p.name for p in positional[:2]}
    keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed]
    required = frozenset(p.name for p in keyword if p.default is p.empty and not (batched and p.name in TRL_ARGUMENTS))
    return RewardFunction(name, spec, fn, batched, None if accepts_any else frozenset(p.name for p in keyword),
                          required, is_async)


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` returns a coroutine: an async function, a partial of one, or an object
    with an async `__call__` (as TRL's `is_async_callable`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(text: str) -> str:
    return repr(_one_line(text, 60))


def _shown(value: Any) -> str:
    return f"{_one_line(repr(value), 60)} ({type(value).__name__})"


__all__ = [
    "RewardBatch", "RewardFunction", "SPEC_FORMS", "Score", "load_reward_function", "load_reward_functions",
    "prompt_text",
]
