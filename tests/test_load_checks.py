"""Models checked at load, data read as written (issue 56), through the real entry point
`rlhf.cli.main` in this process.

Models: a NaN (or infinite) weight, a tokenizer with ids beyond the embedding, or a model of 16
positions is each found when the model is loaded, for every command that loads it: one `error:`
line naming the folder and the tensor or both numbers (exit 2), or, for the positions, rows cut
to the model's positions and counted. Data: a JSONL line holding U+2028/U+2029 loads, and numbers
where text is expected (a CSV column, "completion": 4, a message's content) are read as their text
and counted in the log.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from rlhf.cli import main
from rlhf.errors import UserError
from tests.conftest import write_jsonl
from tests.test_bad_inputs import error_output, expand

NAN_TENSOR = "model.layers.1.mlp.down_proj.weight"
EXTRA_TOKENS = ["<extra_0>", "<extra_1>", "<extra_2>", "<extra_3>", "<extra_4>"]


def _edit_weights(folder: Path, key: str, value: float) -> None:
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors[key].view(-1)[3] = value
    save_file(tensors, weights, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]) -> dict[str, str]:
    """Model folders with one fault each, and data files, by name (the cases' `{name}` placeholders)."""
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.models.tiny import save_tiny_model
    from rlhf.models.value_model import ValueModel

    root = tmp_path_factory.mktemp("load_checks")
    good = tiny_model_dirs["llama"]
    tokenizer = load_tokenizer(str(good))

    nan = root / "nan_weights"
    shutil.copytree(good, nan)
    _edit_weights(nan, NAN_TENSOR, float("nan"))

    rm_inf = root / "rm_inf"  # a reward model whose head holds an infinity
    ValueModel.from_causal_lm_dir(good, head_init_std=0.5).save_pretrained(rm_inf)
    tokenizer.save_pretrained(rm_inf)
    _edit_weights(rm_inf, "score.weight", float("inf"))

    wide = root / "wide_tokenizer"  # 5 ids more than the embedding has rows
    shutil.copytree(good, wide)
    wide_tokenizer = load_tokenizer(str(good))
    wide_tokenizer.add_tokens(EXTRA_TOKENS)
    wide_tokenizer.save_pretrained(wide)

    resized = root / "resized"  # the wide tokenizer with an embedding resized to it: a good actor
    model = load_causal_lm(str(good))
    model.resize_token_embeddings(len(wide_tokenizer))
    model.save_pretrained(resized)
    wide_tokenizer.save_pretrained(resized)

    short = save_tiny_model(root / "short_positions", "llama", hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_positions=16)

    write_jsonl(root / "sft.jsonl", [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(16)])
    write_jsonl(root / "pairs.jsonl", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)}
                                       for i in range(16)])
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"sort: {'cbad'[: 3 + i % 2]}"} for i in range(16)])
    # 30 tokens each with the character tokenizer: <s>, 29 characters, </s> (a prompt of the chat
    # template alone fills 16 positions: such rows are dropped, and counted, as over-long prompts)
    write_jsonl(root / "long_rows.jsonl", [{"text": f"{i} quick brown fox jumps over"} for i in range(5)])

    paths = {"good": good, "nan": nan, "rm_inf": rm_inf, "wide": wide, "resized": resized, "short": short}
    return {**{k: str(v) for k, v in paths.items()}, **{p.name: str(p) for p in root.glob("*.jsonl")},
            "root": str(root)}


SFT = ["sft", "--data", "{sft.jsonl}", "--report-to", "none", "--max-steps", "1", "--micro-batch-size", "2"]
REWARD = ["reward", "--data", "{pairs.jsonl}", "--report-to", "none", "--max-steps", "1", "--micro-batch-size", "2"]
PPO = ["ppo", "--reward-fn", "sort", "--data", "{prompts.jsonl}", "--report-to", "none", "--max-steps", "1",
       "--generation-batch-size", "4", "--max-new-tokens", "4"]
E2E = ["e2e", "--report-to", "none", "--n-sft", "64", "--n-pairs", "16", "--n-prompts", "16", "--n-eval-pairs", "4",
       "--n-eval-prompts", "4", "--sft.max-steps", "1", "--reward.max-steps", "1", "--ppo.max-steps", "1"]
CHAT = ["chat", "--prompt", "sort: cba", "--max-new-tokens", "4"]

NAN_LINE = f"weight {NAN_TENSOR} (model.safetensors) holds NaN values"
WIDE_LINE = "its tokenizer has 106 ids but the model's embedding has 101 rows (vocab_size)"

