"""`rlhf report`: environment versions, the build state of every csrc op and its self-test
verdict on every device it has been loaded on (engine/ops.py)."""

from __future__ import annotations

import importlib
import platform
import shutil

import click
import torch

# Modules that register csrc ops when imported.
_OP_MODULES = ("rlhf.engine.fused_adam", "rlhf.engine.kernels", "rlhf.engine.cpu_decode", "rlhf.engine.fused_layers")


def cpu_matmul_line() -> str:
    """What --cpu-matmul auto runs float32 CPU linears with here, and why (engine/cpu_matmul.py)."""
    from rlhf.engine.cpu_matmul import cpu_vendor, onednn_available, resolve_cpu_matmul

    library = {"onednn": "oneDNN, decode steps over packed weights",
               "aten": "torch's matmul (MKL)"}[resolve_cpu_matmul("auto")]
    return (f"--cpu-matmul auto: {library} (CPU vendor {cpu_vendor() or 'unknown'}, "
            f"oneDNN {'available' if onednn_available() else 'not in this torch'})")


def print_report() -> None:
    import transformers

    from rlhf.engine.ops import load_op, op_report

    click.echo(f"python        {platform.python_version()}")
    click.echo(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    click.echo(f"transformers  {transformers.__version__}")
    click.echo(f"cuda device   {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    click.echo(f"nvcc          {shutil.which('nvcc') or 'not found'}")
    click.echo(f"c++ compiler  {shutil.which('c++') or 'not found'}")
    click.echo(f"cpu matmul    {cpu_matmul_line()}")
    for name in _OP_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
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
