"""SIGTERM / SIGINT (what SLURM and Kubernetes send before a kill, and Ctrl-C) stop a run after the
current step with a complete checkpoint, one line and exit code 143 / 130; `--resume` then gives
exactly the uninterrupted run. A second signal exits at once, keeping the last checkpoint.

Real signals to real processes: SFT gets it from the test once the first metrics row is written
(one rank directly; two ranks through the `--nproc-per-node` launcher, which forwards it); PPO's
reward function sends it to its own process in the middle of iteration 2 (with two ranks on rank 0
alone, so the ranks must agree to stop together).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf.engine.checkpoint import checkpoint_step, is_complete
from tests.conftest import REPO, read_metrics, run_cli, train_losses

SFT = ["--lr", "3e-3", "--report-to", "none", "--optimizer-impl", "torch", "--lr-scheduler", "constant",
       "--dtype", "fp32", "--micro-batch-size", "8"]
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "RLHF_FORCE_CPU": "1"}

STOPPING_REWARD = '''
import os
import signal
import time
from pathlib import Path

_sent = False


def reward(prompt, response):
    """The response's length. With STOP_OUTPUT set, rank 0 sends its own process SIGTERM at its first
    call once STOP_OUTPUT/metrics.jsonl holds a row (in iteration 2), writes STOP_MARKER, then sleeps
    STOP_THEN_SLEEP seconds (a slow iteration)."""
    global _sent
    out = os.environ.get("STOP_OUTPUT")
    metrics = Path(out or ".") / "metrics.jsonl"
    if out and not _sent and os.environ.get("RANK", "0") == "0" and metrics.is_file() and metrics.read_text().strip():
        _sent = True
        os.kill(os.getpid(), signal.SIGTERM)
        Path(os.environ["STOP_MARKER"]).write_text("sent")
        time.sleep(float(os.environ.get("STOP_THEN_SLEEP", "0")))
    return float(len(response))
'''


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`rlhf ARGS` in a subprocess, its stderr into `log`."""
    with log.open("w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "rlhf", *args], stdout=subprocess.DEVNULL, stderr=stderr,
                                text=True, env={**os.environ, **ENV, **(env or {})}, cwd=REPO)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the signal"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def has_rows(output: Path) -> bool:
    path = output / "metrics.jsonl"
    return path.is_file() and path.read_text().strip() != ""


def stop_line(stderr: str, name: str) -> int:
    """The step of the one 'stopped by NAME at step N; resume with --resume' line."""
    lines = [line for line in stderr.splitlines() if f"stopped by {name} at step" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert "resume with --resume" in lines[0] and "Traceback" not in stderr and "error:" not in stderr, stderr[-3000:]
    return int(re.search(r"at step (\d+)", lines[0]).group(1))


def assert_stopped_at(run: Path, step: int) -> None:
    """A complete checkpoint of `step`, no partial one, and one metrics row per step up to it."""
    assert is_complete(run / "checkpoints" / f"step_{step:08d}")
    assert not list(run.rglob("*.tmp")) and not (run / "DONE").exists()
    assert [r["step"] for r in read_metrics(run)] == list(range(1, step + 1))


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("nproc,signum", [(1, signal.SIGTERM), pytest.param(2, signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_mid_sft_stops_after_a_checkpoint_and_resume_is_bit_equal(nproc, signum, tiny_model_dirs, sft_data,
                                                                          tmp_path):
    steps = 200 if nproc == 1 else 100  # long enough that the signal lands mid-run
    args = ["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data), *SFT, "--max-steps", str(steps),
            *(["--nproc-per-node", str(nproc)] if nproc > 1 else [])]
    full = run_cli([*args, "--output", str(tmp_path / "full")], env=ENV)
    assert full.returncode == 0, full.stderr[-3000:]

    cut, log = tmp_path / "cut", tmp_path / "cut.log"
    proc = start([*args, "--output", str(cut)], log)
    wait_for(lambda: has_rows(cut), proc)
    os.kill(proc.pid, signum)  # with two ranks: the launcher, which forwards it to both
    assert proc.wait(timeout=240) == 128 + signum, log.read_text()[-3000:]
    step = stop_line(log.read_text(), signal.Signals(signum).name)
    assert 1 <= step < steps
    assert_stopped_at(cut, step)

    resumed = run_cli([*args, "--output", str(cut), "--resume"], env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(cut) == train_losses(tmp_path / "full")
    assert same_weights(cut / "model", tmp_path / "full" / "model")


@pytest.fixture
def ppo_args(tiny_model_dirs, tmp_path) -> list[str]:
    (tmp_path / "stopping.py").write_text(STOPPING_REWARD)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(16)))
    return ["ppo", "--actor", str(tiny_model_dirs["llama"]), "--reward-fn", f"{tmp_path / 'stopping.py'}:reward",
            "--advantage-estimator", "grpo", "--samples-per-prompt", "2", "--generation-batch-size", "4",
            "--max-new-tokens", "4", "--max-steps", "4", "--data", str(prompts), "--report-to", "none",
            "--optimizer-impl", "torch", "--lr", "1e-2", "--lr-scheduler", "constant", "--dtype", "fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_mid_ppo_iteration_stops_after_it_and_resume_is_bit_equal(nproc, ppo_args, tmp_path):
    args = [*ppo_args, *(["--nproc-per-node", str(nproc)] if nproc > 1 else [])]
    full = run_cli([*args, "--output", str(tmp_path / "full")], env=ENV)
    assert full.returncode == 0, full.stderr[-3000:]

    cut = tmp_path / "cut"
    stopped = run_cli([*args, "--output", str(cut)],
                      env={**ENV, "STOP_OUTPUT": str(cut), "STOP_MARKER": str(tmp_path / "sent")})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stop_line(stopped.stderr, "SIGTERM") == 2  # iteration 2 finished, then the stop
    assert_stopped_at(cut, 2)
    assert checkpoint_step(cut / "checkpoints" / "step_00000002") == 2

    resumed = run_cli([*args, "--output", str(cut), "--resume"], env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    keys = ("score_mean", "kl", "policy_loss", "response_length", "entropy")
    a, b = read_metrics(tmp_path / "full"), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a]
    assert same_weights(cut / "model", tmp_path / "full" / "model")


@pytest.mark.slow
def test_a_second_signal_exits_at_once_keeping_the_last_checkpoint(ppo_args, tmp_path):
    cut, log, marker = tmp_path / "cut", tmp_path / "cut.log", tmp_path / "sent"
    args = [*ppo_args, "--save-interval", "1", "--output", str(cut)]
    # Iteration 2's reward call signals, then takes 60 s; the second SIGTERM must not wait for it.
    proc = start(args, log, {"STOP_OUTPUT": str(cut), "STOP_MARKER": str(marker), "STOP_THEN_SLEEP": "60"})
    wait_for(marker.exists, proc)
    time.sleep(2.5)  # past the window in which a repeat counts as the same request
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    err = log.read_text()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: a second SIGTERM: exiting at once"), err[-3000:]
    assert "Traceback" not in err and "stopped by" not in err
    assert [checkpoint_step(p) for p in (cut / "checkpoints").glob("step_*")] == [1]
    assert is_complete(cut / "checkpoints" / "step_00000001")

    resumed = run_cli([*args, "--resume"], env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4] and (cut / "DONE").is_file()
