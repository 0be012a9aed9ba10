"""What a built-in task is, and the seeded builders that turn one into the pipeline's datasets.

A task generates prompts (the raw user text; the pipeline renders the chat format around it),
knows the correct answer and plausible wrong ones, and scores any response against the truth.
From one task and one seed the builders make every dataset the three stages need, with the
held-out prompts disjoint from all the training prompts.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlhf.errors import UserError
from rlhf.logging import get_logger

logger = get_logger(__name__)

# Files written by `write_task_dataset`, in the order their prompts are drawn: the held-out files
# first, so that the evaluation sets stay the same when the training sizes change.
DATASET_FILES: tuple[str, ...] = (
    "eval_prompts.jsonl", "eval_pairs.jsonl", "sft.jsonl", "pairs.jsonl", "prompts.jsonl",
)


@runtime_checkable
class Task(Protocol):
    """A verifiable task: prompts, a correct answer, plausible wrong answers and a checker.

    A task may also define `rejected_response(prompt, rng)`, the rejected answers of its preference
    pairs where they should differ from the wrong demonstrations (`build_preference_rows`).
    """

    name: str

    def sample_prompt(self, rng: random.Random) -> str:
        """A random prompt (raw user text, no chat markup)."""
        ...

    def correct_response(self, prompt: str) -> str:
        """The correct response to `prompt`."""
        ...

    def wrong_response(self, prompt: str, rng: random.Random) -> str:
        """A plausible wrong response to `prompt`; `score` must give it 0."""
        ...

    def score(self, prompt: str, response: str) -> float:
        """Ground-truth reward in [0, 1]; 1.0 means correct."""
        ...

    def is_correct(self, prompt: str, response: str) -> bool:
        """Whether `response` solves `prompt`."""
        ...


NUMBER_ONLY = "Answer with the number only."
"""The instruction that ends the prompts of the tasks whose answer is one number."""
_FIRST_NUMBER = re.compile(r"-?\d+")


def first_number_is(response: str, answer: int) -> float:
    """1.0 when the first number in `response` is `answer` ("52", "52." and "It is 52" all count), else 0.0."""
    match = _FIRST_NUMBER.search(response)
    return float(match is not None and int(match.group()) == answer)


def user_request(prompt: str) -> str:
    """The user's request: `prompt` itself, or its last Human turn if it is a rendered dialog.

    Lets a task checker score the rendered prompt ("Human: ...\n\nAssistant:", maybe after a
    BOS) as well as the raw user text that the task generated.
    """
    _, human, turn = prompt.rpartition("Human:")
    return turn.split("\nAssistant:", 1)[0].strip() if human else prompt.strip()


def _file_rng(seed: int, what: str) -> random.Random:
    # One stream per dataset, so one file's size never shifts another file's rows. String seeds
    # are hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    return random.Random(f"{seed}/{what}")


def sample_unique_prompts(
    task: Task, n: int, rng: random.Random, exclude: set[str] | None = None
) -> list[str]:
    """`n` distinct prompts, none in `exclude`; `exclude` is not modified."""
    seen = set(exclude or ())
    prompts: list[str] = []
    budget = 100 * n + 1000  # rejection sampling; a task with too few prompts fails loudly
    while len(prompts) < n:
        if budget == 0:
            raise UserError(
                f"task '{task.name}' cannot produce {n} distinct prompts outside the "
                f"{len(exclude or ())} already used; ask for fewer rows"
            )
        budget -= 1
        prompt = task.sample_prompt(rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def build_sft_rows(
    task: Task, n: int, wrong_fraction: float, seed: int, exclude: set[str] | None = None
) -> list[dict[str, str]]:
    """`n` demonstrations {prompt, response} (or the task's `demonstration(prompt, wrong, rng)` rows);
    exactly round(n * wrong_fraction) of them are wrong.

    The wrong ones make the SFT model imperfect on purpose, so later stages have something to fix.
    """
    if not 0.0 <= wrong_fraction <= 1.0:
        raise UserError(f"wrong_fraction must be in [0, 1], got {wrong_fraction}")
    rng = _file_rng(seed, "sft")
    prompts = sample_unique_prompts(task, n, rng, exclude)
    wrong = set(rng.sample(range(n), round(n * wrong_fraction)))
    demonstration = getattr(task, "demonstration", None)
    if demonstration is not None:  # a task whose demonstrations are conversations (tool calls)
        return [demonstration(p, i in wrong, rng) for i, p in enumerate(prompts)]
    return [
        {
            "prompt": p,
            "response": task.wrong_response(p, rng) if i in wrong else task.correct_response(p),
        }
        for i, p in enumerate(prompts)
    ]


def build_preference_rows(
    task: Task, n: int, seed: int, exclude: set[str] | None = None, what: str = "pairs"
) -> list[dict[str, str]]:
    """`n` preference pairs {prompt, chosen, rejected}: chosen correct, rejected a plausible mistake
    (the task's `rejected_response` where it has one, else its `wrong_response`).

    `what` names the seeded stream, so that two files of pairs from one seed differ.
    """
    rng = _file_rng(seed, what)
    rejected = getattr(task, "rejected_response", task.wrong_response)
    return [
        {"prompt": p, "chosen": task.correct_response(p), "rejected": rejected(p, rng)}
        for p in sample_unique_prompts(task, n, rng, exclude)
    ]


def build_prompt_rows(
    task: Task, n: int, seed: int, exclude: set[str] | None = None, what: str = "prompts"
) -> list[dict[str, str]]:
    """`n` rows {prompt} for PPO rollouts or evaluation; `what` names the seeded stream."""
    return [{"prompt": p} for p in sample_unique_prompts(task, n, _file_rng(seed, what), exclude)]


def prompt_of(row: dict[str, Any]) -> str:
    """A dataset row's prompt text (a conversational row's: its user turn's content)."""
    prompt = row["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def success_rate(task: Task, prompts: Sequence[str], responses: Sequence[str]) -> float:
    """Fraction of `responses` that solve their `prompts` (0.0 for none)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        return 0.0
    return sum(task.is_correct(p, r) for p, r in zip(prompts, responses)) / len(prompts)


def write_jsonl(path: Path, rows: Sequence[dict[str, str]]) -> None:
    """Write `rows` one JSON object per line, atomically (temp file then rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def write_task_dataset(
    task: Task,
    out_dir: str | Path,
    *,
    n_sft: int,
    n_pairs: int,
    n_prompts: int,
    n_eval_prompts: int,
    n_eval_pairs: int,
    wrong_fraction: float,
    seed: int,
) -> dict[str, Path]:
    """Write the datasets of all three stages as jsonl files in `out_dir`; returns name -> path.

    sft.jsonl {prompt, response}, pairs.jsonl / eval_pairs.jsonl {prompt, chosen, rejected},
    prompts.jsonl / eval_prompts.jsonl {prompt}. No prompt appears in two files or twice in one,
    so the eval files are held out from every stage's training data. Names are the file stems
    ('sft' -> out_dir/sft.jsonl).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    datasets: dict[str, list[dict[str, str]]] = {}
    for name in DATASET_FILES:
        if name == "eval_prompts.jsonl":
            rows = build_prompt_rows(task, n_eval_prompts, seed, used, what="eval_prompts")
        elif name == "eval_pairs.jsonl":
            rows = build_preference_rows(task, n_eval_pairs, seed, used, what="eval_pairs")
        elif name == "sft.jsonl":
            rows = build_sft_rows(task, n_sft, wrong_fraction, seed, used)
        elif name == "pairs.jsonl":
            rows = build_preference_rows(task, n_pairs, seed, used)
        else:
            rows = build_prompt_rows(task, n_prompts, seed, used)
        used.update(prompt_of(row) for row in rows)
        datasets[name] = rows
    paths = {}
    for name, rows in datasets.items():
        paths[name.removesuffix(".jsonl")] = out / name
        write_jsonl(out / name, rows)
    logger.info(
        "task '%s' (seed %d): %s in %s", task.name, seed,
        ", ".join(f"{len(rows)} {name}" for name, rows in datasets.items()), out,
    )
    return paths
