"""`--reward-fn` specs (built-in task, file.py:function, module:function), the per-sample and
TRL batch conventions, one-line errors naming the function and the row, RLHF_DEBUG, weighted
reward sources with per-source components, and data rows' extra columns in ParsedRow.fields."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf.config import PPOConfig
from rlhf.data.formats import parse_row
from rlhf.data.sources import RawRow, load_rows
from rlhf.engine.distributed import DistributedContext
from rlhf.errors import UserError
from rlhf.reward_batch import RewardBatch
from rlhf.reward_functions import RewardFunction, load_reward_function, load_reward_functions, prompt_text
from rlhf.stages.reward_sources import (
    FunctionRewardSource,
    RewardModelSource,
    WeightedReward,
    build_reward_source,
    check_reward_sources,
)
from tests.conftest import write_jsonl

REWARDS = '''
import math


def contains_answer(prompt, response, answer):
    """Per sample, reads the row's `answer` column."""
    return answer in response


def length(prompt, response):
    """Per sample, ignores the row's columns."""
    return len(response)


def with_kwargs(prompt, response, **fields):
    return float(len(fields)) + (0.5 if fields.get("answer") == response else 0.0)


def trl_accuracy(prompts, completions, answer, **kwargs):
    """TRL's batch convention: columns come as lists."""
    return [1.0 if a in c else 0.0 for a, c in zip(answer, completions)]


def trl_no_prompts(completions, **kwargs):
    return [float(len(c)) for c in completions]


def raises(prompt, response):
    if response == "boom":
        raise ValueError("cannot parse " + response)
    return 1.0


def returns_text(prompt, response):
    return "x" if response == "bad" else 1.0


def returns_nan(prompt, response):
    return math.nan if response == "bad" else 0.0


def wrong_count(prompts, completions):
    return [1.0] * (len(completions) - 1)


def not_a_list(prompts, completions):
    return 1.0


