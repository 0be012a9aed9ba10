"""The `arithmetic_words` task: hand-checked answers, mistakes always wrong, rendered prompts scored."""

from __future__ import annotations

import random

import pytest

from rlhf.data.tasks import Task, get_task, write_task_dataset
from rlhf.data.tasks.arithmetic import ArithmeticWordsTask
from rlhf.errors import UserError


@pytest.mark.parametrize(
    "prompt,response,score",
    [
        ("What is seven plus eight? Answer with the number only.", "15", 1.0),
        ("What is seven plus eight? Answer with the number only.", " 15.", 1.0),
        ("What is seven plus eight? Answer with the number only.", "The answer is 15", 1.0),
        ("What is seven plus eight? Answer with the number only.", "16", 0.0),
        ("What is seven plus eight? Answer with the number only.", "fifteen", 0.0),  # a number, in digits
        ("What is twenty minus three? Answer with the number only.", "17", 1.0),
        ("What is six times nine? Answer with the number only.", "54", 1.0),
        ("What is zero times nine? Answer with the number only.", "0", 1.0),
        ("What is six times nine? Answer with the number only.", "", 0.0),
    ],
)
def test_checker_on_hand_examples(prompt: str, response: str, score: float) -> None:
    assert get_task("arithmetic_words").score(prompt, response) == score


def test_rendered_dialog_prompts_are_scored_and_others_refused() -> None:
    task = ArithmeticWordsTask()
    rendered = "<s>\n\nHuman: What is two plus two? Answer with the number only.\n\nAssistant:"
    assert task.score(rendered, "4") == 1.0
    with pytest.raises(UserError, match="arithmetic_words"):
        task.score("sort: abc", "4")


def test_prompts_are_in_range_and_mistakes_never_right() -> None:
    task = ArithmeticWordsTask()
    assert isinstance(task, Task)
    rng = random.Random(0)
    for _ in range(2000):
        prompt = task.sample_prompt(rng)
        answer = task.answer(prompt)
        assert answer >= 0
        assert task.is_correct(prompt, task.correct_response(prompt))
        assert task.score(prompt, task.wrong_response(prompt, rng)) == 0.0


def test_dataset_files_are_disjoint(tmp_path) -> None:
    paths = write_task_dataset(ArithmeticWordsTask(), tmp_path, n_sft=200, n_pairs=200, n_prompts=100,
                               n_eval_prompts=50, n_eval_pairs=50, wrong_fraction=0.3, seed=0)
    import json

    prompts = [json.loads(line)["prompt"] for p in paths.values() for line in p.read_text().splitlines()]
    assert len(prompts) == 600 and len(set(prompts)) == 600  # about 790 distinct prompts exist


@pytest.mark.parametrize(("response", "score"), [("52", 1.0), ("52.", 1.0), ("The larger is 52", 1.0), ("37", 0.0),
                                                 ("37 is smaller than 52", 0.0), ("fifty-two", 0.0), ("", 0.0)])
def test_larger_number_checker_reads_the_first_number(response: str, score: float) -> None:
    task = get_task("larger_number")
    prompt = "Which number is larger, 37 or 52? Answer with the number only."
    assert task.score(prompt, response) == score
    assert task.score(f"Human: {prompt}\n\nAssistant:", response) == score  # the rendered dialog too
    assert task.correct_response(prompt) == "52" and task.wrong_response(prompt, random.Random(0)) == "37"


def test_larger_number_pairs_reject_numbers_outside_the_question_too() -> None:
    """Against the smaller number alone a reward model can rank every pair right by preferring large
    numbers; half the rejected answers are numbers of the range that the question does not hold."""
    from rlhf.data.tasks import build_preference_rows

    task = get_task("larger_number")
    rows = build_preference_rows(task, 400, seed=0)
    outside = 0
    for row in rows:
        a, b = task.numbers(row["prompt"])
        assert row["chosen"] == str(max(a, b)) and task.score(row["prompt"], row["rejected"]) == 0.0
        if int(row["rejected"]) not in (a, b):
            outside += 1
            assert task.low <= int(row["rejected"]) <= task.high
        else:
            assert row["rejected"] == str(min(a, b))
    assert 150 <= outside <= 250
    # The wrong SFT demonstrations stay the smaller number.
    rng = __import__("random").Random(0)
    assert all(task.wrong_response(r["prompt"], rng) == str(min(task.numbers(r["prompt"]))) for r in rows)
