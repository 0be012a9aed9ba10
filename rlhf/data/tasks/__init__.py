"""Built-in tasks with ground-truth checkers, so the whole pipeline runs offline.

    from rlhf.data.tasks import get_task, write_task_dataset
    task = get_task("sort")
    task.score("sort: dbca", "abcd")  # 1.0
    write_task_dataset(task, "data/sort", n_sft=4000, n_pairs=4000, n_prompts=2000,
                       n_eval_prompts=256, n_eval_pairs=512, wrong_fraction=0.35, seed=0)
"""

from __future__ import annotations

from collections.abc import Callable

from rlhf.data.tasks.base import (
    DATASET_FILES,
    Task,
    build_preference_rows,
    build_prompt_rows,
    build_sft_rows,
    sample_unique_prompts,
    success_rate,
    user_request,
    write_task_dataset,
)
from rlhf.data.tasks.arithmetic import ArithmeticWordsTask
from rlhf.data.tasks.calculator import CalculatorTask
from rlhf.data.tasks.larger_number import LargerNumberTask
from rlhf.data.tasks.sort import SortTask
from rlhf.errors import UserError

# name -> factory of the task with its default settings.
TASKS: dict[str, Callable[[], Task]] = {
    "sort": SortTask,
    "arithmetic_words": ArithmeticWordsTask,
    "larger_number": LargerNumberTask,
    "calculator": CalculatorTask,
}


def get_task(name: str) -> Task:
    """The built-in task called `name`; a `UserError` listing the choices for an unknown name."""
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


__all__ = [
    "ArithmeticWordsTask", "CalculatorTask", "DATASET_FILES", "LargerNumberTask", "TASKS", "SortTask", "Task", "build_preference_rows", "build_prompt_rows",
    "build_sft_rows", "get_task", "sample_unique_prompts", "success_rate", "user_request",
    "write_task_dataset",
]
