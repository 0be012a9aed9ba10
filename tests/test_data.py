"""Row formats, rendering, tokenization with prompt masking, splits and batch plans."""

from __future__ import annotations

import json
import sys

import pytest

from rlhf.data.batching import BatchPlan, collate_sft, pad_left
from rlhf.data.formats import parse_dialog, parse_row
from rlhf.data.rendering import render_prompt, render_response
from rlhf.data.sources import RawRow, eval_holdout, load_rows, stage_share
from rlhf.data.tokenization import IGNORE_INDEX, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf.errors import UserError
from rlhf.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def row(data: dict) -> RawRow:
    return RawRow(data, "file.jsonl", 7)


def test_prompt_response_row(tok):
    parsed = parse_row(row({"prompt": "2+2?", "response": "4"}))
    assert parsed.prompt == [{"role": "user", "content": "2+2?"}] and parsed.response == "4"
    assert render_prompt(parsed.prompt, tok) == "Human: 2+2?\n\nAssistant:"
    assert render_response(parsed.prompt, parsed.response, tok) == " 4</s>"


def test_pair_row_sft_trains_on_chosen():
    parsed = parse_row(row({"prompt": "q", "chosen": "good", "rejected": "bad", "margin": 1.5}))
    assert parsed.kind == "preference" and (parsed.response, parsed.margin) == ("good", 1.5)
    assert parsed.chosen == [{"role": "assistant", "content": "good"}]
    assert parsed.rejected == [{"role": "assistant", "content": "bad"}]


def test_hh_dialog_pair_derives_the_prompt_from_the_last_assistant_turn():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: 4"
    rejected = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: 5"
    parsed = parse_row(row({"chosen": chosen, "rejected": rejected}))
    assert parsed.prompt == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    assert (parsed.chosen[0]["content"], parsed.rejected[0]["content"]) == ("4", "5")


def test_messages_row_and_text_dialog():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert parse_row(row({"messages": msgs})).response == "b"
    assert parse_row(row({"text": "Human: a\n\nAssistant: b"})).response == "b"
    # messages without a final assistant turn are a prompt (PPO)
    assert parse_row(row({"messages": msgs[:1]})).response is None
    assert parse_row(row({"messages": msgs[:1]})).generation_prompt == msgs[:1]


def test_chat_format_pairs():
    p = [{"role": "user", "content": "q"}]
    parsed = parse_row(row({"prompt": p, "chosen": [{"role": "assistant", "content": "y"}],
                            "rejected": [{"role": "assistant", "content": "n"}]}))
    assert parsed.prompt == p and (parsed.chosen[0]["content"], parsed.rejected[0]["content"]) == ("y", "n")
    assert parsed.conversational


