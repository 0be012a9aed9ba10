"""A stalled rank never hangs a job: 2-rank gloo runs on CPU.

Rank 1 stops itself with SIGSTOP at the start of step 2 (the RLHF_TEST_STALL hook of
engine/watchdog.py); rank 0 must end the job within --dist-timeout + 10 s of that moment with one
line naming rank 1, and no process may be left behind. A user error raised on every rank is
printed once. A rank that finished leaves through `exit_rank`, which must still do what a normal
exit does before finalization.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.conftest import REPO

DIST_TIMEOUT = 10


def run_timed(args: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int, list[tuple[float, str]], float]:
    """`rlhf ARGS` in a subprocess: its exit code, its stderr lines with the time each arrived, and
    the time it exited."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "RLHF_FORCE_CPU": "1", **env}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=full_env, cwd=REPO)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    exited = time.monotonic()
    reader.join(timeout=10)
    return code, lines, exited


def processes_writing(output: Path) -> list[psutil.Process]:
    """Processes still alive whose command line names `output` (the job's ranks and launcher)."""
    alive = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if str(output) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            alive.append(proc)
    return alive


def sft_args(model: Path, data: Path, output: Path) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--output", str(output), "--micro-batch-size", "2",
            "--max-steps", "6", "--report-to", "none", "--optimizer-impl", "torch", "--nproc-per-node", "2",
            "--dist-timeout", str(DIST_TIMEOUT)]


def test_a_stopped_rank_ends_the_job_within_the_timeout(tiny_model_dirs, sft_data, tmp_path):
    output = tmp_path / "out"
    code, lines, exited = run_timed(sft_args(tiny_model_dirs["llama"], sft_data, output),
                                    {"RLHF_TEST_STALL": "1:3"})
    text = "\n".join(line for _, line in lines)
    stopped = [t for t, line in lines if "RLHF_TEST_STALL: rank 1 stops itself" in line]
    assert stopped, text[-3000:]
    errors = [line for _, line in lines if line.startswith("error:")]
    assert code == 2, text[-3000:]
    assert len(errors) == 1 and "rank 1 (pid" in errors[0] and "made no progress" in errors[0], text[-3000:]
    assert "Traceback" not in text
    took = exited - stopped[0]
    assert took < DIST_TIMEOUT + 10, f"{took:.1f} s after the stall"
    time.sleep(1)
    assert not processes_writing(output), "a rank outlived the job"
    assert not (output / "DONE").exists()


def test_a_user_error_on_every_rank_is_one_line(tiny_model_dirs, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "x"}\n')
    code, lines, _ = run_timed(sft_args(tiny_model_dirs["llama"], data, tmp_path / "out"), {})
    errors = [line for _, line in lines if "error" in line.lower() or "Traceback" in line]
    assert code == 2
    assert errors == [f"error: {data} line 2: not UTF-8 text (byte 0xe9 at offset 48); save the file as UTF-8 or "
                      "fix that row"], errors


EXITING_RANK = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from rlhf.engine.distributed import exit_rank

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("joined"))).start()
idle = ThreadPoolExecutor(1)  # never shut down: its worker waits for work until exit tells it to stop
idle.submit(lambda: None).result()
print("buffered", end="")
exit_rank(3)
"""


def test_exit_rank_does_what_a_normal_exit_does_before_finalization(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", EXITING_RANK, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered"
    assert (tmp_path / "thread").read_text() == "joined"  # non-daemon threads joined
    assert (tmp_path / "atexit").read_text() == "ran"