# (id, arguments (--output is added to every stage command), what the one error line must contain)
CASES = [
    ("sft-nan-weights", [*SFT, "--model", "{nan}"], "--model {nan}: " + NAN_LINE),
    ("reward-nan-weights", [*REWARD, "--model", "{nan}"], "--model {nan}: " + NAN_LINE),
    ("ppo-actor-nan-weights", [*PPO, "--actor", "{nan}", "--critic", "{good}"], "--actor {nan}: " + NAN_LINE),
    ("ppo-critic-nan-weights", [*PPO, "--actor", "{good}", "--critic", "{nan}"], "--critic {nan}: " + NAN_LINE),
    ("ppo-ref-nan-weights", [*PPO, "--actor", "{good}", "--critic", "{good}", "--ref", "{nan}"],
     "--ref {nan}: " + NAN_LINE),
    ("ppo-reward-inf-head", [*PPO, "--actor", "{good}", "--critic", "{good}", "--reward", "{rm_inf}"],
     "--reward {rm_inf}: weight score.weight (model.safetensors) holds inf values"),
    ("chat-nan-weights", [*CHAT, "--model", "{nan}"], f"--model {{nan}}: weight {NAN_TENSOR} holds NaN values"),
    ("chat-reward-inf-head", ["chat", "--model", "{rm_inf}", "--prompt", "a ||| b"],
     "--model {rm_inf}: weight score.weight holds inf values"),
    ("e2e-nan-weights", [*E2E, "--model", "{nan}"], "--model {nan}: " + NAN_LINE),
    ("sft-tokenizer-beyond-embedding", [*SFT, "--model", "{wide}"], "--model {wide}: " + WIDE_LINE),
    ("reward-tokenizer-beyond-embedding", [*REWARD, "--model", "{wide}"], "--model {wide}: " + WIDE_LINE),
    ("ppo-actor-tokenizer-beyond-embedding", [*PPO, "--actor", "{wide}", "--critic", "{wide}"],
     "--actor {wide}: " + WIDE_LINE),
    ("ppo-critic-embedding-short-of-actor-tokenizer", [*PPO, "--actor", "{resized}", "--critic", "{good}"],
     "--critic {good}: the --actor tokenizer has 106 ids but the model's embedding has 101 rows"),
    ("chat-tokenizer-beyond-embedding", [*CHAT, "--model", "{wide}"], "--model {wide}: " + WIDE_LINE),
    ("e2e-tokenizer-beyond-embedding", [*E2E, "--model", "{wide}"], "--model {wide}: " + WIDE_LINE),
    # the longest prompt: <s> + "Human: sort: cbad\n\nAssistant:" = 30 tokens, + 4 new ones
    ("ppo-ref-positions-short-of-rollouts", [*PPO, "--actor", "{good}", "--critic", "{good}", "--ref", "{short}"],
     "--ref {short}: rollouts of up to 34 tokens (prompt + --max-new-tokens) exceed its max_position_embeddings 16"),
]