@pytest.mark.parametrize("data, message", [
    ({"prompt": "q", "response": None}, "file.jsonl row 7: field 'response' must be a non-empty string or a list"),
    ({"prompt": "q", "response": ""}, "file.jsonl row 7: field 'response'"),
    ({"question": "q"}, "file.jsonl row 7: unrecognised row"),
    ({"prompt": 3, "response": "x"}, "file.jsonl row 7: field 'prompt' must be a string"),
    ({"chosen": "no dialog here", "rejected": "x"}, "file.jsonl row 7: no prompt: add a 'prompt' column"),
])
def test_malformed_rows_name_file_row_and_field(data, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        parse_row(row(data))


def test_sft_tokenization_masks_the_prompt(tok):
    parsed = [parse_row(row({"prompt": "ab", "response": "cd"}))]
    (ex,), stats = tokenize_sft(parsed, tok, max_seq_len=64)
    prompt_len = len(tok("Human: ab\n\nAssistant:").input_ids)
    assert ex["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert tok.decode(ex["labels"][prompt_len:]) == " cd</s>"
    assert ex["input_ids"][0] == tok.bos_token_id and ex["input_ids"][-1] == tok.eos_token_id
    (ex2,), _ = tokenize_sft(parsed, tok, max_seq_len=64, train_on_prompt=True)
    assert ex2["labels"] == ex2["input_ids"]
    assert stats.kept == 1


def test_truncation_and_drops_are_counted(tok):
    parsed = [parse_row(row({"prompt": "x" * 30, "response": "y" * 40})),
              parse_row(row({"prompt": "z" * 100, "response": "w"})),
              parse_row(row({"prompt": "ok", "response": "fine"}))]
    rows, stats = tokenize_sft(parsed, tok, max_seq_len=60)
    assert len(rows) == 2 and stats.truncated == 1 and sum(stats.dropped.values()) == 1
    assert all(len(r["input_ids"]) <= 60 for r in rows)


def test_pairs_drop_identical_chosen_and_rejected(tok):
    parsed = [parse_row(row({"prompt": "q", "chosen": "a", "rejected": "a"})),
              parse_row(row({"prompt": "q", "chosen": "a", "rejected": "b", "margin": 2}))]
    rows, stats = tokenize_pairs(parsed, tok, max_seq_len=64)
    assert len(rows) == 1 and stats.dropped["chosen equals rejected"] == 1 and rows[0]["margin"] == 2.0


def test_prompt_tokenization_and_left_padding(tok):
    parsed = [parse_row(row({"prompt": "a"})), parse_row(row({"prompt": "abcdef"}))]
    ids, stats = tokenize_prompts(parsed, tok, max_prompt_len=64)
    padded, mask = pad_left(ids, tok.pad_token_id)
    assert mask[0].tolist()[: padded.shape[1] - len(ids[0])] == [0] * (padded.shape[1] - len(ids[0]))
    assert padded[0, -1].item() == ids[0][-1] and mask.sum().item() == len(ids[0]) + len(ids[1])


def test_load_rows_from_json_list_jsonl_and_bad_line(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "p", "response": "r"}]))
    assert load_rows(str(tmp_path / "a.json"))[0].data["prompt"] == "p"
    (tmp_path / "b.jsonl").write_text('{"prompt": "p", "response": "r"}\n{broken\n')
    with pytest.raises(UserError, match="b.jsonl line 2: not valid JSON"):
        load_rows(str(tmp_path / "b.jsonl"))
    with pytest.raises(UserError, match="file or folder not found"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_load_rows_from_parquet_csv_and_saved_folder(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": "p", "response": "r"}, {"prompt": "q", "response": "s"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    for spec in ("d.parquet", "d.csv", "saved"):
        rows = load_rows(str(tmp_path / spec))
        assert [r.data["response"] for r in rows] == ["r", "s"]


def test_data_split_gives_disjoint_seeded_shares():
    rows = [RawRow({"i": i}, "f", i) for i in range(100)]
    shares = {s: {r.index for r in stage_share(rows, "2,4,4", s, seed=3)} for s in ("sft", "reward", "ppo")}
    assert [len(shares[s]) for s in ("sft", "reward", "ppo")] == [20, 40, 40]
    assert not (shares["sft"] & shares["reward"]) and not (shares["reward"] & shares["ppo"])
    assert shares["sft"] == {r.index for r in stage_share(rows, "2,4,4", "sft", seed=3)}
    with pytest.raises(UserError, match="--data-split"):
        stage_share(rows, "1,2", "sft", seed=0)
    train, held = eval_holdout(list(range(50)), 0.1, seed=0)
    assert len(held) == 5 and not set(train) & set(held)


def test_batch_plan_global_batch_is_the_same_at_any_world_size():
    one = BatchPlan(40, micro_batch_size=8, grad_accum=1, world_size=1, rank=0, seed=1)
    ranks = [BatchPlan(40, micro_batch_size=2, grad_accum=2, world_size=2, rank=r, seed=1) for r in range(2)]
    for step in range(one.steps_per_epoch):
        (single,) = one.step_micro_batches(0, step)
        split = [i for p in ranks for mb in p.step_micro_batches(0, step) for i in mb]
        assert sorted(single) == sorted(split)


def test_collate_counts_supervised_tokens():
    batch = collate_sft([{"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [1, 7], "labels": [-100, 7]}], 0)
    assert int(batch["num_units"]) == 3 and batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_dialog_parser_needs_turns():
    with pytest.raises(UserError):
        parse_dialog("no turns", "x")


def test_a_missing_optional_package_is_one_error_line(tmp_path, monkeypatch) -> None:
    """A minimal environment without `datasets` or `wandb` (a GPU image, say) gets one line naming
    what needs the package and how to get it, not a ModuleNotFoundError mid-run."""
    from rlhf.config import TrackingConfig
    from rlhf.tracking import Tracker

    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,response\nhi,there\n")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if absent
    with pytest.raises(UserError, match=r"rows\.csv: reading csv needs the Python package 'datasets'.*pip install"):
        load_rows(str(csv))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"--report-to wandb needs .*'wandb'.*--report-to none"):
        Tracker(tmp_path, "sft", TrackingConfig(report_to="wandb"), {}, True)
