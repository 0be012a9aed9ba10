"""TRL's reward-function convention in full: the arguments TRL passes (messages for
conversational rows, completion_ids, trainer_state, log_metric, log_extra, every column), None
leaving a sample to the other sources (TRL's nansum) with nanmean metrics, unscored samples as
one-line errors, async functions awaited together; TRL's documented examples in a real
`rlhf ppo --advantage-estimator grpo` run; and scripts/check_trl_reward_functions.py when trl is
importable."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf.cli import main
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.reward_batch import RewardBatch, trainer_state
from rlhf.reward_functions import load_reward_function
from rlhf.stages.reward_sources import FunctionRewardSource, WeightedReward, reward_metrics, rollout_batch
from rlhf.stages.rollouts import Rollouts, merge_rollouts, select_rows
from tests.conftest import REPO, read_metrics, run_cli, write_jsonl

EXAMPLES = REPO / "scripts" / "trl_reward_examples.py"

FUNCTIONS = '''
import asyncio
import time

SEEN = {}


def record(**kwargs):
    SEEN.clear()
    SEEN.update(kwargs)
    return [0.0] * len(kwargs["completions"])


def ids_only(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def only_kwargs(**kwargs):
    return [1.0] * len(kwargs["completions"])


def first(prompts, completions):
    return [1.0, None, 3.0]


def second(completions):
    return [None, 2.0, 4.0]


def nobody(completions):
    return [None, None, 1.0]


def per_sample_none(prompt, response):
    return None if response == "skip" else 1.0


def returns_nan(completions):
    return [float("nan")] * len(completions)


def bad_extra(completions, log_extra):
    log_extra("col", [1])
    return [0.0] * len(completions)


def bad_metric(completions, log_metric):
    log_metric("m", "high")
    return [0.0] * len(completions)


async def slow_a(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [1.0] * len(completions)


async def slow_b(prompts, completions, **kwargs):
    await asyncio.sleep(0.3)
    return [2.0] * len(completions)


async def slow_rows(prompt, response):
    await asyncio.sleep(0.3)
    return len(response)


async def async_raises(completions):
    await asyncio.sleep(0)
    raise KeyError("no judge")


class Judge:
    async def __call__(self, completions, **kwargs):
        return [0.5] * len(completions)


judge = Judge()
'''


@pytest.fixture
def functions_file(tmp_path: Path) -> Path:
    path = tmp_path / "trl_functions.py"
    path.write_text(FUNCTIONS)
    return path


def fn(path: Path, name: str):
    return load_reward_function(f"{path}:{name}")


MESSAGES = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
            [{"role": "user", "content": "sort: ba"}], [{"role": "user", "content": "hi"}]]


def three_rows(**kwargs) -> RewardBatch:
    return RewardBatch(MESSAGES, ["4", "ab", "hello"], [{"task": "math", "answer": "4"}, {"task": "sort"}, {}],
                       **kwargs)


# ------------------------------------------------------------------ what TRL's convention passes


def test_trl_arguments_for_standard_and_conversational_rows(functions_file: Path) -> None:
    record = fn(functions_file, "record")
    assert record.batched and record.keywords is None
    state = trainer_state(3, 10, 4)
    batch = three_rows(conversational=[True, False, False], completion_ids=[[5, 2], [7, 8, 2], [9]],
                       trainer_state=state)
    assert record(batch) == [0.0, 0.0, 0.0]
    seen = sys.modules[record.fn.__module__].SEEN
    assert sorted(seen) == sorted(["prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                                   "log_metric", "task", "answer"])
    # A conversational row: its prompt's messages and the response as one assistant message (TRL's).
    assert seen["prompts"] == [MESSAGES[0], "sort: ba", "hi"] and seen["prompts"][0] is not MESSAGES[0]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], "ab", "hello"]
    assert seen["completion_ids"] == [[5, 2], [7, 8, 2], [9]]
    assert seen["task"] == ["math", "sort", None] and seen["answer"] == ["4", None, None]
    assert (state.global_step, state.max_steps, state.epoch, state.num_train_epochs) == (3, 10, 0.75, 3)
    assert seen["trainer_state"] is state and callable(seen["log_extra"]) and callable(seen["log_metric"])


def test_trl_signatures_without_completions_are_trl_style(functions_file: Path) -> None:
    ids_only, only_kwargs = fn(functions_file, "ids_only"), fn(functions_file, "only_kwargs")
    assert ids_only.batched and only_kwargs.batched
    batch = three_rows(completion_ids=[[1, 2], [3], []])
    assert ids_only(batch) == [2.0, 1.0, 0.0] and only_kwargs(batch) == [1.0, 1.0, 1.0]


def test_completion_ids_are_the_response_tokens_up_to_eos_unpadded() -> None:
    pad, eos = 0, 2
    sequences = torch.tensor([[pad, 5, 6, 7, 2, pad], [4, 5, 6, 8, 9, 2], [pad, pad, 6, 2, pad, pad]])
    action = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    rollouts = Rollouts(sequences, torch.ones_like(sequences), action, torch.ones(3, dtype=torch.bool),
                        MESSAGES, ["a", "b", "c"], [{}] * 3, {}, conversational=[True, False, True])
    batch = rollout_batch(rollouts, trainer_state(0, 2, 1))
    assert batch.completion_ids == [[6, 7, eos], [8, 9, eos], [eos]]
    assert batch.conversational == [True, False, True] and batch.trainer_state.max_steps == 2


def test_log_metric_and_log_extra_are_collected(tmp_path: Path) -> None:
    accuracy = load_reward_function(f"{EXAMPLES}:accuracy_with_logging")
    batch = RewardBatch.of_texts(["a", "b"], [r"so \boxed{4}", "no idea"], [{"ground_truth": "4"},
                                                                          {"ground_truth": "7"}])
    assert accuracy(batch) == [1.0, 0.0]
    assert batch.log.metrics == {"accuracy": [0.5]}
    assert batch.log.extra == {"golden_answer": ["4", "7"], "extracted_answer": ["4", "[none]"]}


@pytest.mark.parametrize("name, message", [
    ("bad_extra", r"log_extra\('col', \.\.\.\) got 1 values for 3 completions; log one value per completion"),
    ("bad_metric", r"log_metric\('m', 'high'\): expected a metric name \(str\) and a number"),
    ("returns_nan", r"row 0 .*returned nan \(float\), expected a finite number \(return None to leave"),
])
def test_bad_logs_and_nan_are_one_line_errors_naming_the_function(functions_file: Path, name: str,
                                                                    message: str) -> None:
    with pytest.raises(UserError, match=message) as exc:
        fn(functions_file, name)(three_rows())
    assert f"--reward-fn {functions_file}:{name}:" in str(exc.value) and "\n" not in str(exc.value)


# ------------------------------------------------------------------ None: TRL's nansum


def _weighted(functions_file: Path, names: list[str], weights: list[float]) -> WeightedReward:
    return WeightedReward([FunctionRewardSource(fn(functions_file, n)) for n in names], weights)


def test_none_leaves_a_sample_to_the_other_sources(functions_file: Path) -> None:
    reward = _weighted(functions_file, ["first", "second"], [1.0, 0.5])
    seq, attn = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)
    # first [1, None, 3], second [None, 2, 4]: 1 * 1 | 0.5 * 2 | 1 * 3 + 0.5 * 4
    assert reward.score(seq, attn, three_rows()).tolist() == [1.0, 1.0, 5.0]
    first, second = reward.components["first"].tolist(), reward.components["second"].tolist()
    assert first[0] == 1.0 and math.isnan(first[1]) and first[2] == 3.0
    assert math.isnan(second[0]) and second[1:] == [2.0, 4.0]
    metrics = reward_metrics(reward.components, {"acc": [0.5, 1.0]}, DistributedContext.initialize(), True)
    # nanmean over the scored samples: (1 + 3) / 2 and (2 + 4) / 2; 2 of 3 scored each
    assert metrics == {"reward/first": 2.0, "reward/second": 3.0, "reward_scored_fraction/first": 2 / 3,
                       "reward_scored_fraction/second": 2 / 3, "reward_fn/acc": 0.75}


def test_a_sample_no_source_scores_is_a_one_line_error(functions_file: Path) -> None:
    reward = _weighted(functions_file, ["first", "nobody"], [1.0, 1.0])
    seq, attn = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)
    with pytest.raises(UserError, match=r"row 1 of the batch \(prompt 'sort: ba'\) has no score: every reward "
                                        r"source \(first, nobody\) returned None for it") as exc:
        reward.score(seq, attn, three_rows())
    assert "\n" not in str(exc.value)


def test_per_sample_functions_may_return_none(functions_file: Path) -> None:
    scores = fn(functions_file, "per_sample_none")(RewardBatch.of_texts(["p", "q"], ["fine", "skip"]))
    assert scores == [1.0, None]


# ------------------------------------------------------------------ async functions


def test_async_functions_of_a_batch_run_together(functions_file: Path) -> None:
    reward = _weighted(functions_file, ["slow_a", "first", "slow_b", "judge"], [1.0, 1.0, 1.0, 2.0])
    assert all(s.function.is_async for i, s in enumerate(reward.sources) if i != 1)
    seq, attn = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)
    started = time.perf_counter()
    got = reward.score(seq, attn, three_rows())
    elapsed = time.perf_counter() - started
    # 1 + first + 2 + 2 * 0.5: [5, 4, 7]; two 0.3 s sleeps overlapped
    assert got.tolist() == [5.0, 4.0, 7.0] and elapsed < 0.55, elapsed
    assert list(reward.components) == ["slow_a", "first", "slow_b", "judge"]


def test_per_sample_async_rows_run_together(functions_file: Path) -> None:
    slow_rows = fn(functions_file, "slow_rows")
    assert slow_rows.is_async and not slow_rows.batched
    started = time.perf_counter()
    assert slow_rows(RewardBatch.of_texts(["a", "b", "c"], ["x", "yy", "zzz"])) == [1.0, 2.0, 3.0]
    assert time.perf_counter() - started < 0.55


def test_async_errors_are_one_line_and_rlhf_debug_reraises(functions_file: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    raises = fn(functions_file, "async_raises")
    with pytest.raises(UserError, match=r"on a batch of 3 rows \(first prompt '2\+2\?'\): raised KeyError: "
                                        r"'no judge' \(RLHF_DEBUG=1 shows the traceback\)") as exc:
        raises(three_rows())
    assert "\n" not in str(exc.value)
    monkeypatch.setenv("RLHF_DEBUG", "1")
    with pytest.raises(KeyError, match="no judge"):
        raises(three_rows())


# ------------------------------------------------------------------ rollouts carry the new columns


def test_rollouts_carry_conversational_flags_and_logged_columns() -> None:
    def part(rows: int, tag: int, extra: dict | None) -> Rollouts:
        seq = torch.full((rows, 3), tag)
        return Rollouts(seq, torch.ones_like(seq), torch.ones(rows, 3, dtype=torch.bool),
                        torch.ones(rows, dtype=torch.bool), [[{"role": "user", "content": str(tag)}]] * rows,
                        [str(tag)] * rows, [{}] * rows, {}, conversational=[tag == 1] * rows, extra=extra)

    merged = merge_rollouts([part(2, 1, {"col": ["a", "b"]}), part(1, 2, None)], pad_token_id=0)
    assert merged.conversational == [True, True, False] and merged.extra == {"col": ["a", "b", None]}
    picked = select_rows(merged, [2, 0])
    assert picked.conversational == [False, True] and picked.extra == {"col": [None, "a"]}


# ------------------------------------------------------------------ TRL's examples in `rlhf ppo`


def _run_examples(model: Path, rows: list[dict], names: list[str], out: Path, tmp_path: Path) -> list[dict]:
    data = write_jsonl(tmp_path / f"{out.name}.jsonl", rows)
    args = ["ppo", "--actor", str(model), "--data", str(data), "--output", str(out), "--advantage-estimator", "grpo",
            "--generation-batch-size", "8", "--samples-per-prompt", "4", "--max-new-tokens", "6",
            "--max-steps", "2", "--lr", "1e-3", "--report-to", "none", "--optimizer-impl", "torch",
            "--micro-batch-size", "8"]
    for name in names:
        args += ["--reward-fn", f"{EXAMPLES}:{name}"]
    main(args)
    return read_metrics(out)


def _probe_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.usefixtures("one_thread")
def test_trl_examples_run_unchanged_on_standard_rows(tiny_model_dirs, tmp_path, monkeypatch) -> None:
    from scripts.trl_reward_examples import STANDARD

    monkeypatch.setenv("TRL_REWARD_PROBE", str(tmp_path / "probe.jsonl"))
    rows = [{"prompt": f"{a}+{a}=", "task": "math" if a % 2 else "coding", "ground_truth": str(2 * a)}
            for a in range(8)]
    metrics = _run_examples(tiny_model_dirs["llama"], rows, STANDARD, tmp_path / "standard", tmp_path)
    assert len(metrics) == 2
    for name in STANDARD:
        # metrics.jsonl writes NaN (a source that scored no sample) as null
        assert all((m[f"reward/{name}"] is not None) == (m[f"reward_scored_fraction/{name}"] > 0)
                   for m in metrics), name
    # Example 4's None: each row is scored by its task's function alone (an iteration's 2 prompts
    # may both be math: then coding's reward/ is NaN, as TRL's nanmean).
    assert all(m["reward_scored_fraction/math_reward_func"] + m["reward_scored_fraction/coding_reward_func"] == 1
               for m in metrics)
    assert [m["reward_fn/global_step"] for m in metrics] == [0.0, 1.0]
    assert [m["reward_fn/progress"] for m in metrics] == [0.0, 0.5] and "reward_fn/accuracy" in metrics[0]
    samples = [json.loads(line) for line in (tmp_path / "standard" / "samples.jsonl").read_text().splitlines()]
    assert samples and all({"golden_answer", "extracted_answer"} <= s.keys() for s in samples)
    calls = _probe_records(tmp_path / "probe.jsonl")
    assert [c["global_step"] for c in calls] == [0, 1] and {c["max_steps"] for c in calls} == {2}
    assert all(c["prompt"] == "str" and c["completion"] == "str" and c["completion_ids"] and c["column_lists"]
               and c["logs_callable"] and c["columns"] == ["ground_truth", "task"] for c in calls), calls


@pytest.mark.usefixtures("one_thread")
def test_trl_examples_run_unchanged_on_conversational_rows(tiny_model_dirs, tmp_path, monkeypatch) -> None:
    from scripts.trl_reward_examples import CONVERSATIONAL

    monkeypatch.setenv("TRL_REWARD_PROBE", str(tmp_path / "probe.jsonl"))
    rows = [{"prompt": [{"role": "system", "content": "think first"}, {"role": "user", "content": f"{a}*2?"}],
             "task": "math" if a % 2 else "coding"} for a in range(8)]
    metrics = _run_examples(tiny_model_dirs["llama"], rows, CONVERSATIONAL, tmp_path / "chat", tmp_path)
    assert len(metrics) == 2 and all(m["reward/format_reward_func"] == 0.0 for m in metrics)  # untrained: no tags
    assert all(m["reward/reward_num_tokens"] >= 1 for m in metrics)
    calls = _probe_records(tmp_path / "probe.jsonl")
    assert all(c["prompt"] == "list" and c["prompt_roles"] == ["system", "user"] and c["completion"] == "list"
               and c["completion_message"] == ["content", "role"] and c["columns"] == ["task"] for c in calls), calls


def test_logged_metrics_columns_and_none_over_two_ranks_with_dynamic_sampling(tiny_model_dirs, tmp_path) -> None:
    """Groups of 4 over two ranks of 2 rows: log_metric names are gathered from both ranks, the
    log_extra columns and None scores follow the rows dynamic sampling keeps."""
    rows = [{"prompt": f"{a}+{a}=", "task": "math" if a % 2 else "coding", "ground_truth": str(2 * a)}
            for a in range(8)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "two"
    args = ["ppo", "--actor", str(tiny_model_dirs["llama"]), "--data", str(data), "--output", str(out),
            "--advantage-estimator", "grpo", "--generation-batch-size", "2", "--samples-per-prompt", "4",
            "--max-new-tokens", "6", "--max-steps", "2", "--report-to", "none", "--optimizer-impl", "torch",
            "--micro-batch-size", "2", "--dynamic-sampling", "--seed", "1"]
    for name in ("accuracy_with_logging", "math_reward_func", "coding_reward_func", "curriculum_reward"):
        args += ["--reward-fn", f"{EXAMPLES}:{name}"]
    done = run_cli(args, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["reward_fn/global_step"] for m in metrics] == [0.0, 1.0]
    assert all(m["reward_scored_fraction/math_reward_func"] + m["reward_scored_fraction/coding_reward_func"] == 1
               for m in metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["golden_answer"] == str(2 * int(s["prompt"].split("+")[0])) for s in samples)


# ------------------------------------------------------------------ the same file in TRL's GRPOTrainer


TRL_PYTHON = os.environ.get("TRL_PYTHON")  # a python with trl (e.g. /path/to/trl-venv/bin/python)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None and not TRL_PYTHON,
                    reason="needs trl here (pip install trl) or TRL_PYTHON naming a python with trl")
def test_check_script_runs_the_examples_in_trl_and_rlhf(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "scripts" / "check_trl_reward_functions.py"), "--workdir", str(tmp_path)]
    if importlib.util.find_spec("trl") is None:
        command += ["--trl-python", str(TRL_PYTHON)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"], result
