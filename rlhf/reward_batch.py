"""What one scoring call hands the reward functions: a batch of rollouts in TRL's terms.

A `RewardBatch` holds each row's prompt (chat messages), decoded response, data columns, whether
the row is conversational, its response token ids, the training progress and a `RewardLog` for
what the functions log. `trl_prompts` / `trl_completions` are the rows as TRL's GRPOTrainer hands
them to a reward function: strings for standard rows; for conversational rows (the data row's
prompt was a list of chat messages) the prompt's message list and `[{"role": "assistant",
"content": response}]`.

`RewardLog` collects `log_metric(name, value)` values (averaged per iteration, logged as
`reward_fn/<name>`) and `log_extra(column, values)` columns (one value per row, added to the
logged sample table), each bound to the function that logs, so a bad call names its spec.

`run_concurrently` awaits the coroutines of one batch's async reward functions together
(asyncio.gather) on one event loop that lives in a daemon thread for the whole process, as TRL's
GRPOTrainer does: a client an async function made (an HTTP session) stays on the loop it was
made on, and it works where the caller already runs an event loop (a notebook). Each awaited call
is bounded by --reward-timeout on the loop; a function that blocks the loop itself (time.sleep in
an async def) is caught by the caller's wait, and the blocked loop is left for a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import numbers
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.data.formats import Message
from rlhf.errors import UserError
from rlhf.user_code import GRACE_S

# The keyword arguments TRL passes besides the data columns (a column of one of these names is
# shadowed by it, as in TRL).
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
# Columns of the logged sample table that a log_extra column may not replace.
SAMPLE_COLUMNS = ("prompt", "response", "score")


@dataclass(frozen=True)
class RewardTrainerState:
    """The training progress a reward function reads from `trainer_state`: the attributes of
    transformers' TrainerState that TRL's reward functions read, counted in PPO iterations (one
    generation batch each, what --max-steps counts)."""

    global_step: int
    """Iterations finished before this batch was generated (0 in the first)."""
    max_steps: int
    """The run's iterations."""
    epoch: float
    """Passes over the prompts so far (fractional: global_step / iterations per epoch)."""
    num_train_epochs: int
    """Passes over the prompts the run makes (rounded up)."""


def trainer_state(iteration: int, max_steps: int, steps_per_epoch: int) -> RewardTrainerState:
    """The state a reward function sees while iteration `iteration` (0-based) is scored."""
    per_epoch = max(steps_per_epoch, 1)
    return RewardTrainerState(iteration, max_steps, iteration / per_epoch, math.ceil(max_steps / per_epoch))


@dataclass
class RewardLog:
    """What the reward functions of one batch of `rows` logged: metric values by name, extra
    sample-table columns (one value per row) by column name."""

    rows: int
    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def metric_logger(self, where: str) -> Callable[[str, float], None]:
        """TRL's `log_metric(name, value)` for the function described by `where`."""

        def log_metric(name: str, value: float) -> None:
            if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
                value = value.item()  # numpy / torch scalars
            if not isinstance(name, str) or not name or not isinstance(value, (bool, numbers.Real)):
                raise UserError(f"{where}: log_metric({name!r}, {value!r}): expected a metric name (str) and a "
                                "number")
            self.metrics.setdefault(name, []).append(float(value))

        return log_metric

    def extra_logger(self, where: str) -> Callable[[str, Sequence[Any]], None]:
        """TRL's `log_extra(column, values)` for the function described by `where`."""

        def log_extra(column: str, values: Sequence[Any]) -> None:
            if hasattr(values, "tolist"):
                values = values.tolist()
            if not isinstance(column, str) or not isinstance(values, (list, tuple)):
                raise UserError(f"{where}: log_extra({column!r}, ...): expected a column name (str) and a list "
                                f"of {self.rows} values")
            if len(values) != self.rows:
                raise UserError(f"{where}: log_extra({column!r}, ...) got {len(values)} values for {self.rows} "
                                "completions; log one value per completion")
            if column in SAMPLE_COLUMNS or column in self.extra:
                taken = "a column of the sample table" if column in SAMPLE_COLUMNS else "logged already this batch"
                raise UserError(f"{where}: log_extra({column!r}, ...): {column!r} is {taken}; pick another name")
            self.extra[column] = list(values)

        return log_extra