@pytest.mark.parametrize("args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_broken_model_is_one_error_line(args, message, inputs, tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    monkeypatch.setenv("RLHF_FORCE_CPU", "1")
    argv = expand(args, inputs, tmp_path)
    if argv[0] != "chat":
        argv += ["--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = error_output(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert expand([message], inputs, tmp_path)[0] in lines[0], lines[0]


def test_a_special_token_past_the_embedding_names_both_numbers(tiny_model_dirs):
    from rlhf.models.checks import check_tokenizer_fits

    class Tokenizer:  # 90 ids, but a special token numbered past the embedding's 101 rows
        all_special_ids = [0, 2, 140]
        all_special_tokens = ["<pad>", "</s>", "<tool>"]

        def __len__(self) -> int:
            return 90

    with pytest.raises(UserError, match=r"special token '<tool>' has id 140 but the model's embedding has 101 rows"):
        check_tokenizer_fits(Tokenizer(), str(tiny_model_dirs["llama"]), "--model")


def test_a_model_loaded_shard_by_shard_is_scanned_once(tiny_model_dirs, monkeypatch, one_thread):
    """The loader checks what it reads; the engine then does not scan the weights again."""
    from rlhf.engine import train_engine
    from rlhf.engine.config import EngineConfig
    from rlhf.engine.distributed import DistributedContext
    from rlhf.models import checks
    from rlhf.models.loading import deferred_causal_lm

    scans: list[str] = []

    def counting(who: str, check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
        def scan(named: Any) -> str | None:
            scans.append(who)
            return check(named)
        return scan

    monkeypatch.setattr(checks, "first_non_finite", counting("loader", checks.first_non_finite))
    monkeypatch.setattr(train_engine, "first_non_finite", counting("engine", train_engine.first_non_finite))
    model, weights = deferred_causal_lm(str(tiny_model_dirs["llama"]))
    train_engine.TrainEngine(model, EngineConfig(dtype="fp32", micro_batch_size=1), DistributedContext.initialize(),
                             total_steps=1, weights=weights)
    assert scans == ["loader"]


def test_a_sum_that_overflows_is_not_a_nonfinite_weight():
    import torch

    from rlhf.models.checks import first_nonfinite

    big = torch.full((4,), 3e38)  # finite, but its float32 sum is inf
    assert first_nonfinite([("big", big), ("small", torch.ones(3))]) is None
    assert first_nonfinite([("big", big), ("bad", torch.tensor([1.0, float("-inf")]))]) == ("bad", "inf")


# ---------------------------------------------------------------- rows and positions


def logged(records: list[logging.LogRecord]) -> str:
    return "\n".join(r.getMessage() for r in records)


def test_rows_longer_than_the_models_positions_are_cut_to_them_and_counted(inputs, tmp_path, capsys, log_records,
                                                                           one_thread, monkeypatch):
    """A model of 16 positions and rows of 30 tokens: --max-seq-len (512) is capped at 16 with one
    line, and every row is truncated to 16 tokens and counted (data inspect and summary.json)."""
    shown, counts = inspect(Path(inputs["long_rows.jsonl"]), "sft", capsys, inputs["good"])  # 512 positions
    assert [row["tokens"] for row in shown] == [30] * 5 and counts["truncated"] == 0
    shown, counts = inspect(Path(inputs["long_rows.jsonl"]), "sft", capsys, inputs["short"])
    assert all(row["truncated"] for row in shown) and counts["truncated"] == 5 and counts["kept"] == 5
    monkeypatch.setenv("RLHF_FORCE_CPU", "1")
    out = tmp_path / "out"
    main(expand(["sft", "--model", "{short}", "--data", "{long_rows.jsonl}", "--output", str(out), "--report-to",
                 "none", "--max-steps", "1", "--micro-batch-size", "2"], inputs, tmp_path))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["truncated"] == 5 and summary["data"]["kept"] == 5
    cap = f"--max-seq-len 512 capped at 16, the max_position_embeddings of --model {inputs['short']}"
    assert logged(log_records).count(cap) == 2  # inspected with the short model, then trained


# ---------------------------------------------------------------- data read as written


def inspect(data: Path, stage: str, capsys: pytest.CaptureFixture, model: str) -> tuple[list[dict], dict]:
    main(["data", "inspect", "--stage", stage, "--model", model, "--data", str(data), "--json", "--rows", "10"])
    # split at "\n" only: the rows' text may hold U+2028, which str.splitlines splits at
    lines = [json.loads(line) for line in capsys.readouterr().out.split("\n") if line]
    return lines[:-1], lines[-1]["counts"]


def test_a_json_line_holding_line_separators_loads(inputs, tmp_path, capsys):
    data = tmp_path / "separators.jsonl"
    rows = [{"prompt": "a\u2028b", "response": "c\u2029d"}, {"prompt": "e\x85f", "response": "g"}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert "\u2028" in data.read_text(encoding="utf-8")  # written as the characters, not as \u escapes
    shown, counts = inspect(data, "sft", capsys, inputs["good"])
    assert counts["kept"] == 2
    texts = ["".join(p["text"] for p in row["pieces"]) for row in shown]
    assert "a\u2028b" in texts[0] and "c\u2029d" in texts[0] and "e\x85f" in texts[1]


def test_a_csv_column_of_numbers_is_read_as_its_text(inputs, tmp_path, capsys, log_records, one_thread,
                                                     monkeypatch):
    """datasets infers int64 for a column of answers; the rows hold the file's text exactly ("007")
    and the log counts them; the stage trains on them."""
    data = tmp_path / "answers.csv"
    with open(data, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "response"])
        writer.writerows([[f"{i}+1=", f"{i + 1:03d}"] for i in range(8)])
    shown, counts = inspect(data, "sft", capsys, inputs["good"])
    assert counts["kept"] == 8
    texts = ["".join(p["text"] for p in row["pieces"]) for row in shown]
    assert all(f"{i}+1=" in text and f"Assistant: {i + 1:03d}</s>" in text for i, text in enumerate(texts))
    assert f"{data}: 8 values of column 'response' were numbers, read as text" in logged(log_records)
    monkeypatch.setenv("RLHF_FORCE_CPU", "1")
    out = tmp_path / "out"
    main(["sft", "--model", inputs["good"], "--data", str(data), "--output", str(out), "--report-to", "none",
          "--max-steps", "1", "--micro-batch-size", "2"])
    assert json.loads((out / "summary.json").read_text())["data"]["kept"] == 8


def test_numbers_in_json_text_fields_are_read_as_text(inputs, tmp_path, capsys, log_records):
    data = write_jsonl(tmp_path / "numbers.jsonl", [
        {"prompt": "2+2=", "completion": 4},
        {"prompt": 12, "completion": 2.5},
        {"messages": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": 6}]},
    ])
    shown, counts = inspect(data, "sft", capsys, inputs["good"])
    assert counts["kept"] == 3
    texts = ["".join(p["text"] for p in row["pieces"]) for row in shown]
    assert "Assistant: 4" in texts[0] and "Human: 12" in texts[1] and "Assistant: 2.5" in texts[1]
    assert "Assistant: 6" in texts[2]
    lines = logged(log_records)
    assert f"{data}: 2 values of column 'completion' were numbers, read as text" in lines
    assert f"{data}: 1 values of column 'prompt' were numbers, read as text" in lines
    assert f"{data}: 1 values of column 'messages' (message content) were numbers, read as text" in lines


def test_a_bool_or_nan_where_text_is_expected_is_still_refused(inputs, tmp_path, capsys):
    data = write_jsonl(tmp_path / "bool.jsonl", [{"prompt": "a", "completion": True}])
    with pytest.raises(SystemExit) as exc:
        inspect(data, "sft", capsys, inputs["good"])
    assert exc.value.code == 2
    assert "field 'completion' must be a non-empty string" in capsys.readouterr().err
