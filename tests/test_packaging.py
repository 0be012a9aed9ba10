"""The package as a user installs it: a wheel (not editable) in a fresh venv builds and runs its ops.

The wheel must carry csrc/ (package data at rlhf/csrc): without it every op would fall back to
its PyTorch reference. The venv (--system-site-packages, for torch and transformers) runs
`rlhf report` and a few SFT steps from outside the checkout; every CPU op must be built and pass
its self-test, none fall back. The venv's sources equal the checkout's, so their builds share the
op cache's key: the checkout builds them first (or finds them built), and the venv's processes
must not build again. About 30 s with the ops in the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf.engine.backends.registry  # noqa: F401  (registers every backend's ops with their self-tests)
from rlhf.engine import ops
from rlhf.engine.backends.cpu.decode_op import CPU_DECODE_OP
from rlhf.engine.backends.cpu.layer_op import FUSED_LAYERS_OP
from rlhf.engine.fileio import file_mode
from rlhf.engine.fused_adam import CPU_OP
from tests.conftest import REPO, addition_rows, train_losses, write_jsonl

CPU_OPS = (CPU_OP, CPU_DECODE_OP.name, FUSED_LAYERS_OP.name)
PACKAGE_DIRS = ("rlhf", "engine", "stages", "csrc")
"""What pyproject.toml packages (with pyproject.toml and README.md, the wheel's metadata)."""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of this working tree installed (no -e), its python's path."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip wheel --no-build-isolation needs setuptools here: pip install setuptools")
    root = tmp_path_factory.mktemp("wheel")
    # A copy of what the wheel is built from: setuptools' build/ and egg-info stay out of the checkout.
    for name in PACKAGE_DIRS:
        shutil.copytree(REPO / name, root / "src" / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / "src" / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
          str(root / "src")], cwd=root)
    (wheel,) = (root / "dist").glob("rlhf-*.whl")
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")], cwd=root)
    python = root / "venv" / "bin" / "python"
    # The system's pip, run by the venv's python, installs into the venv.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=root)
    return python


def test_the_wheel_carries_every_op_source(venv: Path) -> None:
    located = _run([str(venv), "-c", "import rlhf, rlhf.engine.op_build as b; print(rlhf.__file__); print(b.CSRC_DIR)"],
                   cwd=venv.parent).stdout.split()
    package, csrc = Path(located[0]).parent, Path(located[1])
    assert package.is_relative_to(venv.parent.parent) and csrc == package / "csrc"  # the wheel's, not the checkout's
    importlib.import_module("rlhf.engine.backends.registry")  # registers every csrc op
    for spec in ops.registered_ops():
        from rlhf.engine.op_build import source_files

        for rel in source_files(spec):
            assert (csrc / rel).is_file(), f"{rel} of {spec.name} is not in the wheel"


def test_an_installed_wheel_builds_its_ops_and_trains_with_them(venv: Path, tmp_path: Path) -> None:
    if ops.unavailable_reason(ops._OPS[CPU_OP].spec) is not None:
        pytest.skip(f"ops cannot be built here: {ops.unavailable_reason(ops._OPS[CPU_OP].spec)}")
    for name in CPU_OPS:  # in the checkout first: built once here (or found), then shared
        assert ops.load_op(name) is not None, ops._OPS[name].error
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLHF_DISABLE_OPS", "RLHF_OPS_SELFTEST")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline")

    report = _run([str(venv), "-m", "rlhf", "report"], cwd=tmp_path, env=env)
    for name in CPU_OPS:
        line = next(li for li in report.stdout.splitlines() if li.strip().startswith(name))
        assert "built, self-test passed" in line, report.stdout
    assert "building op" not in report.stderr, report.stderr  # the checkout's builds were reused

    from rlhf.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "base", "llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    data = write_jsonl(tmp_path / "sft.jsonl", addition_rows(16))
    sft = _run([str(venv), "-m", "rlhf", "sft", "--model", str(model), "--data", str(data), "--output",
                str(tmp_path / "out"), "--max-steps", "2", "--micro-batch-size", "4", "--dtype", "fp32",
                "--optimizer-impl", "fused", "--report-to", "none"], cwd=tmp_path, env=env)
    assert "PyTorch reference" not in sft.stderr and "not built" not in sft.stderr, sft.stderr[-3000:]
    assert "building op" not in sft.stderr, sft.stderr[-3000:]
    out = tmp_path / "out"
    assert len(train_losses(out)) == 2 and (out / "DONE").is_file()
    for path in (out / "model" / "model.safetensors", out / "summary.json", out / "config.yaml", out / "metrics.jsonl"):
        assert stat.S_IMODE(path.stat().st_mode) == file_mode(), f"{path}: {oct(path.stat().st_mode)}"
