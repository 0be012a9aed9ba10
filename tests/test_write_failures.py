"""A write that fails during a checkpoint or the export (a full disk): one `error:` line naming the
folder and the errno, exit code 2, no partial `*.tmp` left, the previous checkpoint intact, and
`--resume` finishes the run as the uninterrupted one does.

On a real small tmpfs where the test can mount one (root; skipped otherwise), and with one rank of
a 2-rank job writing to /dev/full (tests/write_failure_worker.py), through the `--nproc-per-node`
launcher (`run_torchrun`).
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from rlhf.cli import main
from rlhf.engine import write_errors
from rlhf.engine.checkpoint import checkpoint_step, is_complete
from rlhf.engine.distributed import DistributedContext
from rlhf.engine.write_errors import WriteFailed, agreed_write, write_error
from tests.conftest import REPO, read_metrics, run_cli, train_losses

ARGS = ["--max-steps", "6", "--lr", "3e-3", "--report-to", "none", "--optimizer-impl", "torch",
        "--lr-scheduler", "constant", "--dtype", "fp32", "--micro-batch-size", "8", "--save-interval", "2",
        "--keep-checkpoints", "3"]


def sft_args(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--output", str(output), *ARGS, *extra]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def leftovers(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*.tmp"))


def test_write_errors_are_named_by_errno_and_bugs_are_not(tmp_path, monkeypatch):
    target = tmp_path / "step_00000004.tmp" / "__0_0.distcp"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    line = f"ENOSPC (No space left on device) on rank 0 writing {target}"
    assert write_error(full, tmp_path, 0) == (errno.ENOSPC, line)
    # DCP collects every rank's failure into one CheckpointException (a BaseException) on every rank.
    collected = CheckpointException("write", {1: (full, None)})
    assert write_error(collected, tmp_path, 0) == (errno.ENOSPC, line.replace("rank 0", "rank 1"))
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert write_error(RuntimeError("write failed"), tmp_path, 3) is None
    try:
        raise RuntimeError("wrapped") from quota
    except RuntimeError as exc:
        assert write_error(exc, tmp_path, 3) == (errno.EDQUOT, "EDQUOT (Disk quota exceeded) on rank 3")
    # torch's own writer reports no errno; a full file system names it.
    torn = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert write_error(torn, tmp_path, 0) is None
    monkeypatch.setattr(write_errors, "_is_full", lambda folder: True)
    assert write_error(torn, tmp_path, 0) == (errno.ENOSPC, "ENOSPC (No space left on device) on rank 0")
    assert write_error(ValueError("a bug"), tmp_path, 0) is None


def test_a_failed_write_removes_its_folder_and_raises_one_line(tmp_path):
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    folder = tmp_path / "model.tmp"
    with pytest.raises(WriteFailed) as exc:
        with agreed_write(ctx, folder, "the model export to model", then="resume with --resume"):
            folder.mkdir()
            (folder / "config.json").write_text("{}")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.safetensors"))
    assert not folder.exists()
    assert str(exc.value) == (f"the model export to model not written: ENOSPC (No space left on device) on rank 0 "
                              f"writing {folder / 'model.safetensors'}; the partial {folder} is removed; free some "
                              "space there, then resume with --resume")
    with pytest.raises(ValueError):  # not a write error: a bug, raised as it is
        with agreed_write(ctx, folder, "x"):
            raise ValueError("a bug")


def disk_bytes(folder: Path) -> int:
    """What the files under `folder` take on a tmpfs (whole pages)."""
    return sum(math.ceil(p.stat().st_size / 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs at tmp_path/mnt of the size the test asks for (skipped where mount fails)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / "mnt"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True)


def test_a_full_tmpfs_during_a_checkpoint_keeps_the_previous_one(tiny_model_dirs, sft_data, tmp_path, small_tmpfs,
                                                                 capsys, one_thread):
    model = tiny_model_dirs["llama"]
    reference = tmp_path / "reference"
    main(sft_args(model, sft_data, reference))
    checkpoint = disk_bytes(reference / "checkpoints" / "step_00000002")
    # Room for the run's small files and one checkpoint, but not for a second one.
    mnt = small_tmpfs(64 * 1024 + checkpoint + checkpoint // 2)
    run = mnt / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(sft_args(model, sft_data, run))
    assert exc.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: checkpoint step_00000004 not written: ENOSPC (No space left on device) on "
                               "rank 0"), lines[0]
    assert str(run / "checkpoints") in lines[0] and "is intact" in lines[0], lines[0]
    assert leftovers(run) == []
    assert [checkpoint_step(p) for p in (run / "checkpoints").glob("step_*")] == [2]
    assert is_complete(run / "checkpoints" / "step_00000002")
    # The previous checkpoint loads: the resumed run (moved to a disk with room) is the uninterrupted one.
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    main([*sft_args(model, sft_data, moved), "--resume"])
    assert [r["step"] for r in read_metrics(moved)] == [1, 2, 3, 4, 5, 6]
    assert train_losses(moved) == train_losses(reference)
    x, y = load_file(reference / "model" / "model.safetensors"), load_file(moved / "model" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x)


def launch_with_full_disk(args: list[str], full: str) -> subprocess.CompletedProcess:
    """`rlhf ARGS --nproc-per-node 2` (the launcher's code) with rank 1 writing FULL's files to /dev/full."""
    launcher = "import sys; from rlhf.cli import run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_FORCE_CPU": "1", "RLHF_TEST_FULL": f"1:{full}"}
    cmd = [sys.executable, "-c", launcher, "--standalone", "--nproc-per-node=2", "-m", "tests.write_failure_worker",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


@pytest.mark.slow
def test_a_full_disk_on_one_rank_during_a_checkpoint_and_the_export(tiny_model_dirs, sft_data, tmp_path):
    model = tiny_model_dirs["llama"]
    run = tmp_path / "run"
    failed = launch_with_full_disk(sft_args(model, sft_data, run), "step_00000004.tmp")
    assert failed.returncode == 2, failed.stderr[-3000:]
    lines = error_lines(failed.stderr)
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert lines[0].startswith("error: checkpoint step_00000004 not written: ENOSPC (No space left on device) on "
                               "rank 1"), lines[0]
    assert leftovers(run) == [] and is_complete(run / "checkpoints" / "step_00000002")
    assert [checkpoint_step(p) for p in (run / "checkpoints").glob("step_*")] == [2]

    # Resumed from step 2; the export's weights fail on rank 1: no model, no model.tmp, no DONE.
    export = launch_with_full_disk([*sft_args(model, sft_data, run), "--resume", "--save-final-checkpoint"],
                                   "model.tmp")
    assert export.returncode == 2, export.stderr[-3000:]
    lines = error_lines(export.stderr)
    assert len(lines) == 1 and "Traceback" not in export.stderr, export.stderr[-3000:]
    assert lines[0].startswith(f"error: the model export to {run / 'model'} not written: ENOSPC (No space left on "
                               "device) on rank 1"), lines[0]
    assert leftovers(run) == [] and not (run / "model").exists() and not (run / "DONE").exists()
    assert is_complete(run / "checkpoints" / "step_00000006")

    done = run_cli([*sft_args(model, sft_data, run), "--resume", "--save-final-checkpoint"], nproc=2,
                   env={"RLHF_FORCE_CPU": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert (run / "DONE").is_file() and (run / "model" / "model.safetensors").is_file()
