"""scripts/bench_dpo.py end to end on a tiny model, ours only (TRL's side needs a trl 1.16 python):
it writes TRL's conversational pairs, runs `rlhf dpo` and prints one JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.models.tiny import save_tiny_model

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_dpo_runs_ours_and_prints_one_json_line(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "tiny", "llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_dpo.py"), "--model", str(model),
                           "--task", "sort", "--steps", "4", "--batch", "4", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "dpo" and result["steps"] == 4 and result["batch"] == 4
    assert result["seconds_per_step"]["ours"] > 0 and result["pairs_per_s"]["ours"] > 0
    assert result["seconds_per_step"]["peer"] is None and result["speedup"] is None and result["trl"] is None
    assert result["ours"]["first_loss"] == 0.6931  # the policy starts as its reference
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 16 and pairs[0]["prompt"][0]["role"] == "user" and pairs[0]["chosen"][0]["role"] == "assistant"
    assert "[bench_dpo] ours:" in proc.stderr  # the log lines name this benchmark
    # A second invocation into the same folder starts each side fresh.
    again = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_dpo.py"), "--model", str(model),
                            "--task", "sort", "--steps", "4", "--batch", "4", "--threads", "1", "--out", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
