"""One writer per output folder (rlhf/output_lock.py): a second run, a `--resume` while the first
runs, a second `rlhf e2e` are refused in one line naming the holder's pid and host; the lock of a
killed run is taken over with a line. Real concurrent processes throughout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.errors import UserError
from rlhf.output_lock import LOCK_NAME, lock_output, release_output
from tests.conftest import REPO, hold_output_lock, run_cli

def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_held_lock_is_refused_naming_its_holder_and_a_dead_ones_is_taken_over(tmp_path, rlhf_log):
    holder = hold_output_lock(tmp_path)
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    with pytest.raises(UserError, match=rf"in use by another run \(pid {holder.pid} on host "):
        lock_output(tmp_path)
    kill(holder)  # killed: its flock is gone, its file (and pid) stay
    assert (tmp_path / LOCK_NAME).is_file()
    lock_output(tmp_path)
    taken = [r.getMessage() for r in rlhf_log.records if "taking over" in r.getMessage()]
    assert len(taken) == 1 and f"pid {holder.pid}" in taken[0], taken
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert lock_output(tmp_path).path == tmp_path / LOCK_NAME  # this process again: the lock it holds
    release_output(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()  # released: unlinked, nothing left to take over
    lock_output(tmp_path)
    release_output(tmp_path)
    assert len([r for r in rlhf_log.records if "taking over" in r.getMessage()]) == 1


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).symlink_to(tmp_path.parent / "elsewhere")
    with pytest.raises(UserError, match="is a symbolic link"):
        lock_output(tmp_path)
    assert not (tmp_path.parent / "elsewhere").exists()


def sft_args(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--output", str(output), "--report-to", "none",
            "--micro-batch-size", "8", "--optimizer-impl", "torch", *extra]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """`rlhf ARGS` running in the background, its stderr to `log` (a pipe nobody reads would fill)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "rlhf", *args], stdout=subprocess.DEVNULL, stderr=err,
                                env=env, cwd=REPO)


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_second_run_and_a_resume_while_training_are_refused(tiny_model_dirs, sft_data, tmp_path):
    """A real training run holds its folder; a second run and a --resume are refused (exit 2, one
    line with its pid), then the lock of the killed run is taken over by the next --resume."""
    run = tmp_path / "run"
    args = sft_args(tiny_model_dirs["llama"], sft_data, run)
    first = start([*args, "--max-steps", "100000"], tmp_path / "first.log")
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 1,
                 first, tmp_path / "first.log")
        for extra in ((), ("--resume",)):
            second = run_cli([*args, "--max-steps", "100000", *extra])
            assert second.returncode == 2, second.stderr[-3000:]
            lines = error_lines(second.stderr)
            assert len(lines) == 1 and f"in use by another run (pid {first.pid} on host" in lines[0], second.stderr
            assert "Traceback" not in second.stderr
    finally:
        kill(first)
    # metrics.jsonl is the first run's alone: steps 1, 2, ... once each, none from the refused runs.
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, len(steps) + 1))
    resumed = run_cli([*args, "--max-steps", "2", "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    taken = [line for line in resumed.stderr.splitlines() if "taking over the lock" in line]
    assert len(taken) == 1 and f"pid {first.pid}" in taken[0], resumed.stderr[-3000:]
    assert (run / "DONE").is_file() and not (run / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_e2e_runs_on_one_folder_the_second_is_refused(tmp_path):
    run = tmp_path / "e2e"
    args = ["e2e", "--output", str(run), "--report-to", "none", "--n-sft", "16", "--n-pairs", "16", "--n-prompts",
            "16", "--n-eval-pairs", "4", "--n-eval-prompts", "4", "--sft.max-steps", "100000",
            "--sft.micro-batch-size", "8"]
    first = start(args, tmp_path / "first.log")
    try:
        # The first is in its SFT stage, holding the e2e folder too.
        wait_for(lambda: (run / "sft" / LOCK_NAME).is_file(), first, tmp_path / "first.log")
        second = run_cli(args)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = error_lines(second.stderr)
        assert len(lines) == 1 and f"{run}: in use by another run (pid {first.pid} on host" in lines[0], second.stderr
        assert "Traceback" not in second.stderr
    finally:
        kill(first)


def test_every_rank_of_a_refused_multi_process_run_stops_with_one_line(tiny_model_dirs, sft_data, tmp_path):
    """Rank 0 takes the lock for the job; every rank ends with its refusal, printed once."""
    run = tmp_path / "run"
    run.mkdir()
    holder = hold_output_lock(run)
    try:
        result = run_cli(sft_args(tiny_model_dirs["llama"], sft_data, run, "--max-steps", "2", "--nproc-per-node",
                                  "2"))
    finally:
        kill(holder)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and f"in use by another run (pid {holder.pid}" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
