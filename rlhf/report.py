"""`rlhf report`: environment versions, the build state of every csrc op and its self-test
verdict on every device it has been loaded on (engine/ops.py).

`rlhf report --build` first builds every op for this machine (into the op cache, for a container
image or before a job), one progress line per op, and exits non-zero when one fails.

`rlhf report RUN_DIR` prints a run's learning curve instead (rlhf/curves.py), without this module
or torch.
"""

from __future__ import annotations

import platform
import shutil

import click
import torch
import transformers

from rlhf.engine.backends.registry import backend_for  # importing it registers every csrc op (engine/ops.py)
from rlhf.engine.op_build import cuda_archs
from rlhf.engine.ops import load_op, op_report, registered_ops, unavailable_reason


def print_report() -> None:
    click.echo(f"python        {platform.python_version()}")
    click.echo(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    click.echo(f"transformers  {transformers.__version__}")
    click.echo(f"cuda device   {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    click.echo(f"nvcc          {shutil.which('nvcc') or 'not found'}")
    click.echo(f"c++ compiler  {shutil.which('c++') or 'not found'}")
    for label, text in backend_for(torch.device("cpu")).report_lines():
        click.echo(f"{label:<13} {text}")
    click.echo("ops:")
    for row in op_report():
        load_op(str(row["name"]))
    for row in op_report():
        state = "built" if row["built"] else f"not built ({row['error']})"
        if row["built"] and row["verdict"] is None:
            state = "built, self-test skipped (RLHF_OPS_SELFTEST=0)"
        elif row["verdict"] is not None and row["built"]:
            state = "built, self-test passed"
        elif row["verdict"] is not None:
            state = f"disabled: {row['error']}"
        kind = "cuda" if row["needs_cuda"] else "cpu"
        click.echo(f"  {row['name']:<28} {kind:<5} {state}")
        for verdict in row["cached_verdicts"]:
            outcome = "passed" if verdict.passed else "FAILED"
            click.echo(f"      self-test {outcome} on {verdict.device} (build {verdict.build}, {verdict.seconds:.3f} s): "
                       f"{verdict.detail}")


def build_ops() -> bool:
    """Build (or find in the cache) every op for this machine, one line each as it goes; False when
    one failed to build or failed its self-test. A CUDA op with no GPU here is skipped, unless
    TORCH_CUDA_ARCH_LIST names the GPUs to build it for (its self-test then waits for its first
    run on one)."""
    specs = registered_ops()
    ok = True
    for i, spec in enumerate(specs, 1):
        prefix = f"[{i}/{len(specs)}] {spec.name:<28}"
        reason = unavailable_reason(spec, ahead_of_time=True)
        if reason is not None:
            skip = spec.needs_cuda and reason == "no CUDA device"
            ok = ok and skip
            hint = "" if not skip else "; this torch is a CPU build" if torch.version.cuda is None else (
                "; set TORCH_CUDA_ARCH_LIST (e.g. 9.0) to build it for a GPU")
            click.echo(f"{prefix} {'skipped' if skip else 'FAILED'} ({reason}{hint})")
            continue
        click.echo(f"{prefix} building or loading...")
        load_op(spec.name, ahead_of_time=True)
        row = next(r for r in op_report() if r["name"] == spec.name)
        how = "found in the cache" if row["built_seconds"] is None else f"built in {row['built_seconds']:.1f} s"
        if not row["built"]:
            ok = False
            click.echo(f"{prefix} FAILED ({row['error']})")
        elif row["verdict"] is not None:
            click.echo(f"{prefix} {how}, self-test passed ({row['folder']})")
        elif spec.needs_cuda and not torch.cuda.is_available():
            click.echo(f"{prefix} {how} for CUDA archs {cuda_archs()}, self-test on first use on a GPU ({row['folder']})")
        else:
            click.echo(f"{prefix} {how}, self-test skipped (RLHF_OPS_SELFTEST=0) ({row['folder']})")
    return ok
