"""Dataset selection: splits and configs of files, save_to_disk folders and folders of data files
(a README.md's `configs:`, as hub datasets have), column renames, mixing several datasets, the
test split as the eval set, e2e's sharing of these flags, and one `rlhf sft` run that uses them.
Every dataset is built here with `datasets`; nothing needs a network."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from rlhf.cli import main
from rlhf.config import DataConfig, E2EConfig, PPOConfig, SFTConfig
from rlhf.config_sources import ConfigSources, resolve_config
from rlhf.data.formats import parse_row
from rlhf.data.sources import RawRow, load_rows, mix_rows, stage_share
from rlhf.data.stage_rows import load_stage_rows
from rlhf.data.tokenization import TokenizeStats, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf.errors import UserError
from rlhf.models.tiny import build_char_tokenizer
from rlhf.stages.e2e import resolve_stage_configs, stage_configs
from tests.conftest import write_jsonl


def qa_rows(n: int, tag: str) -> list[dict]:
    """question/solution rows (the format needs --data-columns to read them)."""
    return [{"question": f"{tag} {i}+1=", "solution": str(i + 1)} for i in range(n)]


@pytest.fixture(scope="module")
def prefs_dict(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DatasetDict saved with the splits train_prefs / test_prefs (as ultrafeedback_binarized)."""
    path = tmp_path_factory.mktemp("saved") / "prefs"
    DatasetDict({"train_prefs": Dataset.from_list(qa_rows(24, "train")),
                 "test_prefs": Dataset.from_list(qa_rows(6, "test"))}).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def configs_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of parquet files whose README.md declares two configs with train/test splits."""
    root = tmp_path_factory.mktemp("hub_like") / "math"
    for config in ("main", "socratic"):
        (root / config).mkdir(parents=True)
        for split, n in (("train", 5), ("test", 3)):
            Dataset.from_list(qa_rows(n, f"{config}-{split}")).to_parquet(str(root / config / f"{split}-00000.parquet"))
    entries = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
                      f"  - split: test\n    path: {c}/test-*\n" for c in ("main", "socratic"))
    (root / "README.md").write_text(f"---\nconfigs:\n{entries}---\n# a dataset with two configs\n")
    return root


def messages(records: list[logging.LogRecord]) -> str:
    return "\n".join(r.getMessage() for r in records)


# ---------------------------------------------------------------- splits and configs


def test_a_saved_dataset_dict_gives_the_named_split_and_names_its_splits(prefs_dict: Path) -> None:
    rows = load_rows(str(prefs_dict), split="test_prefs")
    assert [r.data["question"] for r in rows] == [f"test {i}+1=" for i in range(6)]
    assert rows[2].where == f"{prefs_dict} (split test_prefs) row 2"
    with pytest.raises(UserError) as exc:
        load_rows(str(prefs_dict))  # the default split "train" is not there
    assert str(exc.value) == f"{prefs_dict}: no split 'train'; its splits: train_prefs, test_prefs"
    with pytest.raises(UserError, match=r"no split 'test' \(--data-test-split\); its splits: train_prefs, test_prefs"):
        load_rows(str(prefs_dict), split="test", split_flag="--data-test-split")
    with pytest.raises(UserError, match="a save_to_disk folder has no configs"):
        load_rows(str(prefs_dict), split="train_prefs", config="main")


def test_a_saved_dataset_holds_one_split_by_its_name(tmp_path: Path, configs_folder: Path) -> None:
    Dataset.from_list(qa_rows(3, "x")).save_to_disk(str(tmp_path / "one"))
    assert len(load_rows(str(tmp_path / "one"))) == 3
    with pytest.raises(UserError, match=r"one: a saved Dataset holds only the split 'train', not 'test'"):
        load_rows(str(tmp_path / "one"), split="test")
    # Saved from a split: only that name, so that no train and test split are ever the same rows.
    import datasets

    test_only = tmp_path / "test_only"
    datasets.load_dataset(str(configs_folder), "main", split="test").save_to_disk(str(test_only))
    assert load_rows(str(test_only), split="test")[0].where == f"{test_only} (split test) row 0"
    with pytest.raises(UserError, match=r"holds only the split 'test', not 'train' \(--data-train-split\); "
                                        r"ask for 'test'"):
        load_rows(str(test_only), split_flag="--data-train-split")


def test_a_readme_with_configs_selects_config_and_split(configs_folder: Path) -> None:
    rows = load_rows(str(configs_folder), split="test", config="socratic")
    assert [r.data["question"] for r in rows] == [f"socratic-test {i}+1=" for i in range(3)]
    assert rows[0].where == f"{configs_folder} (config socratic, split test) row 0"
    assert len(load_rows(str(configs_folder), config="main")) == 5
    with pytest.raises(UserError) as exc:
        load_rows(str(configs_folder), config="nope")
    assert str(exc.value) == (f"{configs_folder} (config nope): no config 'nope' (--data-config); "
                              "its configs: main, socratic")
    with pytest.raises(UserError) as exc:
        load_rows(str(configs_folder))
    assert str(exc.value) == f"{configs_folder}: it has configs main, socratic; pick one with --data-config NAME"
    with pytest.raises(UserError) as exc:
        load_rows(str(configs_folder), split="validation", config="main", split_flag="--data-test-split")
    assert str(exc.value) == (f"{configs_folder} (config main): no split 'validation' (--data-test-split); "
                              "its splits: train, test")


def test_a_folder_of_data_files_takes_its_splits_from_the_file_names(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", qa_rows(4, "tr"))
    write_jsonl(folder / "test.jsonl", qa_rows(2, "te"))
    assert len(load_rows(str(folder))) == 4
    assert [r.data["question"] for r in load_rows(str(folder), split="test")] == ["te 0+1=", "te 1+1="]
    with pytest.raises(UserError, match=r"no split 'dev'; its splits: train, test"):
        load_rows(str(folder), split="dev")


def test_single_files_hold_the_split_train_or_a_json_object_of_splits(tmp_path: Path) -> None:
    (tmp_path / "splits.json").write_text(json.dumps({"train": qa_rows(3, "a"), "test": qa_rows(1, "b")}, indent=2))
    assert len(load_rows(str(tmp_path / "splits.json"))) == 3
    (test_row,) = load_rows(str(tmp_path / "splits.json"), split="test")
    assert test_row.data["question"] == "b 0+1=" and test_row.where == f"{tmp_path / 'splits.json'} (split test) row 0"
    with pytest.raises(UserError, match=r"splits.json: no split 'dev'; its splits: train, test"):
        load_rows(str(tmp_path / "splits.json"), split="dev")
    write_jsonl(tmp_path / "rows.jsonl", qa_rows(2, "c"))
    Dataset.from_list(qa_rows(2, "d")).to_parquet(str(tmp_path / "rows.parquet"))
    for name in ("rows.jsonl", "rows.parquet"):
        assert load_rows(str(tmp_path / name))[1].where == f"{tmp_path / name} row 1"  # no split named
        with pytest.raises(UserError, match=rf"{name}: a single file holds only the split 'train', not 'test' "
                                            r"\(--data-test-split\)"):
            load_rows(str(tmp_path / name), split="test", split_flag="--data-test-split")
        with pytest.raises(UserError, match=rf"{name}: a single file has no configs \(--data-config main\)"):
            load_rows(str(tmp_path / name), config="main")


# ---------------------------------------------------------------- column renames


def test_columns_are_renamed_before_the_format_is_detected(prefs_dict: Path, tmp_path: Path) -> None:
    rows = load_rows(str(prefs_dict), split="train_prefs", renames={"prompt": "question", "response": "solution"})
    parsed = parse_row(rows[0])
    assert parsed.prompt[0]["content"] == "train 0+1=" and parsed.response == "1"
    # Renames apply at once, so two columns may swap names.
    swapped = load_rows(str(prefs_dict), split="test_prefs", renames={"question": "solution", "solution": "question"})
    assert swapped[0].data == {"question": "1", "solution": "test 0+1="}


def test_a_bad_rename_names_the_dataset_the_column_and_the_columns_there_are(prefs_dict: Path) -> None:
    with pytest.raises(UserError) as exc:
        load_rows(str(prefs_dict), split="test_prefs", renames={"prompt": "query"})
    assert str(exc.value) == (f"{prefs_dict} (split test_prefs) row 0: --data-columns prompt=query: no column "
                              "'query'; its columns: question, solution")
    with pytest.raises(UserError, match=r"--data-columns solution=question: it already has a column 'solution'"):
        load_rows(str(prefs_dict), split="test_prefs", renames={"solution": "question"})


@pytest.mark.parametrize("flags, message", [
    ({"data_columns": ["prompt"]}, "--data-columns: ['prompt'] must be NEW=OLD column renames"),
    ({"data_columns": ["prompt=a,prompt=b"]}, "'prompt' is the new name of two columns"),
    ({"data_columns": ["x=a", "y=a"]}, "'a' is renamed twice"),
    ({"data": ["a.jsonl", "b.jsonl"], "data_mix": "0.7,0"}, "--data-mix: [0.7, 0.0] must be positive numbers"),
    ({"data": ["a.jsonl"], "data_mix": "0.7,0.3"}, "data_mix: 2 weights for 1 --data datasets"),
    ({"data_test_split": "test", "eval_data": ["e.jsonl"]}, "data_test_split: 'test' and eval_data both name"),
    ({"data_test_split": "train"}, "data_test_split: 'train' is also data_train_split"),
])
def test_selection_flags_are_checked_when_set(flags: dict, message: str) -> None:
    with pytest.raises(UserError) as exc:
        resolve_config(SFTConfig(), ConfigSources(flags=flags), where="rlhf sft")
    assert message in str(exc.value)


def test_column_renames_parse_flag_and_file_forms() -> None:
    flag = resolve_config(SFTConfig(), ConfigSources(flags={"data_columns": ["prompt=question,answer=solution"]}))
    listed = resolve_config(SFTConfig(), ConfigSources(file={"data": {"data_columns": ["prompt=question",
                                                                                       "answer=solution"]}}))
    assert flag.data.column_renames == listed.data.column_renames == {"prompt": "question", "answer": "solution"}


# ---------------------------------------------------------------- mixing


def numbered(n: int, source: str) -> list[RawRow]:
    return [RawRow({"prompt": f"{source}{i}", "response": "r"}, source, i) for i in range(n)]


def test_a_mix_takes_the_shares_without_replacement_and_logs_the_counts(log_records: list) -> None:
    a, b = numbered(100, "a"), numbered(50, "b")
    mixed, left_out = mix_rows([a, b], [0.7, 0.3], seed=1)
    # b would give 50 for a 0.3 share of 166, but a has only 100 for its 0.7: a bounds the total.
    from_a = [r for r in mixed if r.source == "a"]
    from_b = [r for r in mixed if r.source == "b"]
    assert (len(from_a), len(from_b), left_out) == (100, 43, 7)
    assert len({r.index for r in from_b}) == 43 and [r.index for r in from_b] == sorted(r.index for r in from_b)
    assert "data mix 0.7,0.3: 143 rows; a gave 100 of 100 (0 left out); b gave 43 of 50 (7 left out)" in \
        messages(log_records)
    again, _ = mix_rows([a, b], [0.7, 0.3], seed=1)
    other, _ = mix_rows([a, b], [0.7, 0.3], seed=2)
    assert again == mixed and other != mixed
    with pytest.raises(UserError, match="--data-mix: 1 weights for 2 --data datasets"):
        mix_rows([a, b], [1.0], seed=1)


def sft_tokenize(parsed):
    return tokenize_sft(parsed, build_char_tokenizer(), 64)


def test_the_mix_comes_before_the_stage_shares_which_stay_disjoint(tmp_path: Path, log_records: list) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "x"} for i in range(60)])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "response": "y"} for i in range(60)])
    data = DataConfig(data=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], data_mix=[0.5, 0.25],
                      data_split="1,1,1")
    prompts = {}
    for stage in ("sft", "reward", "ppo"):
        rows = load_stage_rows(data, stage, 3, lambda parsed: (parsed, _stats(parsed)), empty="none")
        prompts[stage] = {r.prompt[0]["content"] for r in rows.train}
        assert rows.stats["mix_left_out"] == 30
    assert sum(len(p) for p in prompts.values()) == 90  # 60 of a, 30 of b, shared out
    assert not (prompts["sft"] & prompts["reward"]) and not (prompts["reward"] & prompts["ppo"])
    assert sum(p.startswith("b") for s in prompts.values() for p in s) == 30
    assert "b.jsonl gave 30 of 60 (30 left out)" in messages(log_records)


def _stats(parsed):
    return TokenizeStats(kept=len(parsed))


# ---------------------------------------------------------------- the eval set


def test_the_test_split_is_the_eval_set_with_the_columns_renamed(prefs_dict: Path, log_records: list) -> None:
    data = DataConfig(data=[str(prefs_dict)], data_train_split="train_prefs", data_test_split="test_prefs",
                      data_columns=["prompt=question,response=solution"], eval_split=0.2, data_split="1,1,1")
    rows = load_stage_rows(data, "sft", 0, sft_tokenize, empty="none")
    assert len(rows.train) == 8 and len(rows.eval) == 6  # the train split's share; the whole test split
    assert rows.stats["kept"] == 8 and rows.stats["eval_kept"] == 6 and rows.stats["eval_dropped"] == 0
    assert "--eval-split 0.2 is unused: the eval set is the split test_prefs of --data" in messages(log_records)
    ppo = load_stage_rows(DataConfig(data=[str(prefs_dict)], data_train_split="train_prefs",
                                     data_columns=["prompt=question"]), "ppo", 0,
                          lambda parsed: tokenize_prompts(parsed, build_char_tokenizer(), 64), empty="x", holdout=False)
    assert ppo.eval == [] and "eval_kept" not in ppo.stats


def test_eval_data_gets_the_renames_too(prefs_dict: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "eval.jsonl", qa_rows(3, "e"))
    data = DataConfig(data=[str(prefs_dict)], data_train_split="train_prefs", eval_data=[str(tmp_path / "eval.jsonl")],
                      data_columns=["prompt=question", "response=solution"])
    rows = load_stage_rows(data, "sft", 0, sft_tokenize, empty="none")
    assert (len(rows.train), len(rows.eval), rows.stats["eval_kept"]) == (24, 3, 3)


def test_a_bad_row_in_the_test_split_is_named_by_dataset_split_and_row(tmp_path: Path) -> None:
    DatasetDict({"train": Dataset.from_list([{"prompt": "a", "response": "b"}] * 2),
                 "test": Dataset.from_list([{"prompt": "a", "response": "b"}, {"prompt": "a", "response": " "}])}
                ).save_to_disk(str(tmp_path / "d"))
    data = DataConfig(data=[str(tmp_path / "d")], data_test_split="test")
    with pytest.raises(UserError, match=rf"^{tmp_path / 'd'} \(split test\) row 1: field 'response'"):
        load_stage_rows(data, "sft", 0, sft_tokenize, empty="none")


def test_ppo_takes_a_test_split_as_its_held_out_prompts(tmp_path: Path) -> None:
    config = resolve_config(PPOConfig(), ConfigSources(flags={"data_test_split": "test"}), where="rlhf ppo")
    assert config.data.data_test_split == "test"


def test_stage_share_after_the_split_is_unchanged() -> None:
    rows = numbered(30, "f")
    assert len(stage_share(rows, "1,1,1", "sft", 0)) == 10


# ---------------------------------------------------------------- e2e


def test_e2e_passes_the_selection_to_every_stage_and_the_test_split_to_sft_and_reward(tmp_path: Path) -> None:
    cfg = resolve_config(E2EConfig(), ConfigSources(flags={
        "data": ["prefs"], "data_train_split": "train_prefs", "data_test_split": "test_prefs", "data_config": "c",
        "data_columns": ["prompt=question"]}), where="rlhf e2e")
    stages = stage_configs(cfg, tmp_path)
    for name, stage in stages.items():
        assert (stage.data.data, stage.data.data_train_split, stage.data.data_config, stage.data.data_columns) == \
            (["prefs"], "train_prefs", "c", ["prompt=question"])
        assert stage.data.data_test_split == (None if name == "ppo" else "test_prefs")
    assert stages["reward"].data.eval_split == 0  # the test split replaces e2e's 5% holdout
    # A stage's prefixed flag overrides what e2e passed it.
    resolve_stage_configs(stages, None, {}, {"sft": {"data-train-split": "train_sft"}}, "--config")
    assert stages["sft"].data.data_train_split == "train_sft"
    assert stages["reward"].data.data_train_split == "train_prefs"
    resolve_stage_configs(stages, None, {}, {"ppo": {"data-test-split": "test_prefs"}}, "--config")
    assert stages["ppo"].data.data_test_split == "test_prefs"  # its held-out prompts


def test_e2e_without_data_refuses_the_selection_flags() -> None:
    with pytest.raises(UserError, match="rlhf e2e: data_test_split, data_mix select within --data"):
        resolve_config(E2EConfig(), ConfigSources(flags={"data_test_split": "test", "data_mix": "1"}),
                       where="rlhf e2e")


# ---------------------------------------------------------------- the command line


def test_sft_trains_on_one_split_evaluates_on_another_with_renamed_columns(
        tiny_model_dirs: dict, prefs_dict: Path, tmp_path: Path, log_records: list, one_thread: None) -> None:
    out = tmp_path / "sft"
    main(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(prefs_dict), "--output", str(out),
          "--data-train-split", "train_prefs", "--data-test-split", "test_prefs",
          "--data-columns", "prompt=question,response=solution", "--max-steps", "2", "--micro-batch-size", "4",
          "--report-to", "none", "--optimizer-impl", "torch", "--dtype", "fp32"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["train_rows"] == 24 and summary["eval_rows"] == 6
    assert summary["data"]["kept"] == 24 and summary["data"]["eval_kept"] == 6 and summary["eval_loss"] > 0
    logged = messages(log_records)
    assert f"loaded 24 rows from {prefs_dict} (split train_prefs)" in logged
    assert f"loaded 6 rows from {prefs_dict} (split test_prefs)" in logged


def test_an_unknown_split_on_the_command_line_is_one_error_line(
        tiny_model_dirs: dict, prefs_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(prefs_dict), "--output",
              str(tmp_path / "o"), "--data-train-split", "train_sft", "--report-to", "none"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {prefs_dict}: no split 'train_sft' (--data-train-split); "
                       "its splits: train_prefs, test_prefs")


def test_e2e_shares_the_selection_of_its_data_between_the_stages(tmp_path: Path, log_records: list,
                                                                   one_thread: None) -> None:
    """`rlhf e2e` on two saved DatasetDicts (a train_pairs / test_pairs split, a column to rename),
    mixed 2:1 and then shared out 1,1,1: every stage reads the same mix, sft and reward evaluate on
    the test splits."""
    for name, n in (("a", 30), ("b", 30)):
        pairs = [{"question": f"{name} {i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(n)]
        DatasetDict({"train_pairs": Dataset.from_list(pairs), "test_pairs": Dataset.from_list(pairs[:4])}
                    ).save_to_disk(str(tmp_path / name))
    out = tmp_path / "run"
    main(["e2e", "--output", str(out), "--data", str(tmp_path / "a"), "--data", str(tmp_path / "b"),
          "--data-mix", "2,1", "--data-split", "1,1,1", "--data-train-split", "train_pairs",
          "--data-test-split", "test_pairs", "--data-columns", "prompt=question", "--tiny-hidden-size", "32",
          "--report-to", "none", "--sft.max-steps", "1", "--sft.micro-batch-size", "4", "--reward.max-steps", "1",
          "--reward.micro-batch-size", "4", "--ppo.max-steps", "1", "--ppo.generation-batch-size", "4",
          "--ppo.micro-batch-size", "4", "--ppo.max-new-tokens", "4"])
    sft, reward, ppo = (json.loads((out / s / "summary.json").read_text()) for s in ("sft", "reward", "ppo"))
    assert sft["train_rows"] == reward["train_rows"] == 15 and ppo["prompts"] == 15  # 45 mixed rows, a third each
    assert sft["eval_rows"] == reward["eval_rows"] == 8 and "eval_kept" not in ppo["data"]
    assert sft["data"]["mix_left_out"] == reward["data"]["mix_left_out"] == ppo["data"]["mix_left_out"] == 15
    assert messages(log_records).count(f"{tmp_path / 'b'} (split train_pairs) gave 15 of 30 (15 left out)") == 3


def test_an_ultrafeedback_shaped_dataset_trains_the_reward_stage(tmp_path: Path) -> None:
    """ultrafeedback_binarized's columns and splits (train_prefs / test_prefs): a row with chosen and
    rejected is a preference pair although it also has a `messages` column."""
    def rows(n: int) -> list[dict]:
        out = []
        for i in range(n):
            prompt = f"{i}+1="
            chosen = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(i + 1)}]
            rejected = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(i)}]
            out.append({"prompt": prompt, "prompt_id": str(i), "chosen": chosen, "rejected": rejected,
                        "messages": chosen, "score_chosen": 8.0, "score_rejected": 2.0})
        return out

    DatasetDict({"train_prefs": Dataset.from_list(rows(6)), "test_prefs": Dataset.from_list(rows(2))}
                ).save_to_disk(str(tmp_path / "uf"))
    data = DataConfig(data=[str(tmp_path / "uf")], data_train_split="train_prefs", data_test_split="test_prefs")
    tok = build_char_tokenizer()
    stage = load_stage_rows(data, "reward", 0, lambda parsed: tokenize_pairs(parsed, tok, 64), empty="none")
    assert (len(stage.train), len(stage.eval), stage.stats["kept"], stage.stats["eval_kept"]) == (6, 2, 6, 2)
