"""scripts/gpu_check.sh, the GPU machine's one command, dry-run on the CPU: every step's plumbing at
tiny sizes (GPU_CHECK_DRY=1), its summary.json parsed, in a network namespace without a network
where this machine allows one; and read statically: every command under `timeout`, nothing that
needs the network."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from numbers import Number
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ["install", "versions", "device", "ops", "pytest_gpu", "bench_adam", "gen_b1", "gen_b64", "gen_b1_graph",
         "gen_b64_graph", "ppo_1b", "e2e"]
OPT_IN = ["sanitizer", "suite"]
PHASES = ["generation", "reward", "experience", "training"]
LAUNCHERS = ('"$PY0"', '"${PY[@]}"', '"${RLHF[@]}"')


def _offline_prefix() -> list[str]:
    """`unshare -rn` (a user and network namespace: loopback only, brought up for gloo) where this
    machine permits it, else nothing (the static checks below still hold)."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return []
    wrapper = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, timeout=30)
    return wrapper if probe.returncode == 0 else []


def _run(tmp_path: Path, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out = tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    environ.update(GPU_CHECK_DRY="1", OUT=str(out), TMPDIR=str(tmp_path), PYTHON=sys.executable, **env)
    proc = subprocess.run([*_offline_prefix(), "bash", str(SCRIPT)], cwd=REPO, env=environ, capture_output=True,
                          text=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    return _run(tmp_path_factory.mktemp("gpu_check"), timeout=240)


def _numbers(figures: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(figures.get(key), Number) and not isinstance(figures[key], bool), (key, figures.get(key))


def test_dry_run_runs_every_step_and_writes_its_figures(dry_run):
    proc, summary, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["state"] == "finished" and summary["dry_run"] is True and summary["device"] == "cpu"
    assert list(summary["steps"]) == STEPS + OPT_IN
    steps = summary["steps"]
    for name in STEPS:
        assert steps[name]["status"] == "ok", (name, steps[name])
        assert isinstance(steps[name]["seconds"], float) and isinstance(steps[name]["figures"], dict), name
    for name in OPT_IN:
        assert steps[name] == {"status": "skipped", "seconds": 0.0, "rc": None, "reason": "not selected"}
    # The few files $OUT may hold (a device machine returns 8 at most): work files stay outside it.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json"]
    log = (out / "gpu_check.log").read_text()
    assert all(f"======== {name}: ok" in log for name in STEPS)

    fig = {name: steps[name]["figures"] for name in STEPS}
    assert summary["versions"] == fig["versions"]
    assert all(isinstance(fig["versions"][k], str) and fig["versions"][k] for k in ("python", "torch", "transformers"))
    assert fig["versions"]["gpu"] is None and fig["install"]["installed"] is False
    _numbers(fig["device"], "copy_gbs", "matmul_tflops", "matmul_ms")
    assert fig["device"]["copy_gbs"] > 0 and fig["device"]["matmul_ms"] > 0

    ops = fig["ops"]
    assert fig["ops"]["failed"] == [] and {"fused_adam_cpu", "fused_adam_cuda"} <= set(ops["ops"])
    for name, row in ops["ops"].items():
        if row["available"]:  # an op that builds here is built and passed its self-test against its reference
            assert row["built"] and row["self_test"] == "passed", (name, row)
        else:
            assert row["error"], name
    assert ops["ops"]["fused_adam_cuda"]["available"] is False

    pytest_gpu = fig["pytest_gpu"]  # collected, then skipped without CUDA
    assert pytest_gpu["complete"] and pytest_gpu["skipped"] > 0
    assert pytest_gpu["passed"] == pytest_gpu["failed"] == pytest_gpu["errors"] == 0

    _numbers(fig["bench_adam"], "ours_ms", "torch_fused_ms", "vs_torch_fused")
    for name, batch, graph in (("gen_b1", 1, False), ("gen_b64", 64, False), ("gen_b1_graph", 1, True),
                               ("gen_b64_graph", 64, True)):
        _numbers(fig[name], "ours_tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf")
        assert fig[name]["bench"] == "generation" and fig[name]["batch"] == batch and fig[name]["cuda_graph"] is graph

    ppo = fig["ppo_1b"]
    assert ppo["iterations"] == 2 and ppo["plan_device"] == "cpu"
    for figures in (ppo["phase_s"], ppo["peak_mem_gb"], ppo["plan_gb"], ppo["measured_over_plan"]):
        _numbers(figures, *PHASES)
    _numbers(ppo, "old_logprob_diff_max", "rollout_parity_max_diff", "plan_peak_gb", "samples_per_s")

    e2e = fig["e2e"]
    assert e2e["ppo_iterations"] == 2
    _numbers(e2e, "rm_eval_accuracy", "sft_task_success", "ppo_task_success", "total_seconds", "old_logprob_diff_max")


def test_steps_past_the_deadline_are_skipped_and_summarised(tmp_path):
    proc, summary, _ = _run(tmp_path, timeout=60, GPU_CHECK_DEADLINE_S="0", GPU_CHECK_STEPS="versions e2e")
    assert proc.returncode == 0, proc.stderr[-2000:]
    past = ("install", "versions", "e2e")
    expected = {name: "deadline" if name in past else "not selected" for name in STEPS + OPT_IN}
    assert {name: step.get("reason") for name, step in summary["steps"].items()} == expected
    assert all(step["status"] == "skipped" for step in summary["steps"].values())


def _shell_commands() -> list[str]:
    """The script's shell lines, continuation lines joined, without its heredocs' Python and its comments."""
    lines, heredoc = [], None
    for line in SCRIPT.read_text().splitlines():
        if heredoc is not None:
            heredoc = None if line == heredoc else heredoc
            continue
        opened = re.search(r"<<'(\w+)'", line)
        heredoc = opened.group(1) if opened else None
        line = re.sub(r"\s+# .*$", "", line)  # a trailing comment
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + line.strip()
        elif not line.lstrip().startswith("#"):
            lines.append(line.strip())
    return lines


def test_every_command_of_every_step_runs_under_timeout():
    text = SCRIPT.read_text()
    commands = _shell_commands()
    for name in STEPS + OPT_IN:
        assert re.search(rf"^step_{name}\(\) \{{", text, re.M), name
        assert f"run_step {name} " in text, name
    runs = re.compile(r'"\$\{(PY|RLHF)\[@\]\}"|"\$PY0"|\bnvidia-smi\b|\bcompute-sanitizer\b|\bpip\b')
    # Of the quoted words only "$PY0", "${PY[@]}" and "${RLHF[@]}" run something ("no compute-sanitizer" does not).
    def unquoted(command: str) -> str:
        return re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: m[0] if m[0] in LAUNCHERS else '""', command)

    launched = [c for c in commands if runs.search(unquoted(c))
                and not re.match(r"^(PY|RLHF)=\(", c) and "command -v" not in c]
    assert len(launched) > 20
    for command in launched:
        assert re.search(r"\btimeout( -k \d+)? (\d+|\"\$\(left\)\"|\$\(\(.*\)\))", command), command


def test_the_script_needs_no_network():
    text = SCRIPT.read_text()
    for offline in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "WANDB_MODE=disabled", "PIP_NO_INDEX=1"):
        assert re.search(rf"^export .*\b{offline}\b", text, re.M), offline
    assert not re.search(r"\b(curl|wget|git clone|git fetch|pip download|huggingface-cli|hf download)\b", text)
    for command in _shell_commands():
        if re.search(r"\bpip install\b", command):
            assert "--no-index" in command and "--no-deps" in command, command
    # No tracker: W&B is off (WANDB_MODE=disabled) and each stage is told so.
    commands = _shell_commands()
    assert re.search(r"flags=\(--actor[^)]*--report-to none", text)
    assert all("--report-to none" in c for c in commands if '"${RLHF[@]}" e2e' in c)
