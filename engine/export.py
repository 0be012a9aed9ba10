"""Export a trained model in Hugging Face format (config + model.safetensors + tokenizer).

Every tensor is checked before anything is written: no output model ever holds a NaN/inf."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.train_engine import NonFiniteTrainingError, TrainEngine, first_non_finite
from rlhf.logging import get_logger

log = get_logger(__name__)


def _unwrapped_save(model: nn.Module, directory: Path, state_dict: dict[str, Any]) -> None:
    # FSDP2 swaps the module's class for an FSDP subclass; save_pretrained still works on it and
    # takes the consolidated state dict we pass instead of reading the sharded params.
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def export_model(engine: TrainEngine, directory: str | Path, tokenizer: Any | None) -> None:
    """Consolidate `engine`'s model and write it to `directory` atomically (collective call)."""
    directory = Path(directory)
    state_dict = engine.full_state_dict()
    export_state_dict(engine.model, engine.ctx, state_dict, directory, tokenizer)


def check_finite_state_dict(ctx: DistributedContext, state_dict: dict[str, Any], directory: Path) -> None:
    """Refuse, on every rank alike, a state dict (full on rank 0) holding a NaN/inf (collective)."""
    bad = ctx.broadcast_object(first_non_finite(state_dict.items()) if ctx.is_main else None)
    if bad is not None:
        raise NonFiniteTrainingError(
            f"{directory}: not written, the model's tensor {bad} holds NaN/inf (training diverged); "
            "train again with a lower --lr or with --grad-clip 1.0"
        )


def export_state_dict(
    model: nn.Module, ctx: DistributedContext, state_dict: dict[str, Any], directory: Path, tokenizer: Any | None
) -> None:
    """Rank 0 writes `state_dict` with `model`'s config into `directory` (replacing it atomically),
    once every tensor of it is known to be finite."""
    check_finite_state_dict(ctx, state_dict, directory)
    if ctx.is_main:
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _unwrapped_save(model, tmp, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
        log.info("model saved: %s", directory)
    ctx.barrier()
