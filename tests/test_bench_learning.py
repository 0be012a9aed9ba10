"""scripts/bench_learning.py end to end on a tiny model (ours only; the TRL peer in a slow test), and
the shared reward file scripts/rewards/answer_match.py on hand-made completions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlhf.models.tiny import save_tiny_model

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_learning.py"
REWARD_FILE = REPO / "scripts" / "rewards" / "answer_match.py"
PEER_PYTHON = Path(os.environ.get("TRL_PYTHON", "/nonexistent"))
PEER_SCRIPT = os.environ.get("TRL_GRPO_SCRIPT", "")
KEYS = {"bench", "model", "task", "steps", "group", "prompts_per_step", "max_new_tokens", "lr", "eval_rows",
        "accuracy", "seconds_per_step", "speedup", "trl", "machine"}


def answer_match() -> Callable[..., list[float]]:
    spec = importlib.util.spec_from_file_location("answer_match_under_test", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.answer_match


def test_answer_match_messages_and_strings() -> None:
    f = answer_match()
    messages = [[{"role": "assistant", "content": c}] for c in ("15", " 15. The end", "'15'!", "16", "", "1 5")]
    assert f(messages, answer=["15"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert f(["abc", "abc, yes", "ab c", "  \n"], answer=["abc"] * 4, prompts=["p"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert f(["42"], answer=[42]) == [1.0]  # a non-string answer column compares by its text
    assert f(["42"], answer=[None]) == [0.0]


def run_bench(tmp_path: Path, *extra: str) -> dict:
    model = save_tiny_model(tmp_path / "tiny", "llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--task", "sort", "--steps", "2", "--group", "4",
           "--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-rows", "8", "--threads", "1",
           "--out", str(tmp_path / "out"), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_learning_ours_only(tmp_path: Path) -> None:
    line = run_bench(tmp_path, "--skip-peer")
    assert set(line) == KEYS
    assert line["bench"] == "learning" and line["task"] == "sort" and line["steps"] == 2 and line["group"] == 4
    assert set(line["accuracy"]) == {"base", "ours", "peer"}
    assert all(0.0 <= line["accuracy"][k] <= 1.0 for k in ("base", "ours"))
    assert line["accuracy"]["peer"] is None and line["seconds_per_step"]["peer"] is None
    assert line["seconds_per_step"]["ours"] > 0 and line["speedup"] is None and line["trl"] is None
    train = [json.loads(r) for r in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(r) for r in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 4 and len(held_out) == 8  # steps x prompts-per-step training rows
    assert train[0]["prompt"][0]["role"] == "user" and train[0]["answer"]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held_out}


@pytest.mark.slow
@pytest.mark.skipif(not (PEER_PYTHON.exists() and PEER_SCRIPT), reason="TRL_PYTHON and TRL_GRPO_SCRIPT not set")
def test_bench_learning_with_peer(tmp_path: Path) -> None:
    line = run_bench(tmp_path, "--peer-python", str(PEER_PYTHON), "--peer-script", PEER_SCRIPT)
    assert line["trl"] and line["trl"].startswith("1.")
    assert 0.0 <= line["accuracy"]["peer"] <= 1.0
    assert line["seconds_per_step"]["peer"] > 0 and line["speedup"] > 0
