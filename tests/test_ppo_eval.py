"""PPO's held-out evaluation: greedy answers to --eval-data scored by --eval-reward-fn (default the
--reward-fn list) before training, every --eval-interval iterations and after the last; the same on
one and two ranks; after a resume, not again at step 0; the larger_number task it is shown on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.data.tasks import LargerNumberTask, get_task
from rlhf.errors import UserError
from tests.conftest import read_metrics, run_cli, write_jsonl
from tests.test_critic_free import answer_prompts, reward_file  # noqa: F401, F811

EVAL_REWARD = '''
def first_is_a(prompt: str, response: str, answer: str) -> float:
    """1 when the response starts with the letter a."""
    return float(response.startswith("a"))
'''


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    rng = random.Random(1)
    rows = [{"prompt": "".join(rng.choice("bcdefgh") for _ in range(5)), "answer": rng.choice("ab")} for _ in range(11)]
    return write_jsonl(tmp_path_factory.mktemp("held") / "eval.jsonl", rows)


def eval_args(model: Path, data: Path, reward: Path, held: Path, out: Path, *extra: str) -> list[str]:
    return ["ppo", "--actor", str(model), "--reward-fn", f"{reward}:contains_answer", "--data", str(data),
            "--eval-data", str(held), "--output", str(out), "--advantage-estimator", "grpo",
            "--generation-batch-size", "8", "--samples-per-prompt", "4", "--max-new-tokens", "4",
            "--lr", "1e-2", "--report-to", "none", "--optimizer-impl", "torch", "--micro-batch-size", "8", *extra]


def eval_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "eval_reward" in r]


@pytest.mark.usefixtures("one_thread")
def test_held_out_prompts_are_scored_at_zero_every_interval_and_at_the_end(tiny_model_dirs, answer_prompts,
                                                                            reward_file, held_out, tmp_path):
    out = tmp_path / "run"
    main(eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, out,
                   "--max-steps", "5", "--eval-interval", "2"))
    rows = eval_rows(out)
    assert [r["step"] for r in rows] == [0, 2, 4, 5]
    for r in rows:
        assert 0.0 <= r["eval/contains_answer"] <= 1.0 and r["eval_reward"] == r["eval/contains_answer"]
        # 11 prompts: the mean is a multiple of 1/11
        assert abs(r["eval/contains_answer"] * 11 - round(r["eval/contains_answer"] * 11)) < 1e-9
    assert all("elapsed_s" in r for r in read_metrics(out) if r["step"] > 0)
    elapsed = [r["elapsed_s"] for r in read_metrics(out) if r["step"] > 0]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/contains_answer"] == rows[-1]["eval/contains_answer"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    shown = [s for s in samples if s["table"] == "eval_samples"]
    assert {s["step"] for s in shown} == {0, 2, 4, 5} and all("contains_answer" in s for s in shown)


@pytest.mark.usefixtures("one_thread")
def test_eval_reward_fn_replaces_the_reward_functions_and_eval_is_greedy(tiny_model_dirs, answer_prompts,
                                                                        reward_file, held_out, tmp_path):
    other = tmp_path / "eval_reward.py"
    other.write_text(EVAL_REWARD)
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        main(eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, out, "--max-steps", "1",
                       "--eval-interval", "1", "--eval-reward-fn", f"{other}:first_is_a",
                       "--seed", "0" if name == "a" else "1"))
        runs.append(eval_rows(out))
    assert all({k for k in r if k.startswith("eval/")} == {"eval/first_is_a"} for r in runs[0])
    # Step 0 is the same model under two seeds: greedy answers do not depend on the sampling seed.
    assert runs[0][0]["eval/first_is_a"] == runs[1][0]["eval/first_is_a"]


@pytest.mark.usefixtures("one_thread")
def test_no_held_out_prompts_no_evaluation_and_a_bad_eval_function_fails_in_one_line(
        tiny_model_dirs, answer_prompts, reward_file, held_out, tmp_path, capsys):
    out = tmp_path / "plain"
    args = eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, out, "--max-steps", "1")
    args.remove("--eval-data")
    args.remove(str(held_out))
    main(args)
    assert eval_rows(out) == []
    with pytest.raises(SystemExit):
        main(eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, tmp_path / "bad",
                       "--max-steps", "1", "--eval-reward-fn", "no_such_task"))
    assert "--reward-fn 'no_such_task'" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_run_does_not_evaluate_step_zero_again(tiny_model_dirs, answer_prompts, reward_file, held_out,
                                                        tmp_path):
    out = tmp_path / "resumed"
    args = eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, out, "--eval-interval", "1",
                     "--save-interval", "1", "--save-final-checkpoint")
    main([*args, "--max-steps", "1"])
    first_elapsed = read_metrics(out)[-1]["elapsed_s"]
    main([*args, "--max-steps", "2", "--resume"])
    steps = [r["step"] for r in eval_rows(out)]
    assert steps == [0, 1, 2]
    assert read_metrics(out)[-1]["elapsed_s"] > first_elapsed  # the resumed run's clock goes on


@pytest.mark.slow
def test_two_ranks_score_the_held_out_prompts_as_one(tiny_model_dirs, answer_prompts, reward_file, held_out,
                                                     tmp_path):
    args = eval_args(tiny_model_dirs["llama"], answer_prompts, reward_file, held_out, tmp_path / "x",
                     "--max-steps", "1", "--eval-interval", "1")
    base = [a for a in args if a not in ("--output", str(tmp_path / "x"))]
    one = run_cli([*base, "--output", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli([*base, "--output", str(tmp_path / "two"), "--generation-batch-size", "4",
                   "--micro-batch-size", "4"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one_rank, two_ranks = eval_rows(tmp_path / "one")[0], eval_rows(tmp_path / "two")[0]
    assert one_rank["eval/contains_answer"] == two_ranks["eval/contains_answer"]


# ------------------------------------------------------------------ the larger_number task


@pytest.mark.parametrize(("response", "score"), [
    ("52", 1.0), ("52.", 1.0), ("The answer is 52", 1.0), (" 52\n", 1.0), ("37", 0.0), ("37 or 52", 0.0),
    ("", 0.0), ("fifty-two", 0.0), ("520", 0.0), ("-52", 0.0),
])
def test_larger_number_checker_on_hand_examples(response: str, score: float) -> None:
    prompt = "Which number is larger, 37 or 52? Answer with the number only."
    task = get_task("larger_number")
    assert task.score(prompt, response) == score
    assert task.score(f"Human: {prompt}\n\nAssistant:", response) == score  # a rendered dialog


def test_larger_number_prompts_answers_and_mistakes() -> None:
    task, rng = LargerNumberTask(), random.Random(0)
    for _ in range(200):
        prompt = task.sample_prompt(rng)
        a, b = task.numbers(prompt)
        assert a != b and 10 <= min(a, b) and max(a, b) <= 99
        assert task.is_correct(prompt, task.correct_response(prompt))
        assert not task.is_correct(prompt, task.wrong_response(prompt, rng))
    with pytest.raises(UserError, match="not a 'larger_number' task prompt"):
        task.numbers("What is one plus two?")
    with pytest.raises(ValueError):
        LargerNumberTask(low=5, high=5)
