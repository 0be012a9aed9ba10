"""`rlhf chat`, `rlhf report`, `--help`, and one-line errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.cli import main
from tests.conftest import REPO


def test_chat_answers_one_shot_and_interactively(tiny_model_dirs, capsys):
    main(["chat", "--model", str(tiny_model_dirs["llama"]), "--prompt", "sort: cba", "--max-new-tokens", "5",
          "--temperature", "0"])
    one_shot = capsys.readouterr().out.strip()
    assert 0 < len(one_shot) <= 5
    result = subprocess.run([sys.executable, "-m", "rlhf", "chat", "--model", str(tiny_model_dirs["llama"]),
                             "--max-new-tokens", "5", "--temperature", "0"], input="sort: cba\n/reset\nhi\n\n",
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # each reply follows the "you> " prompt on the same line
    replies = [line.split("model> ", 1)[1] for line in result.stdout.splitlines() if "model> " in line]
    assert len(replies) == 2 and replies[0] == one_shot
    # The ops were built by the call above: a later process loads them without a word.
    assert "rlhf.engine" not in result.stderr and "ninja" not in result.stderr, result.stderr[-2000:]


def test_chat_scores_with_a_reward_model(tiny_model_dirs, tmp_path, capsys):
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.value_model import ValueModel

    rm = tmp_path / "rm"
    ValueModel.from_causal_lm_dir(tiny_model_dirs["llama"], head_init_std=0.5).save_pretrained(rm)
    load_tokenizer(str(tiny_model_dirs["llama"])).save_pretrained(rm)
    main(["chat", "--model", str(rm), "--prompt", "sort: cba ||| abc"])
    first = capsys.readouterr().out.strip()
    main(["chat", "--model", str(rm), "--prompt", "sort: cba ||| cab"])
    second = capsys.readouterr().out.strip()
    assert first.startswith("score: ") and second.startswith("score: ") and first != second


def test_report_lists_the_ops(capsys):
    main(["report"])
    out = capsys.readouterr().out
    assert "torch" in out and "fused_adam_cpu" in out and "rlhf_decode_attention" in out
    assert "cpu matmul    --cpu-matmul auto: " in out  # which library float32 CPU linears take here, and why


def test_report_build_prints_a_line_per_op_and_fails_when_one_cannot_build(capsys):
    from rlhf.engine.ops import registered_ops

    main(["report", "--build"])  # the CPU ops are in the cache by now (or built here, once)
    out = capsys.readouterr().out
    count = len(registered_ops())
    for spec in registered_ops():
        line = next(li for li in out.splitlines() if li.startswith("[") and f"] {spec.name} " in li and "..." not in li)
        assert ("skipped (no CUDA device" in line) if spec.needs_cuda else ("self-test passed" in line), line
    assert f"[{count}/{count}]" in out
    result = subprocess.run([sys.executable, "-m", "rlhf", "report", "--build"], capture_output=True, text=True,
                            cwd=REPO, timeout=120, env={**os.environ, "RLHF_DISABLE_OPS": "1"})
    assert result.returncode == 1
    assert "fused_adam_cpu               FAILED (RLHF_DISABLE_OPS=1)" in result.stdout
    assert "error: an op failed to build" in result.stderr


def test_version(capsys):
    from importlib.metadata import version

    main(["--version"])
    assert capsys.readouterr().out.strip() == f"rlhf {version('rlhf')}"
    result = subprocess.run([sys.executable, "-m", "rlhf", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"rlhf {version('rlhf')}"


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo", "e2e"])
def test_help_works(stage, capsys):
    main([stage, "--help"])
    assert "--output" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["sft", "--model", "/nonexistent/model", "--data", "x.jsonl", "--output", "o"], "--model /nonexistent/model: folder not found"),
    (["sft", "--lr", "fast"], "Invalid value for '--lr'"),
    (["ppo", "--output", "o"], "--actor is required"),
])
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlhf", *args], capture_output=True, text=True, cwd=tmp_path,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