NOT_CALLABLE = 3
'''


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def spec(path: Path, name: str) -> str:
    return f"{path}:{name}"


ROWS = [{"answer": "42", "level": 1}, {"answer": "7", "level": 2}]


def call(fn: RewardFunction, prompts: list[str], responses: list[str], fields: list[dict]) -> list[float | None]:
    """`fn` over standard rows whose prompts are one user turn each."""
    return fn(RewardBatch.of_texts(prompts, responses, fields))


def test_per_sample_function_gets_the_rows_answer_field(rewards_file: Path) -> None:
    fn = load_reward_function(spec(rewards_file, "contains_answer"))
    assert fn.name == "contains_answer" and not fn.batched
    assert call(fn, ["what is 6*7?", "3+4?"], ["it is 42", "it is 8"], ROWS) == [1.0, 0.0]  # bool -> 1.0 / 0.0


def test_per_sample_function_ignores_columns_it_does_not_take(rewards_file: Path) -> None:
    assert call(load_reward_function(spec(rewards_file, "length")), ["p", "q"], ["abc", "de"], ROWS) == [3.0, 2.0]


def test_kwargs_function_gets_every_column(rewards_file: Path) -> None:
    fn = load_reward_function(spec(rewards_file, "with_kwargs"))
    assert call(fn, ["p", "q"], ["42", "no"], ROWS) == [2.5, 2.0]


def test_trl_batch_function_gets_columns_as_lists(rewards_file: Path) -> None:
    fn = load_reward_function(spec(rewards_file, "trl_accuracy"))
    assert fn.batched
    assert call(fn, ["p", "q"], ["42!", "8"], ROWS) == [1.0, 0.0]
    # TRL functions often take `prompts` only through **kwargs, or not at all.
    assert call(load_reward_function(spec(rewards_file, "trl_no_prompts")), ["p"], ["abcd"], [{}]) == [4.0]


def test_module_function(rewards_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(rewards_file.parent))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    fn = load_reward_function("my_rewards:contains_answer")
    assert fn.name == "contains_answer" and call(fn, ["p"], ["42"], [{"answer": "42"}]) == [1.0]
    with pytest.raises(UserError, match=r"importing module no_such_module_xyz failed: ModuleNotFoundError"):
        load_reward_function("no_such_module_xyz:f")


def test_built_in_task_is_a_function() -> None:
    fn = load_reward_function("sort")
    assert fn.name == "sort"
    assert call(fn, ["sort: cab", "sort: cab"], ["abc", "acb"], [{"answer": "x"}, {}]) == [1.0, 0.0]


def test_prompt_text_is_the_last_user_turn() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort: cab"}]
    assert prompt_text(messages) == "sort: cab"
    dialog = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "sort: ba"}]
    assert prompt_text(dialog) == "sort: ba"


def test_duplicate_names_are_made_unique(rewards_file: Path) -> None:
    names = [f.name for f in load_reward_functions(
        [spec(rewards_file, "length"), spec(rewards_file, "length"), "sort"], reserved=["reward_model"])]
    assert names == ["length", "length_2", "sort"]


@pytest.mark.parametrize("bad, message", [
    ("missing.py:f", r"--reward-fn missing.py:f: no file missing.py"),
    ("{file}:nope", r"--reward-fn .*my_rewards.py:nope: .*has no function 'nope' \(its functions: .*contains_answer"),
    ("{file}:NOT_CALLABLE", r"'NOT_CALLABLE' in .* is a int, not a function"),
    ("sorting", r"--reward-fn 'sorting': not a built-in task name \(.*sort.*\), path/to/file.py:function or "
                r"package.module:function"),
    ("my_rewards.py", r"name the function: my_rewards.py:FUNCTION"),
    ("a b:f", r"neither a .py file nor a module name"),
])
def test_bad_specs_are_one_line_user_errors(rewards_file: Path, bad: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as exc:
        load_reward_function(bad.format(file=rewards_file))
    assert "\n" not in str(exc.value)


def test_a_file_that_fails_to_import_says_why(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import os\nraise RuntimeError('no GPU\\nhere')\n")
    with pytest.raises(UserError, match=r"importing .*broken.py failed: RuntimeError: no GPU here") as exc:
        load_reward_function(f"{path}:f")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name, responses, message", [
    ("raises", ["fine", "boom"], r"row 1 of the batch \(prompt 'second prompt'\): raised ValueError: "
                                 r"cannot parse boom"),
    ("returns_text", ["ok", "bad"], r"row 1 of the batch \(prompt 'second prompt'\): returned 'x' \(str\), "
                                    r"expected a finite number"),
    ("returns_nan", ["ok", "bad"], r"row 1 .*returned nan \(float\), expected a finite number \(return None to "
                                   r"leave the sample unscored\)"),
    ("wrong_count", ["a", "b"], r"on a batch of 2 rows \(first prompt 'first prompt'\): returned 1 values for 2 "
                                r"completions"),
    ("not_a_list", ["a", "b"], r"returned 1.0 \(float\), expected a list of 2 numbers"),
    ("contains_answer", ["a", "b"], r"row 0 .*no field 'answer' that the function requires"),
])
def test_bad_calls_name_the_function_and_the_row(rewards_file: Path, name: str, responses: list[str],
                                                  message: str) -> None:
    fn = load_reward_function(spec(rewards_file, name))
    with pytest.raises(UserError, match=message) as exc:
        call(fn, ["first prompt", "second prompt"], responses, [{}, {}])
    assert f"--reward-fn {spec(rewards_file, name)}:" in str(exc.value) and "\n" not in str(exc.value)


def test_long_prompts_are_shortened_in_errors(rewards_file: Path) -> None:
    fn = load_reward_function(spec(rewards_file, "raises"))
    with pytest.raises(UserError, match=r"prompt '" + "y" * 57 + r"\.\.\.'"):
        call(fn, ["y" * 500], ["boom"], [{}])


def test_rlhf_debug_reraises_the_original_exception(rewards_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fn = load_reward_function(spec(rewards_file, "raises"))
    monkeypatch.setenv("RLHF_DEBUG", "1")
    with pytest.raises(ValueError, match="cannot parse boom"):
        call(fn, ["p"], ["boom"], [{}])


# ------------------------------------------------------------------ weighted sources


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long)


def test_weighted_reward_sums_weighted_sources_and_keeps_raw_components(rewards_file: Path) -> None:
    config = PPOConfig(reward_fn=[spec(rewards_file, "contains_answer"), spec(rewards_file, "length")],
                       reward_weights=[1.0, 0.5])
    reward = build_reward_source(config, DistributedContext.initialize(), None, "fp32")
    assert isinstance(reward, WeightedReward) and reward.normalization is None and reward.names == [
        "contains_answer", "length"]
    assert reward.model_source is None and not reward.retokenizes and reward.take_truncated() == 0
    prompts = [[{"role": "user", "content": "6*7?"}], [{"role": "user", "content": "3+4?"}]]
    seq, attn = _batch(2)
    got = reward.score(seq, attn, RewardBatch(prompts, ["42", "eight"], ROWS))
    # contains_answer: [1, 0]; length: [2, 5] -> 1 * [1, 0] + 0.5 * [2, 5] = [2, 2.5]
    assert got.dtype == torch.float32 and got.tolist() == [2.0, 2.5]
    assert {k: v.tolist() for k, v in reward.components.items()} == {"contains_answer": [1.0, 0.0],
                                                                      "length": [2.0, 5.0]}


def test_sources_are_normalised_by_their_own_statistics() -> None:
    class Constant:
        name, normalization = "reward_model", (1.0, 2.0)

        def score(self, sequences, attention_mask, batch, shared_prefix=0):
            return torch.tensor([5.0, 1.0])

    task = FunctionRewardSource(load_reward_function("sort"))
    reward = WeightedReward([Constant(), task], [2.0, 1.0])
    seq, attn = _batch(2)
    prompts = [[{"role": "user", "content": "sort: cba"}]] * 2
    # 2 * ([5, 1] - 1) / 2 + [1, 0] = [5, 0]
    assert reward.score(seq, attn, RewardBatch(prompts, ["abc", "bac"])).tolist() == [5.0, 0.0]
    assert reward.components["reward_model"].tolist() == [5.0, 1.0] and reward.components["sort"].tolist() == [1, 0]


def test_retokenising_model_source_counts_through_the_weighted_reward() -> None:
    model = RewardModelSource(None, (0.5, 2.0), tokenizer="its own", truncated=3)  # type: ignore[arg-type]
    reward = WeightedReward([model, FunctionRewardSource(load_reward_function("sort"))], [1.0, 1.0])
    assert reward.model_source is model and reward.retokenizes and reward.model_normalization == (0.5, 2.0)
    assert reward.take_truncated() == 3 and reward.take_truncated() == 0 and model.truncated == 0
    functions_only = WeightedReward([FunctionRewardSource(load_reward_function("sort"))], [1.0])
    assert not functions_only.retokenizes and functions_only.take_truncated() == 0
    assert functions_only.model_normalization is None


def test_reward_weights_count_must_match_the_sources(rewards_file: Path) -> None:
    config = PPOConfig(reward="runs/rm/model", reward_fn=[spec(rewards_file, "length"), "sort"],
                       reward_weights=[1.0, 0.5])
    with pytest.raises(UserError, match=r"--reward-weights 1,0.5: 2 weights for 3 reward sources "
                                        r"\(reward_model, length, sort\)"):
        check_reward_sources(config)  # no model is loaded for this check


def test_functions_are_checked_before_any_model_loads(rewards_file: Path) -> None:
    config = PPOConfig(reward="no/such/reward/model", reward_fn=[spec(rewards_file, "nope")])
    with pytest.raises(UserError, match="has no function 'nope'"):
        build_reward_source(config, DistributedContext.initialize(), None, "fp32")


# ------------------------------------------------------------------ data rows' extra columns


def test_parsed_row_keeps_every_column_but_prompt_and_completion(tmp_path: Path) -> None:
    """As TRL passes them to a reward function (a `response` column is one of them)."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "6*7?", "answer": "42"},
                                                     {"prompt": "hi", "completion": "hello", "id": 3}])
    rows = [parse_row(r) for r in load_rows(str(path))]
    assert rows[0].prompt == [{"role": "user", "content": "6*7?"}] and rows[0].fields == {"answer": "42"}
    assert rows[1].response == "hello" and rows[1].fields == {"id": 3}
    chat = parse_row(RawRow({"messages": [{"role": "user", "content": "q"}], "solution": [1, 2]}, "x", 0))
    assert chat.fields == {"messages": [{"role": "user", "content": "q"}], "solution": [1, 2]}
