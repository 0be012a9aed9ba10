"""Export a trained model in Hugging Face format (config + model.safetensors + tokenizer).

Every tensor is checked before anything is written: no output model ever holds a NaN/inf.

The weights are written without gathering the model anywhere: a safetensors file is a JSON header
and then each tensor's bytes, row-major, so FSDP2's dim-0 shard of a tensor is one contiguous byte
range of the file. Rank 0 writes the config files and the header (and sizes the file); then every
rank writes its own shards in place (`os.pwrite`), and rank 0 publishes the folder atomically. A
model over MAX_FILE_BYTES is split into model-0000i-of-0000n.safetensors with
model.safetensors.index.json, as Hugging Face shards checkpoints. The tensors' names are those the
model's own `save_pretrained` writes (a Hugging Face model's state dict without tied duplicates, or
the model's `export_tensors()`, as ValueModel has); a model neither covers (a family whose
checkpoints transformers converts on save, remote code, a sharding other than dim 0) is gathered
on rank 0 and saved by its `save_pretrained`, as before.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PreTrainedModel

from rlhf.engine.distributed import DistributedContext
from rlhf.engine.fileio import honour_umask
from rlhf.engine.fsdp import local_shard
from rlhf.engine.adapters import adapter_state_dict, has_lora, merge_state_dict, merged_export_tensors
from rlhf.engine.train_engine import NonFiniteTrainingError, TrainEngine, first_non_finite
from rlhf.engine.write_errors import agreed_write
from rlhf.logging import get_logger

log = get_logger(__name__)

MAX_FILE_BYTES = 5 * 2**30
"""Largest weights file of an export (Hugging Face's former default shard size): a bigger model is
split into several files with an index."""
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _unwrapped_save(model: nn.Module, directory: Path, state_dict: dict[str, Any]) -> None:
    # FSDP2 swaps the module's class for an FSDP subclass; save_pretrained still works on it and
    # takes the consolidated state dict we pass instead of reading the sharded params.
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def export_model(engine: TrainEngine, directory: str | Path, tokenizer: Any | None,
                 max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write `engine`'s model to `directory` in Hugging Face format, atomically (collective call):
    every rank writes its own shards in place (see the module docstring); a model the in-place
    writer does not cover is gathered on rank 0 first."""
    directory = Path(directory)
    tensors = export_tensors(engine.model)
    if tensors is None:
        export_state_dict(engine.model, engine.ctx, full_export_state_dict(engine), directory, tokenizer)
        return
    ctx = engine.ctx
    check_finite_shards(ctx, tensors, directory)
    tmp = directory.with_name(directory.name + ".tmp")
    with exporting(ctx, tmp, directory):
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _unwrapped_save(engine.model, tmp, {})  # config files only: an empty state dict
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    if not all(ctx.all_gather_object(tmp.is_dir())):  # ranks on hosts that do not share the file system
        log.info("%s: not on a file system every rank sees; the model is gathered on rank 0 to be written", directory)
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        export_state_dict(engine.model, ctx, full_export_state_dict(engine), directory, tokenizer)
        return
    write_safetensors_in_place(ctx, tensors, tmp, max_file_bytes, export_to=directory)
    with exporting(ctx, tmp, directory):
        if ctx.is_main:
            _publish(tmp, directory)


def exporting(ctx: DistributedContext, tmp: Path, directory: Path) -> AbstractContextManager[None]:
    """A part of an export that ranks write on their own (no collective inside), ended by their
    agreement that it was written instead of a barrier: on a write error on any rank (a full
    disk), `tmp` is removed and every rank raises the same one line (engine/write_errors.py);
    `directory`, the previous model, is untouched."""
    return agreed_write(ctx, tmp, f"the model export to {directory}",
                        then="resume with --resume (from the last checkpoint) to export again")


def full_export_state_dict(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """The consolidated state dict an export writes (on rank 0; empty elsewhere): LoRA adapters
    merged into the plain model's weights."""
    state_dict = engine.full_state_dict()
    return merge_state_dict(engine.model, state_dict) if has_lora(engine.model) else state_dict


def export_adapter(engine: TrainEngine, directory: str | Path, tokenizer: Any | None,
                   write: Callable[[Path, dict[str, torch.Tensor]], None]) -> None:
    """Write only the LoRA adapters of `engine`'s model to `directory`, atomically (collective):
    `write(folder, adapter_tensors)` lays them out (peft's format, on rank 0); the tokenizer beside."""
    directory = Path(directory)
    state_dict = engine.full_state_dict()
    check_finite_state_dict(engine.ctx, state_dict, directory)
    tmp = directory.with_name(directory.name + ".tmp")
    with exporting(engine.ctx, tmp, directory):
        if engine.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write(tmp, adapter_state_dict(engine.model, state_dict, ("value_head",)))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _publish(tmp, directory)


def _tied_patterns(model: PreTrainedModel) -> list[str]:
    """The names (regexes) transformers treats as tied copies of another weight (`lm_head.weight`)."""
    tied = getattr(model, "_tied_weights_keys", None) or []
    return list(tied.keys()) if isinstance(tied, dict) else list(tied)


def _hf_export_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor] | None:
    """The state dict `PreTrainedModel.save_pretrained` writes (parameters and persistent buffers,
    without `_keys_to_ignore_on_save`, one name per tied weight: not the one transformers ties to
    another), as the model's own tensors; None when transformers would convert names on save."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4 converts nothing on save
        get_model_conversion_mapping = None
    remote_code = getattr(model, "is_remote_code", lambda: False)()
    if remote_code or getattr(model, "_hf_peft_config_loaded", False) or (
            get_model_conversion_mapping is not None and get_model_conversion_mapping(model, add_legacy=False)):
        return None
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tied = _tied_patterns(model)
    groups: dict[int, list[str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in ignored:
            groups.setdefault(id(tensor), []).append(name)
            tensors[name] = tensor
    for names in groups.values():
        keep = next((n for n in names if not any(re.search(p, n) for p in tied)), names[0])
        for name in names:
            if name != keep:
                del tensors[name]
    return tensors


def export_tensors(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """On-disk name -> this rank's parameter or buffer (DTensor or whole, not copied) of `model`, in
    the order written; None when the model must be gathered and saved by its `save_pretrained`."""
    own = getattr(model, "export_tensors", None)
    tensors = own() if callable(own) else _hf_export_tensors(model) if isinstance(model, PreTrainedModel) else None
    if tensors is None:
        return None
    if has_lora(model):  # the plain model, adapters merged (on the shards)
        tensors = merged_export_tensors(model, tensors)
    for tensor in tensors.values():
        placements = tensor.placements if isinstance(tensor, DTensor) else ()
        if tensor.dtype not in SAFETENSORS_DTYPES or any(
                not isinstance(p, Replicate) and p != Shard(0) for p in placements):
            return None
    return tensors


def check_finite_shards(ctx: DistributedContext, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Refuse, on every rank alike, tensors of which a local shard holds a NaN/inf (collective)."""
    local_bad = first_non_finite((name, local_shard(t)[0]) for name, t in tensors.items())
    bad = next((b for b in ctx.all_gather_object(local_bad) if b is not None), None)
    if bad is not None:
        raise NonFiniteTrainingError(
            f"{directory}: not written, the model's tensor {bad} holds NaN/inf (training diverged); "
            "train again with a lower --lr or with --grad-clip 1.0"
        )


def _split_files(tensors: dict[str, torch.Tensor], max_file_bytes: int) -> list[list[str]]:
    """Consecutive groups of tensor names of at most `max_file_bytes` (a bigger tensor alone)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _header(tensors: dict[str, torch.Tensor], names: list[str]) -> tuple[bytes, dict[str, int], int]:
    """A safetensors header for `names` (laid out in that order), each tensor's absolute offset in
    the file, and the file's size. The JSON is padded with spaces to 8 bytes, as safetensors does."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for name in names:
        tensor = tensors[name]
        end = begin + tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    offsets = {name: start + entries[name]["data_offsets"][0] for name in names}
    return len(text).to_bytes(8, "little") + text, offsets, start + begin


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_local_rows(fd: int, tensor: torch.Tensor, offset: int, is_main: bool) -> None:
    """This rank's dim-0 rows of `tensor` at their place in the file starting at `offset`. A tensor
    held whole by every rank (a replicated or plain one) is written by rank 0 alone."""
    local, index = local_shard(tensor)
    whole = local.numel() == tensor.numel()
    if local.numel() == 0 or (whole and not is_main):
        return
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    first_row = index[0].start if index else 0
    data = local.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
    _pwrite_all(fd, memoryview(data), offset + first_row * row_bytes)


def write_safetensors_in_place(ctx: DistributedContext, tensors: dict[str, torch.Tensor], directory: Path,
                               max_file_bytes: int = MAX_FILE_BYTES, export_to: Path | None = None) -> None:
    """Write `tensors` as safetensors file(s) in `directory` with every rank writing its own rows
    (collective; `directory` must be on a file system every rank sees, as for checkpoints). A
    write error on any rank removes `directory` and raises on every rank (`exporting`; the line
    names `export_to`, default `directory`)."""
    groups = _split_files(tensors, max_file_bytes)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    layouts = [_header(tensors, group) for group in groups]
    with exporting(ctx, directory, export_to or directory):
        if ctx.is_main:
            for name, (header, _, size) in zip(names, layouts):
                with open(directory / name, "wb") as f:
                    f.write(header)
                    f.truncate(size)
            if len(groups) > 1:
                weight_map = {t: name for name, group in zip(names, groups) for t in group}
                total = sum(t.numel() * t.element_size() for t in tensors.values())
                (directory / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    with exporting(ctx, directory, export_to or directory):
        for name, group, (_, offsets, _) in zip(names, groups, layouts):
            fd = os.open(directory / name, os.O_WRONLY)
            try:
                for tensor_name in group:
                    _write_local_rows(fd, tensors[tensor_name], offsets[tensor_name], ctx.is_main)
            finally:
                os.close(fd)


def _publish(tmp: Path, directory: Path) -> None:
    """Replace `directory` by the finished `tmp` (rank 0; a crash leaves the old one or the new one)."""
    honour_umask(tmp)  # safetensors (save_pretrained's writer) makes its files 0600, whatever the umask
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    log.info("model saved: %s", directory)


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
    tmp = directory.with_name(directory.name + ".tmp")
    with exporting(ctx, tmp, directory):
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _unwrapped_save(model, tmp, state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _publish(tmp, directory)
