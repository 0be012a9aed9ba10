"""Built-in tasks: the sort checker on hand examples, mistakes always wrong, seeded and disjoint data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.data.tasks import (
    DATASET_FILES,
    TASKS,
    SortTask,
    Task,
    build_preference_rows,
    build_prompt_rows,
    build_sft_rows,
    get_task,
    success_rate,
    user_request,
    write_task_dataset,
)
from rlhf.data.tasks.sort import MISTAKES
from rlhf.errors import UserError

SIZES = dict(n_sft=300, n_pairs=200, n_prompts=100, n_eval_prompts=50, n_eval_pairs=60)


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _prompts(rng: random.Random, n: int, task: SortTask | None = None) -> list[str]:
    task = task or SortTask()
    return [task.sample_prompt(rng) for _ in range(n)]


# ------------------------------------------------------------------ registry


def test_registry_gives_the_sort_task_and_rejects_unknown_names() -> None:
    assert "sort" in TASKS
    task = get_task("sort")
    assert isinstance(task, SortTask) and isinstance(task, Task) and task.name == "sort"
    with pytest.raises(UserError, match="unknown task 'sorting'.*sort"):
        get_task("sorting")


# ------------------------------------------------------------------ checker


@pytest.mark.parametrize(
    ("prompt", "response", "expected"),
    [
        ("sort: dbca", "abcd", 1.0),
        ("sort: dbca", " abcd", 1.0),  # the pipeline's responses start with a space
        ("sort: dbca", "abcd\n", 1.0),
        ("sort: qdmbx", "bdmqx", 1.0),
        ("sort: abc", "abc", 1.0),
        ("sort: zyxwvu", "uvwxyz", 1.0),
        ("sort: dbca", "abdc", 0.0),  # swap
        ("sort: dbca", "abd", 0.0),  # drop
        ("sort: dbca", "abbcd", 0.0),  # repeat
        ("sort: dbca", "abce", 0.0),  # replace
        ("sort: dbca", "dbca", 0.0),  # unsorted
        ("sort: dbca", "dcba", 0.0),  # descending
        ("sort: dbca", "ABCD", 0.0),
        ("sort: dbca", "a b c d", 0.0),
        ("sort: dbca", "abcd abcd", 0.0),
        ("sort: dbca", "", 0.0),
    ],
)
def test_score_on_hand_examples(prompt: str, response: str, expected: float) -> None:
    task = SortTask()
    assert task.score(prompt, response) == expected
    assert task.is_correct(prompt, response) is (expected == 1.0)


@pytest.mark.parametrize(
    "prompt",
    [
        "Human: sort: dbca\n\nAssistant:",  # as the pipeline renders it
        "<s>Human: sort: dbca\n\nAssistant:",
        "\n\nHuman: sort: zz\n\nAssistant: no\n\nHuman: sort: dbca\n\nAssistant:",  # last turn counts
        "  sort: dbca\n",
    ],
)
def test_score_reads_the_request_out_of_a_rendered_prompt(prompt: str) -> None:
    assert user_request(prompt) == "sort: dbca"
    assert SortTask().score(prompt, " abcd") == 1.0 and SortTask().score(prompt, " abdc") == 0.0


def test_correct_response_is_alphabetical() -> None:
    task = SortTask()
    assert task.correct_response("sort: qdmbx") == "bdmqx"
    assert task.correct_response("sort: cab") == "abc"
    custom = SortTask(alphabet="zyxwv", min_len=2, max_len=3)  # sort order is the alphabet's order
    assert custom.correct_response("sort: wz") == "zw"


@pytest.mark.parametrize(
    "prompt", ["sort: aab", "sort: ab", "sort: abcdefg", "sort: ab1", "Sort: abc", "abc", "sort abc", ""]
)
def test_score_rejects_prompts_the_task_cannot_have_made(prompt: str) -> None:
    with pytest.raises(UserError, match="not a 'sort' task prompt"):
        SortTask().score(prompt, "abc")


def test_invalid_task_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_len"):
        SortTask(min_len=1)
    with pytest.raises(ValueError, match="min_len"):
        SortTask(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="max_len < 4"):
        SortTask(alphabet="abcd", max_len=4)  # no letter left over for a "replace" mistake
    with pytest.raises(ValueError, match="must not repeat"):
        SortTask(alphabet="abca", max_len=2)
    with pytest.raises(ValueError, match="mistakes"):
        SortTask(mistakes=("typo",))
    with pytest.raises(ValueError, match="mistakes"):
        SortTask(mistakes=())


# ------------------------------------------------------------------ mistakes


def test_sampled_prompts_have_distinct_letters_and_short_chat_renderings() -> None:
    task = SortTask()
    for prompt in _prompts(random.Random(0), 500):
        letters = task.letters(prompt)
        assert task.min_len <= len(letters) <= task.max_len and len(set(letters)) == len(letters)
        # Human/Assistant rendering + the longest possible wrong answer stay far below 64 characters.
        assert len(f"Human: {prompt}\n\nAssistant: {task.correct_response(prompt)}x") < 48


def test_wrong_responses_are_always_judged_wrong() -> None:
    task = SortTask()
    rng = random.Random(1)
    for prompt in [*_prompts(rng, 2000), "sort: abc", "sort: abcdef"]:
        for _ in range(3):
            assert task.score(prompt, task.wrong_response(prompt, rng)) == 0.0


@pytest.mark.parametrize("kind", MISTAKES)
def test_each_mistake_kind_is_the_mistake_it_names(kind: str) -> None:
    task = SortTask(mistakes=(kind,))
    rng = random.Random(2)
    for prompt in [*_prompts(rng, 300, task), "sort: abc", "sort: xyz"]:
        letters, answer = task.letters(prompt), task.correct_response(prompt)
        wrong = task.wrong_response(prompt, rng)
        assert wrong != answer
        if kind == "unsorted" and letters != answer:
            assert wrong == letters
        elif kind in ("unsorted", "swap"):  # an already sorted prompt cannot be "copied" wrongly
            i = next(j for j in range(len(answer)) if wrong[j] != answer[j])
            assert wrong == answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == "drop":
            assert wrong in {answer[:i] + answer[i + 1 :] for i in range(len(answer))}
        elif kind == "repeat":
            assert wrong in {answer[: i + 1] + answer[i:] for i in range(len(answer))}
        else:  # replace: one letter that is not in the prompt, in order where a letter fits
            diff = [j for j in range(len(answer)) if wrong[j] != answer[j]]
            assert len(wrong) == len(answer) and len(diff) == 1 and wrong[diff[0]] not in letters
    # "ace": every position has a free letter that keeps the order, so a replace stays sorted.
    for _ in range(50):
        assert list(w := SortTask(mistakes=("replace",)).wrong_response("sort: eca", rng)) == sorted(w)


def test_wrong_response_draws_every_mistake_kind() -> None:
    task = SortTask()
    rng = random.Random(3)
    seen = set()
    for prompt in _prompts(rng, 400):
        letters, answer = task.letters(prompt), task.correct_response(prompt)
        wrong = task.wrong_response(prompt, rng)
        if wrong == letters:
            seen.add("unsorted")
        elif len(wrong) != len(answer):
            seen.add("drop" if len(wrong) < len(answer) else "repeat")
        else:
            seen.add("swap" if sorted(wrong) == sorted(answer) else "replace")
    assert seen == set(MISTAKES)


# ------------------------------------------------------------------ builders


def test_sft_rows_hold_exactly_the_requested_share_of_wrong_answers() -> None:
    task = SortTask()
    rows = build_sft_rows(task, 200, wrong_fraction=0.35, seed=0)
    assert len(rows) == 200 and len({r["prompt"] for r in rows}) == 200
    assert sum(not task.is_correct(r["prompt"], r["response"]) for r in rows) == 70
    right = build_sft_rows(task, 50, wrong_fraction=0.0, seed=0)
    assert all(task.is_correct(r["prompt"], r["response"]) for r in right)
    with pytest.raises(UserError, match="wrong_fraction"):
        build_sft_rows(task, 10, wrong_fraction=1.5, seed=0)


def test_preference_rows_prefer_the_correct_answer() -> None:
    task = SortTask()
    rows = build_preference_rows(task, 300, seed=0)
    assert all(task.is_correct(r["prompt"], r["chosen"]) for r in rows)
    assert not any(task.is_correct(r["prompt"], r["rejected"]) for r in rows)


def test_builders_are_deterministic_under_a_seed() -> None:
    task = SortTask()
    assert build_sft_rows(task, 100, 0.3, seed=7) == build_sft_rows(task, 100, 0.3, seed=7)
    assert build_preference_rows(task, 100, seed=7) == build_preference_rows(task, 100, seed=7)
    assert build_prompt_rows(task, 100, seed=7) == build_prompt_rows(task, 100, seed=7)
    assert build_sft_rows(task, 100, 0.3, seed=7) != build_sft_rows(task, 100, 0.3, seed=8)


def test_prompts_avoid_the_excluded_set_and_a_too_small_task_fails_loudly() -> None:
    task = SortTask(alphabet="abc", min_len=2, max_len=2)  # only 3 * 2 = 6 prompts exist
    first = build_prompt_rows(task, 4, seed=0)
    rest = build_prompt_rows(task, 2, seed=0, exclude={r["prompt"] for r in first})
    assert {r["prompt"] for r in first} | {r["prompt"] for r in rest} == {
        "sort: ab", "sort: ba", "sort: ac", "sort: ca", "sort: bc", "sort: cb"
    }
    with pytest.raises(UserError, match="cannot produce 7 distinct prompts"):
        build_prompt_rows(task, 7, seed=0)


def test_success_rate() -> None:
    task = SortTask()
    prompts = ["sort: cba", "sort: dbca", "sort: zyx", "sort: qdmbx"]
    assert success_rate(task, prompts, ["abc", " abcd", "xzy", "bdmq"]) == 0.5
    assert success_rate(task, [], []) == 0.0
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        success_rate(task, prompts[:2], ["abc"])


# ------------------------------------------------------------------ written datasets


def test_written_dataset_has_every_file_with_disjoint_held_out_prompts(tmp_path: Path) -> None:
    task = SortTask()
    paths = write_task_dataset(task, tmp_path, wrong_fraction=0.35, seed=0, **SIZES)
    assert sorted(paths) == sorted(name.removesuffix(".jsonl") for name in DATASET_FILES)
    files = {name: _read(path) for name, path in paths.items()}
    assert {name: len(rows) for name, rows in files.items()} == {
        "sft": 300, "pairs": 200, "prompts": 100, "eval_prompts": 50, "eval_pairs": 60,
    }
    assert set(files["sft"][0]) == {"prompt", "response"}
    assert set(files["pairs"][0]) == set(files["eval_pairs"][0]) == {"prompt", "chosen", "rejected"}
    assert set(files["prompts"][0]) == set(files["eval_prompts"][0]) == {"prompt"}
    all_prompts = [row["prompt"] for rows in files.values() for row in rows]
    assert len(all_prompts) == len(set(all_prompts)) == 710  # no prompt twice, in or across files
    assert sum(not task.is_correct(r["prompt"], r["response"]) for r in files["sft"]) == 105
    assert not list(tmp_path.glob("*.tmp"))


def test_written_dataset_is_reproducible_and_eval_files_ignore_train_sizes(tmp_path: Path) -> None:
    task = SortTask()
    a = write_task_dataset(task, tmp_path / "a", wrong_fraction=0.35, seed=0, **SIZES)
    b = write_task_dataset(task, tmp_path / "b", wrong_fraction=0.35, seed=0, **SIZES)
    resized = {**SIZES, "n_sft": 500, "n_pairs": 10}
    bigger = write_task_dataset(task, tmp_path / "c", wrong_fraction=0.2, seed=0, **resized)
    other = write_task_dataset(task, tmp_path / "d", wrong_fraction=0.35, seed=1, **SIZES)
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes()
        assert a[name].read_bytes() != other[name].read_bytes()
    for name in ("eval_prompts", "eval_pairs"):
        assert a[name].read_bytes() == bigger[name].read_bytes()


def test_dataset_is_the_same_in_a_fresh_process_with_another_hash_seed(tmp_path: Path) -> None:
    here = write_task_dataset(SortTask(), tmp_path / "here", wrong_fraction=0.35, seed=3, **SIZES)
    code = (
        "import sys; from rlhf.data.tasks import SortTask, write_task_dataset; "
        f"write_task_dataset(SortTask(), sys.argv[1], wrong_fraction=0.35, seed=3, **{SIZES!r})"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-c", code, str(tmp_path / "there")]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    for name, path in here.items():
        assert path.read_bytes() == (tmp_path / "there" / path.name).read_bytes(), name
