"""`rlhf report`: environment versions and the build state of every csrc op."""

from __future__ import annotations

import importlib
import platform
import shutil

import click
import torch

# Modules that register csrc ops when imported.
_OP_MODULES = ("rlhf.engine.fused_adam", "rlhf.engine.kernels", "rlhf.engine.cpu_decode")


def print_report() -> None:
    import transformers

    from rlhf.engine.ops import load_op, op_report

    click.echo(f"python        {platform.python_version()}")
    click.echo(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    click.echo(f"transformers  {transformers.__version__}")
    click.echo(f"cuda device   {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    click.echo(f"nvcc          {shutil.which('nvcc') or 'not found'}")
    click.echo(f"c++ compiler  {shutil.which('c++') or 'not found'}")
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
        kind = "cuda" if row["needs_cuda"] else "cpu"
        click.echo(f"  {row['name']:<28} {kind:<5} {state}")
