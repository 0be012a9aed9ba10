"""Every dataset type of TRL's dataset-formats guide, as `rlhf data inspect --json` shows a stage will
train on it: the exact rendered text, or one line refusing the type and naming who takes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.models.tiny import build_char_tokenizer, save_tiny_model
from tests.conftest import run_cli, write_jsonl

# A ChatML template that renders tools and tool calls the way Qwen2.5's does (shortened).
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for tc in message.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
U, A, E = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>"

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model folder whose tokenizer speaks ChatML with tools (EOS = <|im_end|>)."""
    path = save_tiny_model(tmp_path_factory.mktemp("chatml"), "llama", hidden_size=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, add_bos=False)
    tok = build_char_tokenizer(add_bos=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TOOLS_CHATML
    tok.save_pretrained(path)
    return path


def inspect(model: Path, stage: str, rows: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture,
            *flags: str) -> list[dict]:
    data = write_jsonl(tmp_path / f"{stage}.jsonl", rows)
    main(["data", "inspect", "--stage", stage, "--model", str(model), "--data", str(data), "--json",
          "--rows", str(len(rows)), *flags])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def pieces(row: dict) -> list[tuple[str, bool]]:
    return [(p["text"], p["trained"]) for p in row["pieces"]]


def refusal(model: Path, stage: str, row: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        inspect(model, stage, [row], tmp_path, capsys)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    return errors[0]


def test_multi_turn_pair_with_an_implicit_prompt_keeps_every_turn(chatml_model, tmp_path, capsys):
    shared = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
              {"role": "user", "content": "Q2"}]
    row = {"chosen": [*shared, {"role": "assistant", "content": "A2"}],
           "rejected": [*shared, {"role": "assistant", "content": "B2"}]}
    shown, counts = inspect(chatml_model, "reward", [row], tmp_path, capsys)
    assert shown["type"] == "preference" and shown["conversational"]
    assert shown["prompt"] == f"{U}Q1{E}\n{A}A1{E}\n{U}Q2{E}\n{A}"
    assert (shown["chosen"], shown["rejected"]) == (f"A2{E}", f"B2{E}")
    assert counts["counts"]["kept"] == 1
    # SFT on the same pair trains on the chosen turn after the shared prompt
    (sft, _) = inspect(chatml_model, "sft", [row], tmp_path, capsys)
    assert pieces(sft) == [(shown["prompt"], False), (f"A2{E}", True)]


def test_string_prompt_with_chosen_lists_that_repeat_it(chatml_model, tmp_path, capsys):
    """ultrafeedback_binarized's shape: prompt str, chosen/rejected = [user prompt, assistant answer]."""
    row = {"prompt": "Q", "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "good"}],
           "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "bad"}]}
    shown, _ = inspect(chatml_model, "reward", [row], tmp_path, capsys)
    assert (shown["prompt"], shown["chosen"], shown["rejected"]) == (f"{U}Q{E}\n{A}", f"good{E}", f"bad{E}")


def test_tool_calls_and_tools_render_through_the_template(chatml_model, tmp_path, capsys):
    row = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "name": "get_weather", "content": "22C"},
        {"role": "assistant", "content": "It is 22C."}],
        "tools": [WEATHER_TOOL]}
    shown, _ = inspect(chatml_model, "sft", [row], tmp_path, capsys)
    system = f"<|im_start|>system\n# Tools\n<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>{E}\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert pieces(shown) == [
        (f"{system}{U}Weather in Paris?{E}\n{A}", False), (f"{call}{E}", True),
        (f"\n{U}<tool_response>\n22C\n</tool_response>{E}\n{A}", False), (f"It is 22C.{E}", True)]
    assert "None" not in "".join(text for text, _ in pieces(shown))
    # --train-last-turn-only: the tool call is context, only the answer trains
    (last, _) = inspect(chatml_model, "sft", [row], tmp_path, capsys, "--train-last-turn-only")
    assert [trained for _, trained in pieces(last)] == [False, True]
    assert pieces(last)[1] == (f"It is 22C.{E}", True)


def test_a_template_that_drops_tool_calls_is_refused(tiny_model_dirs, tmp_path, capsys):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "lookup", "arguments": {"q": "x"}}}]}]}
    err = refusal(tiny_model_dirs["llama"], "sft", row, tmp_path, capsys)
    assert "does not render tool calls" in err and "'lookup'" in err and "--chat-template" in err


SIMPLE_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
                   "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_file_replaces_the_tokenizers(tiny_model_dirs, tmp_path, capsys):
    template = tmp_path / "simple.jinja"
    template.write_text(SIMPLE_TEMPLATE)
    row = {"prompt": "hi", "completion": "hello"}
    shown, _ = inspect(tiny_model_dirs["llama"], "sft", [row], tmp_path, capsys, "--chat-template", str(template))
    assert pieces(shown) == [("<user>hi<assistant>", False), ("hello</s>", True)]
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(SystemExit):
        inspect(tiny_model_dirs["llama"], "sft", [row], tmp_path, capsys, "--chat-template", str(bad))
    assert "not a valid Jinja template" in capsys.readouterr().err


def test_text_only_multimodal_content_is_joined(chatml_model, tmp_path, capsys):
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                     {"type": "text", "text": "this."}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    shown, _ = inspect(chatml_model, "sft", [row], tmp_path, capsys)
    assert pieces(shown) == [(f"{U}Describe this.{E}\n{A}", False), (f"A cat.{E}", True)]
    image = {"messages": [{"role": "user", "content": [{"type": "image", "image": None},
                                                       {"type": "text", "text": "What is it?"}]}]}
    err = refusal(chatml_model, "ppo", image, tmp_path, capsys)
    assert "has a image part; this project trains text models" in err


