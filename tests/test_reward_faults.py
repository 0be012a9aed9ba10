"""User code that misbehaves, and runs with nothing to learn: a reward function that calls
sys.exit(0), raises KeyboardInterrupt or hangs is one error line naming it and the row (exit
code 2) while a real Ctrl-C still stops the run; --reward-timeout; W&B without a reachable server
goes offline; every group tied warns, and dynamic sampling that keeps nothing stops."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlhf.errors import UserError
from rlhf.reward_batch import RewardBatch
from rlhf.reward_functions import load_reward_function
from tests.conftest import REPO, read_metrics, run_cli, write_jsonl

FUNCTIONS = '''
import asyncio
import os
import signal
import sys
import time


def quits(prompt, response):
    sys.exit(0)


def interrupts(prompt, response):
    raise KeyboardInterrupt


def trl_quits(completions, **kwargs):
    sys.exit(3)


async def async_interrupts(prompt, response):
    raise KeyboardInterrupt


def sleeps(prompt, response):
    time.sleep(60)
    return 1.0


def spins(prompt, response):
    while True:
        pass


def trl_sleeps(completions, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)


async def async_sleeps(prompt, response):
    await asyncio.sleep(60)
    return 1.0


async def async_blocks(prompt, response):
    time.sleep(3)  # blocks the event loop: no await to cancel
    return 1.0


async def async_fine(prompt, response):
    return 1.0


def fast(prompt, response):
    return 1.0


def sigint_then_sleep(prompt, response):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return 1.0


def sigint_marker(prompt, response):
    """Write a marker on the first call, then wait for the test's SIGINT."""
    marker = os.environ["REWARD_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(5)
    return 1.0


def constant(prompt, response):
    return 1.0
'''


@pytest.fixture(scope="module")
def functions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fns") / "misbehaving.py"
    path.write_text(FUNCTIONS)
    return path


def load(functions: Path, name: str, timeout: float | None = None):
    function = load_reward_function(f"{functions}:{name}")
    function.timeout = timeout
    return function


BATCH = RewardBatch.of_texts(["p0", "p1"], ["a", "b"])


# ------------------------------------------------------------------ the guard, in-process


@pytest.mark.parametrize("name, shown", [("quits", "SystemExit(0)"), ("interrupts", "KeyboardInterrupt()"),
                                         ("trl_quits", "SystemExit(3)"), ("async_interrupts", "KeyboardInterrupt()")])
def test_exit_or_interrupt_raised_by_a_function_is_an_error_naming_it(functions: Path, name: str, shown: str) -> None:
    with pytest.raises(UserError) as info:
        load(functions, name)(BATCH)
    message = str(info.value)
    assert f"--reward-fn {functions}:{name}" in message and f"raised {shown}" in message
    assert ("on a batch of 2 rows" if name.startswith("trl") else "row 0 of the batch") in message
    assert load(functions, "async_fine")(BATCH) == [1.0, 1.0]  # the event loop survived


def test_a_real_sigint_during_a_call_passes_as_it_is(functions: Path) -> None:
    # Python's own handler, whatever this process inherited (a background job starts with SIGINT ignored).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load(functions, "sigint_then_sleep")(BATCH)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_graceful_stop_handler_still_sees_the_signal(functions: Path) -> None:
    """The training loop's own SIGINT handler (a flag, then exit on a second signal) is called as
    before, and what it raises is not taken for the function's error."""
    seen: list[int] = []

    def graceful(signum, frame):
        seen.append(signum)
        if len(seen) > 1:
            raise SystemExit(130)

    previous = signal.signal(signal.SIGINT, graceful)
    try:
        assert load(functions, "sigint_then_sleep")(RewardBatch.of_texts(["p"], ["a"])) == [1.0]
        assert seen == [signal.SIGINT]
        with pytest.raises(SystemExit) as info:
            load(functions, "sigint_then_sleep")(RewardBatch.of_texts(["p"], ["a"]))
        assert info.value.code == 130
        assert signal.getsignal(signal.SIGINT) is graceful
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("name, where", [("sleeps", "row 0 of the batch"), ("spins", "row 0 of the batch"),
                                         ("trl_sleeps", "on a batch of 2 rows"),
                                         ("async_sleeps", "of the batch")])
def test_a_call_past_the_timeout_is_interrupted_with_a_line_naming_the_row(functions: Path, name: str,
                                                                           where: str) -> None:
    started = time.monotonic()
    with pytest.raises(UserError) as info:
        load(functions, name, timeout=0.5)(BATCH)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert f"--reward-fn {functions}:{name}" in message and where in message
    assert "no result after --reward-timeout 0.5 s" in message


def test_an_async_function_that_blocks_its_loop_is_reported(functions: Path, monkeypatch) -> None:
    monkeypatch.setattr("rlhf.reward_batch.GRACE_S", 0.5)
    with pytest.raises(UserError, match="async_blocks: no result 1 s after .*blocks its event loop"):
        load(functions, "async_blocks", timeout=0.5)(BATCH)
    assert load(functions, "async_fine", timeout=0.5)(BATCH) == [1.0, 1.0]  # on a fresh loop


def test_a_call_within_the_timeout_returns_and_restores_the_handlers(functions: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert load(functions, "fast", timeout=5)(BATCH) == [1.0, 1.0]
    time.sleep(0.1)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_call_that_cannot_be_interrupted_ends_the_process(tmp_path: Path) -> None:
    """Code that swallows the interruption (or C code that never returns to Python) cannot be
    stopped: GRACE_S after the deadline the process prints the line and exits with code 2."""
    (tmp_path / "stuck.py").write_text(textwrap.dedent('''
        import time

        def stubborn(prompt, response):
            while True:
                try:
                    time.sleep(60)
                except BaseException:
                    pass
        '''))
    script = tmp_path / "run_stuck.py"
    script.write_text(textwrap.dedent('''
        import rlhf.user_code
        from rlhf.reward_batch import RewardBatch
        from rlhf.reward_functions import load_reward_function

        rlhf.user_code.GRACE_S = 0.5
        function = load_reward_function("stuck.py:stubborn")
        function.timeout = 0.5
        function(RewardBatch.of_texts(["p"], ["a"]))
        '''))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: --reward-fn stuck.py:stubborn: row 0 of the batch (prompt 'p'): no result after --reward-timeout 0.5 s")
    assert "did not stop when interrupted" in done.stderr


def test_sys_exit_at_import_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(UserError, match="importing .*exits.py failed: SystemExit"):
        load_reward_function(f"{path}:f")


# ------------------------------------------------------------------ rlhf ppo end to end


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    rows = [{"prompt": f"say {c}", "answer": c} for c in "abcdefghijklmnop"]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def grpo(model: Path, data: Path, spec: str, out: Path, *extra: str) -> list[str]:
    return ["ppo", "--actor", str(model), "--reward-fn", spec, "--data", str(data), "--output", str(out),
            "--advantage-estimator", "grpo", "--generation-batch-size", "8", "--samples-per-prompt", "4",
            "--max-new-tokens", "4", "--max-steps", "1", "--report-to", "none", "--optimizer-impl", "torch",
            "--micro-batch-size", "8", *extra]


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("name, shown", [("quits", "SystemExit(0)"), ("interrupts", "KeyboardInterrupt()")])
def test_ppo_with_a_function_that_exits_or_interrupts_fails_naming_it(tiny_model_dirs, prompts, functions, tmp_path,
                                                                       name: str, shown: str) -> None:
    out = tmp_path / "out"
    done = run_cli(grpo(tiny_model_dirs["llama"], prompts, f"{functions}:{name}", out))
    assert done.returncode == 2, done.stderr[-2000:]
    assert last_line(done).startswith(f"error: --reward-fn {functions}:{name}: row 0 of the batch (prompt 'say ")
    assert f"raised {shown}" in last_line(done) and "Traceback" not in done.stderr
    assert not (out / "DONE").exists()


def test_ppo_stops_on_a_real_sigint_during_a_reward_call(tiny_model_dirs, prompts, functions, tmp_path) -> None:
    marker = tmp_path / "scoring"
    args = grpo(tiny_model_dirs["llama"], prompts, f"{functions}:sigint_marker", tmp_path / "out", "--max-steps", "3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "REWARD_MARKER": str(marker)}
    process = subprocess.Popen([sys.executable, "-m", "rlhf", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 240
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), process.communicate(timeout=60)[1][-2000:]
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "--reward-fn" not in stderr.strip().splitlines()[-1]


def test_ppo_with_a_function_past_the_timeout_fails_in_one_line(tiny_model_dirs, prompts, functions, tmp_path) -> None:
    started = time.monotonic()
    done = run_cli(grpo(tiny_model_dirs["llama"], prompts, f"{functions}:sleeps", tmp_path / "out",
                        "--reward-timeout", "1"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert last_line(done).startswith(f"error: --reward-fn {functions}:sleeps: row 0 of the batch (prompt 'say ")
    assert "no result after --reward-timeout 1 s" in last_line(done) and "Traceback" not in done.stderr
    assert time.monotonic() - started < 55  # the function sleeps 60 s


def test_constant_reward_warns_once_after_max_zero_signal_iters(tiny_model_dirs, prompts, functions, tmp_path) -> None:
    out = tmp_path / "out"
    done = run_cli(grpo(tiny_model_dirs["llama"], prompts, f"{functions}:constant", out, "--max-steps", "4"))
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "every group's rewards tied" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert "iterations 1-3" in warnings[0] and "--samples-per-prompt 4" in warnings[0]
    assert [row["reward_tied_fraction"] for row in read_metrics(out)] == [1.0] * 4
    assert (out / "DONE").exists()


def test_dynamic_sampling_that_keeps_no_group_stops(tiny_model_dirs, prompts, functions, tmp_path) -> None:
    out = tmp_path / "out"
    done = run_cli(grpo(tiny_model_dirs["llama"], prompts, f"{functions}:constant", out, "--dynamic-sampling",
                        "--dynamic-sampling-rounds", "2"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert last_line(done).startswith("error: --dynamic-sampling: iteration 1 kept no group in 2 rounds (of 2 "
                                      "prompts x 4 samples each)")
    assert "scores 1)" in last_line(done)
    assert not (out / "DONE").exists()


# ------------------------------------------------------------------ W&B without its server


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_wandb_online_without_a_reachable_server_goes_offline(tiny_model_dirs, sft_data, tmp_path) -> None:
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_SILENT": "true"}
    started = time.monotonic()
    done = run_cli(["sft", "--model", str(tiny_model_dirs["llama"]), "--data", str(sft_data), "--output", str(out),
                    "--max-steps", "1", "--report-to", "wandb", "--wandb-init-timeout", "3",
                    "--optimizer-impl", "torch"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "W&B: no online run" in line]
    assert len(warnings) == 1 and "wandb sync" in warnings[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert list((out / "wandb").glob("offline-run-*")) and (out / "DONE").exists()
    assert time.monotonic() - started < 90  # W&B's own wait alone was 90 s