@dataclass
class RewardBatch:
    """One scoring call's rows (see the module docstring). `fields`, `conversational` default to
    no columns and standard rows; `completion_ids` is None where the caller has no token ids."""

    prompts: list[list[Message]]
    responses: list[str]
    fields: list[dict[str, Any]] | None = None
    conversational: list[bool] | None = None
    completion_ids: list[list[int]] | None = None
    trainer_state: RewardTrainerState | None = None
    trajectories: list[list[Message]] | None = None
    """A tool rollout's turns after each prompt (assistant turns with their tool calls, tool messages)."""
    environments: list[Any] | None = None
    """A tool rollout's --environment instance of each row (TRL's `environments` argument)."""
    log: RewardLog = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.responses)
        self.fields = [{} for _ in range(n)] if self.fields is None else self.fields
        self.conversational = [False] * n if self.conversational is None else self.conversational
        counts = {len(self.prompts), len(self.fields), len(self.conversational)}
        if self.completion_ids is not None:
            counts.add(len(self.completion_ids))
        if counts != {n}:
            raise ValueError(f"a reward batch of {n} responses with {len(self.prompts)} prompts, {len(self.fields)} "
                             f"field rows and {len(self.conversational)} conversational flags")
        self.log = RewardLog(n)

    @classmethod
    def of_texts(cls, prompts: list[str], responses: list[str], fields: list[dict[str, Any]] | None = None,
                 **kwargs: Any) -> RewardBatch:
        """A batch of standard rows whose prompts are one user turn each."""
        return cls([[{"role": "user", "content": p}] for p in prompts], responses, fields, **kwargs)

    def __len__(self) -> int:
        return len(self.responses)

    def prompt_text(self, row: int) -> str:
        """Row `row`'s prompt as the per-sample convention sees it: its last user turn's text."""
        return prompt_text(self.prompts[row])

    def trl_prompts(self) -> list[str | list[Message]]:
        """TRL's `prompts`: a conversational row's messages (a copy), a standard row's text."""
        assert self.conversational is not None
        return [[dict(m) for m in p] if chat else prompt_text(p) for p, chat in zip(self.prompts, self.conversational)]

    def trl_completions(self) -> list[str | list[Message]]:
        """TRL's `completions`: `[{"role": "assistant", "content": text}]` for a conversational row
        (every turn of a tool rollout, tool messages included), the text for a standard one."""
        assert self.conversational is not None
        if self.trajectories is not None:
            return [[dict(m) for m in t] if chat else r
                    for t, r, chat in zip(self.trajectories, self.responses, self.conversational)]
        return [[{"role": "assistant", "content": r}] if chat else r
                for r, chat in zip(self.responses, self.conversational)]


def prompt_text(messages: list[Message]) -> str:
    """What a per-sample reward function gets as the prompt (and TRL's functions for a standard
    row): the content of the last user turn."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    return messages[-1]["content"] if messages else ""


class _LoopThread:
    """One event loop running in a daemon thread (started on first use)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None or self.loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="rlhf-reward-functions", daemon=True).start()
                self.loop = loop
            return self.loop

    def abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """`loop` is blocked (its thread cannot be stopped): the next `get` starts another."""
        with self.lock:
            if self.loop is loop:
                self.loop = None


_LOOP = _LoopThread()


def run_concurrently(coroutines: Sequence[Coroutine[Any, Any, Any]], timeout: float | None = None,
                     what: str = "the async reward functions") -> list[Any]:
    """The coroutines' results in order, awaited together (asyncio.gather) on the reward
    functions' event loop; the first exception propagates. `timeout`: the longest a call may take
    (each bounds its own awaits); the loop not done GRACE_S later is blocked: a UserError
    naming `what`."""

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*coroutines))

    loop = _LOOP.get()
    future = asyncio.run_coroutine_threadsafe(gather(), loop)
    try:
        return future.result(timeout + GRACE_S if timeout else None)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise  # a TimeoutError of the functions' own
        _LOOP.abandon(loop)
        raise UserError(f"{what}: no result {timeout + GRACE_S:g} s after the calls began (--reward-timeout "
                        f"{timeout:g} s): an async function blocks its event loop (a blocking call such as "
                        "time.sleep or requests inside an async def); await asyncio.sleep / an async client, or "
                        "use asyncio.to_thread") from None


__all__ = [
    "RewardBatch", "RewardLog", "RewardTrainerState", "SAMPLE_COLUMNS", "TRL_ARGUMENTS", "prompt_text",
    "run_concurrently", "trainer_state",
]