def test_conversational_prompt_completion_and_prompt_only(chatml_model, tmp_path, capsys):
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "completion": [{"role": "assistant", "content": "4"}]}
    shown, _ = inspect(chatml_model, "sft", [row], tmp_path, capsys)
    assert shown["type"] == "prompt-completion" and shown["conversational"]
    assert pieces(shown) == [(f"<|im_start|>system\nBe brief.{E}\n{U}2+2?{E}\n{A}", False), (f"4{E}", True)]
    prompt_only = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    shown, _, _ = inspect(chatml_model, "ppo", [prompt_only, row], tmp_path, capsys)
    assert shown["prompt"] == f"{U}2+2?{E}\n{A}" and shown["reward_fn_columns"] == ["answer"]


def test_language_modeling_text_rows_train_whole(chatml_model, tmp_path, capsys):
    shown, counts = inspect(chatml_model, "sft", [{"text": "The sky is blue."}], tmp_path, capsys)
    assert shown["type"] == "language modeling" and not shown["conversational"]
    assert pieces(shown) == [(f"The sky is blue.{E}", True)]
    assert counts["counts"] == {"kept": 1, "truncated": 0, "dropped": 0}


@pytest.mark.parametrize("stage, row, words", [
    ("sft", {"prompt": "p", "completion": "c", "label": True}, "unpaired-preference row"),
    ("reward", {"prompt": "p", "completions": ["a", "b"], "labels": [True, False]}, "stepwise-supervision row"),
    ("sft", {"prompt": "only a prompt"}, "a prompt-only row; rlhf sft trains on demonstrations"),
    ("reward", {"prompt": "p", "completion": "c"}, "a prompt-completion row; rlhf reward trains on preference pairs"),
    ("ppo", {"text": "plain text"}, "a standard language-modeling ('text') row; rlhf ppo trains on prompts"),
    ("reward", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "rlhf sft or rlhf ppo takes it"),
    ("sft", {"messages": [{"role": "robot", "content": "x"}]}, "has role 'robot'"),
    ("sft", {"messages": [{"role": "user", "content": None}]}, "content None"),
])
def test_types_a_stage_does_not_train_on_are_refused_in_one_line(chatml_model, tmp_path, capsys, stage, row, words):
    assert words in refusal(chatml_model, stage, row, tmp_path, capsys)


def test_tool_arguments_that_are_not_json_are_refused(chatml_model, tmp_path, capsys):
    row = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}
    assert "tool call 'f' has arguments that are not valid JSON" in refusal(chatml_model, "sft", row, tmp_path, capsys)


def test_sft_trains_on_every_assistant_turn_from_the_cli(tiny_model_dirs, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": f"b{i}"}]}
            for i in range(8)]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    template = tmp_path / "simple.jinja"
    template.write_text(SIMPLE_TEMPLATE)
    out = tmp_path / "sft"
    result = run_cli(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(data), "--output", str(out),
                      "--max-steps", "1", "--micro-batch-size", "4", "--report-to", "none",
                      "--chat-template", str(template)])
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["kept"] == 8 and summary["steps"] == 1
    from rlhf.models.loading import load_tokenizer

    assert load_tokenizer(str(out / "model")).chat_template == SIMPLE_TEMPLATE  # the next stage renders the same


@pytest.mark.slow
def test_rollout_check_uses_the_longest_prompt_not_the_cap(tmp_path):
    """A model of 64 positions, prompts of ~20 tokens: --max-prompt-len's default 256 is no reason to refuse."""
    model = save_tiny_model(tmp_path / "short", "llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                            max_positions=64)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"sort: {w}"} for w in ("cab", "zyx", "edf", "qpo")])
    args = ["ppo", "--actor", str(model), "--reward-fn", "sort", "--data", str(data), "--advantage-estimator", "grpo",
            "--samples-per-prompt", "2", "--generation-batch-size", "4", "--micro-batch-size", "4", "--max-steps", "1",
            "--report-to", "none"]
    done = run_cli([*args, "--output", str(tmp_path / "fits"), "--max-new-tokens", "16"])
    assert done.returncode == 0, done.stderr[-2000:]
    refused = run_cli([*args, "--output", str(tmp_path / "too-long"), "--max-new-tokens", "60"])
    assert refused.returncode == 2 and "exceed the model's max_position_embeddings 64" in refused.stderr
    longest = int(re.search(r"prompt (\d+) \+ max_new_tokens 60", refused.stderr).group(1))
    assert 10 < longest < 64  # the longest prompt's length, not 256


def test_a_retokenizing_reward_model_renders_the_rows_tools_as_its_pairs_had(chatml_model):
    from rlhf.data.formats import parse_row
    from rlhf.data.retokenize import retokenize_for_reward
    from rlhf.data.sources import RawRow
    from rlhf.data.tokenization import tokenize_pairs
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(str(chatml_model))
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    pair = parse_row(RawRow({"prompt": prompt, "chosen": "22C", "rejected": "no idea", "tools": [WEATHER_TOOL]},
                            "t", 0))
    (trained,), _ = tokenize_pairs([pair], tok, 512)
    ids, mask, _ = retokenize_for_reward([prompt], ["22C"], tok, 512, tools=[pair.tools])
    assert ids[0][mask[0].bool()].tolist() == trained["chosen_ids"]
    assert "get_weather" in tok.decode(trained["chosen_ids"])
