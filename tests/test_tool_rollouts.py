"""Multi-turn tool rollouts: token-exact turns (engine/multi_turn.py), tool responses rendered by the
chat template (stages/tool_rollouts.py), and `rlhf ppo --tools` / `--environment` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import one_and_two_rank_metrics, read_metrics, run_cli, write_jsonl
from rlhf.data.rendering import render_messages
from rlhf.data.tasks.calculator import TOOL_SPEC, calculate
from rlhf.data.tokenization import encode_prompt
from rlhf.engine.generation import generate
from rlhf.engine.inference import causal_lm_logprobs
from rlhf.engine.multi_turn import Turn, TurnEnd, generate_turns
from rlhf.engine.sampling import SamplingParams
from rlhf.errors import UserError
from rlhf.models.loading import load_causal_lm, load_tokenizer, read_chat_template
from rlhf.stages.tool_rollouts import ToolRollout, check_template_renders_tools, tool_setup

TEMPLATE = "rlhf/data/templates/plain_tools.jinja"
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 * 3"}}</tool_call>'


@pytest.fixture
def tokenizer(tiny_model_dirs):
    tok = load_tokenizer(str(tiny_model_dirs["llama"]))
    tok.chat_template = read_chat_template(TEMPLATE)
    return tok


def test_turns_are_exactly_the_sampled_ids_plus_the_appended_ones(tiny_model_dirs):
    """Round 2 continues from the kept ids and the appended ids as they are: its tokens are what a
    fresh greedy generation from that context gives, its log-probs what a training forward gives,
    and only sampled tokens are actions."""
    model = load_causal_lm(str(tiny_model_dirs["llama"])).eval()
    torch.manual_seed(0)
    ids = torch.randint(4, 90, (2, 5))
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    appended = [11, 12, 13]
    first: dict[int, list[int]] = {}

    def respond(turns: list[Turn]) -> list[TurnEnd | None]:
        if turns[0].row in first:
            return [None] * len(turns)
        for t in turns:
            first[t.row] = t.tokens[:3]
        return [TurnEnd(3, appended) for _ in turns]

    out = generate_turns(model, ids, mask, params, None, respond)
    for row in range(2):
        context = torch.tensor([[*ids[row].tolist(), *first[row], *appended]])
        again = generate(model, context, torch.ones_like(context), SamplingParams(
            max_new_tokens=12 - 6, do_sample=False, eos_token_id=None, pad_token_id=0))
        expected = [*first[row], *appended, *again.sequences[0, context.shape[1]:].tolist()]
        assert out.sequences[row, 5:].tolist() == expected
        assert out.action_mask[row, 5:].tolist() == [True] * 3 + [False] * 3 + [True] * 6
    logprobs = causal_lm_logprobs(model, out.sequences, out.attention_mask)[0]  # [B, T-1]: token t+1 at t
    actions = out.action_mask[:, 1:]
    assert torch.allclose(out.logprobs[:, 1:][actions], logprobs[actions], atol=1e-4)
    assert (out.logprobs[:, 1:][~actions] == 0).all()
    assert out.turns.tolist() == [2, 2]


def test_a_tool_call_turn_gets_the_templates_tool_response_as_ids(tokenizer):
    setup = tool_setup([TOOL_SPEC], None)
    rollout = ToolRollout(setup, tokenizer, [[{"role": "user", "content": "What is 2 times 3?"}]] * 2, [{}, {}])
    prompt = rollout.prompt_ids()[0]
    eos = tokenizer.eos_token
    # Row 0 stops at EOS after its call; row 1 runs on past the call (those tokens are not kept).
    turn0 = tokenizer.encode(" " + CALL + eos, add_special_tokens=False)
    turn1 = tokenizer.encode(" " + CALL + " and more", add_special_tokens=False)
    ends = rollout.respond([Turn(0, turn0, True, 100), Turn(1, turn1, False, 100)])
    assert ends[0].keep == len(turn0) and ends[1].keep == len(turn1) - len(" and more")
    conversation = [{"role": "user", "content": "What is 2 times 3?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 * 3"}}}]},
                    {"role": "tool", "name": "calculate", "content": "6"}]
    rendered = render_messages(conversation, tokenizer, setup.schemas, add_generation_prompt=True)
    for end, turn in zip(ends, (turn0, turn1)):
        # prompt + kept sampled ids + appended ids == the conversation as the template renders it.
        assert prompt + turn[: end.keep] + end.append == encode_prompt(rendered, tokenizer)
    assert rollout.trajectories[0] == conversation[1:]
    final = rollout.respond([Turn(0, tokenizer.encode(" 6" + eos, add_special_tokens=False), True, 50)])
    assert final == [None] and rollout.responses[0] == "6"
    assert rollout.metrics()["tool_calls_ok"] == 2


def test_max_tool_calls_ends_the_row_without_running_its_call(tokenizer):
    setup = tool_setup([TOOL_SPEC], None, max_tool_calls=1)
    rollout = ToolRollout(setup, tokenizer, [[{"role": "user", "content": "hi"}]], [{}])
    turn = tokenizer.encode(" " + CALL + tokenizer.eos_token, add_special_tokens=False)
    assert rollout.respond([Turn(0, turn, True, 100)])[0] is not None
    assert rollout.respond([Turn(0, turn, True, 100)]) == [None]
    assert rollout.metrics()["tool_calls_over_limit"] == 1 and rollout.metrics()["tool_calls"] == 1


def test_environment_reset_appends_to_the_last_user_message(tokenizer, tmp_path):
    path = tmp_path / "env.py"
    path.write_text("class Quiz:\n    def reset(self, **row):\n        self.answer = row['answer']\n"
                    "        return ' (hint: multiply)'\n\n    def check(self, guess: int) -> str:\n"
                    "        \"\"\"Check a guess.\n\n        Args:\n            guess: the guess\n        \"\"\"\n"
                    "        return 'right' if guess == self.answer else 'wrong'\n\n"
                    "    def get_reward(self):\n        return 1.0\n")
    setup = tool_setup([], f"{path}:Quiz")
    assert setup.environment_rewards and [s["function"]["name"] for s in setup.schemas] == ["check"]
    rollout = ToolRollout(setup, tokenizer, [[{"role": "user", "content": "2 x 3?"}]], [{"answer": 6}])
    assert rollout.prompts[0][-1]["content"] == "2 x 3? (hint: multiply)"
    call = '<tool_call>{"name": "check", "arguments": {"guess": 6}}</tool_call>' + tokenizer.eos_token
    rollout.respond([Turn(0, tokenizer.encode(" " + call, add_special_tokens=False), True, 100)])
    assert rollout.trajectories[0][-1] == {"role": "tool", "name": "check", "content": "right"}


def test_a_template_that_renders_no_tools_is_refused(tiny_model_dirs):
    tok = load_tokenizer(str(tiny_model_dirs["llama"]))
    with pytest.raises(UserError, match="does not render tool calls or tools"):
        check_template_renders_tools(tok, tool_setup([TOOL_SPEC], None).schemas, "--actor x")


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """A tiny model fine-tuned to call `calculate` on every prompt (memorised demonstrations)."""
    root = tmp_path_factory.mktemp("tool_caller")
    from rlhf.models.tiny import save_tiny_model

    base = save_tiny_model(root / "base", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           max_positions=512)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 * 3"}}}
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}],
             "completion": [{"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "name": "calculate", "content": calculate("2 * 3")},
                            {"role": "assistant", "content": "6"}],
             "tools": tool_setup([TOOL_SPEC], None).schemas} for i in range(32)]
    data = write_jsonl(root / "sft.jsonl", rows)
    done = run_cli(["sft", "--model", str(base), "--data", str(data), "--chat-template", TEMPLATE, "--max-steps",
                    "150", "--lr", "1e-2", "--micro-batch-size", "16", "--max-seq-len", "200", "--output",
                    str(root / "sft"), "--report-to", "none", "--warmup-steps", "5"])
    assert done.returncode == 0, done.stderr[-2000:]
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": f"q{i}", "answer": "6"} for i in range(16)])
    return root / "sft" / "model", prompts


def ppo_tool_args(model, prompts, *extra):
    return ["ppo", "--actor", str(model), "--data", str(prompts), "--tools", TOOL_SPEC, "--reward-fn",
            "tests/data/answer_reward.py:exact_answer", "--advantage-estimator", "grpo", "--samples-per-prompt", "4",
            "--max-new-tokens", "120", "--max-prompt-len", "64", "--report-to", "none", "--optimizer-impl", "torch",
            "--dtype", "fp32", "--lr", "1e-3", *extra]


def test_ppo_with_tools_trains_on_the_sampled_and_tool_tokens(tool_caller, tmp_path):
    model, prompts = tool_caller
    out = tmp_path / "ppo"
    done = run_cli([*ppo_tool_args(model, prompts, "--max-steps", "2", "--generation-batch-size", "8",
                                   "--sample-log-interval", "1"), "--output", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    assert rows[0]["tool_calls_ok"] > 0 and rows[0]["tool_calls"] >= rows[0]["tool_calls_ok"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert any("[calculate] -> 6" in s["trajectory"] for s in samples)
    # Parity between the rollout's log-probs and the training forward's holds across tool turns.
    assert rows[0]["rollout_parity_max_diff"] < 1e-4


@pytest.mark.slow
def test_ppo_with_tools_two_ranks_match_one(tool_caller, tmp_path):


    model, prompts = tool_caller
    a, b = one_and_two_rank_metrics(ppo_tool_args(model, prompts, "--max-steps", "1", "--greedy"), tmp_path)
    for key in ("score_mean", "response_length", "tool_calls", "tool_calls_ok", "policy_loss", "entropy"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key


@pytest.mark.slow
def test_ppo_with_tools_resumes_mid_run_exactly(tool_caller, tmp_path):
    import shutil

    model, prompts = tool_caller
    args = ppo_tool_args(model, prompts, "--max-steps", "4", "--save-interval", "2", "--generation-batch-size", "8",
                         "--sample-log-interval", "0", "--lr-scheduler", "constant")
    full = tmp_path / "full"
    assert run_cli([*args, "--output", str(full)]).returncode == 0
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("model", "DONE", "summary.json"):
        path = cut / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "checkpoints" / "latest").write_text("step_00000002")
    resumed = run_cli([*args, "--output", str(cut), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("score_mean", "tool_calls", "tool_calls_ok", "policy_loss", "response_length"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], abs=1e-6), key


def test_environment_get_reward_is_a_reward_source_of_its_own(tmp_path):
    from rlhf.reward_batch import RewardBatch
    from rlhf.stages.reward_sources import EnvironmentRewardSource, WeightedReward

    class Env:
        def __init__(self, value):
            self.value = value

        def get_reward(self):
            return self.value

    batch = RewardBatch.of_texts(["a", "b"], ["x", "y"], environments=[Env(1.0), Env(None)])
    reward = WeightedReward([EnvironmentRewardSource("Env")], [2.0])
    with pytest.raises(UserError, match="has no score"):  # None leaves row 1 unscored by every source
        reward.score(torch.zeros(2, 3), torch.ones(2, 3), batch)
    batch = RewardBatch.of_texts(["a", "b"], ["x", "y"], environments=[Env(1.0), Env(0.25)])
    assert reward.score(torch.zeros(2, 3), torch.ones(2, 3), batch).tolist() == [2.0, 0.5]
    assert reward.components["Env"].tolist() == [1.0, 0.25]
