"""Meta-device construction and sharded loading: no rank ever holds the whole model at load time.

    model, weights = deferred_causal_lm("runs/sft/model", "--actor")   # rlhf.models.loading
    engine = TrainEngine(model, config, ctx, total_steps, weights=weights)

The model is built with its parameters on the meta device (no memory) and its buffers real (RoPE's
`inv_freq` is computed in `__init__` and is in no checkpoint). `apply_fsdp` shards the meta model,
allocates this rank's shards (`to_empty`, buffers kept) and calls `weights.load_local_shards(model)`,
which reads only this rank's rows of each tensor from the folder's safetensors files: FSDP2's dim-0
chunk (the whole tensor under ZeRO-0's replicated mesh), a contiguous byte range of the file, read
with plain file reads straight into the shard when the dtypes agree. (safetensors' own
`get_slice(key)[lo:hi]` serves slices from a private mmap of the whole file, whose touched pages
count towards the process's RSS until the file is closed: as much again as the shard, transiently.)

Everything a full load would check is checked here before any engine starts, from the files'
headers alone (`safe_open` validates them): a checkpoint tensor the model lacks, a model parameter
the checkpoint lacks (tied parameters need one of their names), a shape that disagrees with
config.json, a truncated file.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, ClassVar

import torch
from safetensors import safe_open
from torch import Tensor, nn

from rlhf.engine.fsdp import local_shard
from rlhf.errors import UserError
from rlhf.logging import get_logger
from rlhf.models.checks import check_finite

log = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device at once; buffers stay real.

    accelerate's `init_empty_weights(include_buffers=False)`: a parameter moves before its module's
    `reset_parameters` runs, so initialisers touch no memory and draw no random numbers, while
    non-persistent buffers (rotary `inv_freq`) are computed as usual."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        param = module._parameters.get(name)
        if param is not None and not param.is_meta:
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""Header dtype names read with plain file reads; any other (fp8...) is read through safe_open."""
CHUNK_BYTES = 4 * 2**20
"""Largest staging buffer of a read that converts dtypes or targets a GPU (a bf16 checkpoint into
fp32 master weights); a CPU target of the checkpoint's dtype is read into directly, with none."""


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a safetensors checkpoint: its file, key, header shape and dtype, and where its
    bytes start in the file (row-major: row r of dim 0 is a contiguous run)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


def _weight_files(folder: Path, where: str) -> list[Path] | None:
    """The safetensors files of `folder` (by its index when sharded), or None when it has none."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{where}: {INDEX_FILE} is not a valid index ({type(exc).__name__}: {exc}); "
                            "copy or export the model folder again") from None
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise UserError(f"{where}: {INDEX_FILE} names {missing[0]}, which is not in the folder; copy or "
                            "export the model folder again")
        return [folder / name for name in names]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    return None


def _data_offsets(path: Path) -> tuple[int, dict[str, int]]:
    """Where the data of `path` starts and each tensor's first byte relative to it, from the header
    (8 bytes of little-endian length, then JSON; the safetensors format, already validated)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return 8 + length, {key: int(entry["data_offsets"][0]) for key, entry in header.items() if key != "__metadata__"}


def read_checkpoint(folder: Path, where: str) -> dict[str, CheckpointTensor] | None:
    """Every tensor of `folder`'s safetensors checkpoint, from the headers only (no data is read);
    None when the folder has no safetensors weights. A truncated or corrupt file raises
    safetensors' SafetensorError (the callers name the file)."""
    files = _weight_files(folder, where)
    if files is None:
        return None
    tensors: dict[str, CheckpointTensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:  # validates the header against the file size
            start, offsets = _data_offsets(path)
            for key in handle.keys():
                view = handle.get_slice(key)
                tensors[key] = CheckpointTensor(path, key, tuple(view.get_shape()), view.get_dtype(),
                                                start + offsets[key])
    return tensors


def local_checkpoint(folder: Path, where: str) -> dict[str, CheckpointTensor] | None:
    """`read_checkpoint` of a local model folder; None (with one info line saying that every rank
    loads the whole model) for a hub name or a folder without safetensors weights."""
    checkpoint = read_checkpoint(folder, where) if folder.is_dir() else None
    if checkpoint is None:
        reason = "has no safetensors weights" if folder.is_dir() else "is not a local folder"
        log.info("%s %s: every rank loads the whole model before sharding", where, reason)
    return checkpoint


def renamed_by_transformers(model: nn.Module, checkpoint: Mapping[str, CheckpointTensor]) -> bool:
    """Whether `from_pretrained` would rename or convert this checkpoint's tensors for `model` (a
    family with a conversion mapping, e.g. MoE experts fused on load, or legacy LayerNorm.gamma
    names): such a checkpoint is loaded in full, since its tensors are not the parameters row by row."""
    try:  # transformers 5's module (probed here, where it is needed); 4.x has none
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    except ImportError:  # transformers 4: no conversions beyond the legacy names checked below
        get_model_conversion_mapping = get_checkpoint_conversion_mapping = None
    if get_model_conversion_mapping is not None and get_model_conversion_mapping(model, add_legacy=False):
        log.info("%s: transformers converts this family's checkpoints on load: loaded in full",
                 type(model).__name__)
        return True
    legacy = (get_checkpoint_conversion_mapping("legacy") if get_checkpoint_conversion_mapping else None) or []
    patterns = [p for t in legacy for p in getattr(t, "source_patterns", [])] or [r"\.gamma$", r"\.beta$"]
    renamed = next((key for key in checkpoint for p in patterns if re.search(p, key)), None)
    if renamed is not None:
        log.info("%s: tensor %s has a legacy name transformers renames on load: loaded in full", type(model).__name__,
                 renamed)
    return renamed is not None


def _read_exactly(f: BinaryIO, start: int, out: Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `f` from `start` on."""
    view = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
    f.seek(start)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise UserError(f"{f.name}: ends before its tensors do (truncated); copy or export the model folder again")
        done += n


def read_rows(stored: CheckpointTensor, rows: slice, out: Tensor) -> None:
    """Rows `rows` of dim 0 of `stored` into `out` (same shape, any dtype and device) with plain
    file reads: the file is never mapped into this process (its pages stay in the page cache, out
    of the RSS), and a contiguous CPU `out` of the checkpoint's dtype is read into directly."""
    dtype = SAFETENSORS_DTYPES[stored.dtype]
    row_elements = math.prod(stored.shape[1:])
    row_bytes = row_elements * dtype.itemsize
    with open(stored.file, "rb", buffering=0) as f:
        if out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous():
            _read_exactly(f, stored.offset + rows.start * row_bytes, out)
            return
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for lo in range(rows.start, rows.stop, step):
            hi = min(lo + step, rows.stop)
            buffer = torch.empty((hi - lo, *stored.shape[1:]), dtype=dtype)
            _read_exactly(f, stored.offset + lo * row_bytes, buffer)
            out[lo - rows.start:hi - rows.start].copy_(buffer)


def read_part(stored: CheckpointTensor, index: tuple[slice, ...], out: Tensor) -> None:
    """The part `index` of `stored` into `out`: whole rows by `read_rows`; anything else (a 0-d
    tensor, a slice of other dims, an unusual dtype) through safetensors' own slicing."""
    whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(index[1:], stored.shape[1:]))
    if index and whole_rows and stored.dtype in SAFETENSORS_DTYPES:
        read_rows(stored, index[0], out)
        return
    with safe_open(str(stored.file), framework="pt") as handle:  # its mmap is closed with it
        out.copy_(handle.get_slice(stored.key)[index] if index else handle.get_tensor(stored.key))


@dataclass
class SafetensorsShardLoader:
    """Fills the local shards of a model built on meta from a safetensors folder (the engine's
    `ShardLoader`): each parameter reads only this rank's rows of its checkpoint tensor."""

    folder: Path
    sources: dict[str, CheckpointTensor]
    """Parameter name (as `named_parameters()` gives it) -> its checkpoint tensor."""
    fills: dict[str, Tensor] = field(default_factory=dict)
    """Parameter name -> its full value, for parameters no checkpoint holds (a new value head)."""
    where: str = ""
    """The flag and folder errors name ("--actor runs/sft/model"); the folder when empty."""
    checks_finite: ClassVar[bool] = True
    """`load_local_shards` refuses a NaN/inf in what it reads (`fills` are the caller's own finite
    values), so the engine does not scan the weights a second time."""

    @torch.no_grad()
    def load_local_shards(self, model: nn.Module) -> None:
        """Read each parameter's local shard; a NaN or an infinity in what was read is one UserError
        naming the tensor (checked as read: the weights are never read twice)."""
        loaded = 0
        read: list[tuple[str, Tensor]] = []
        for name, param in model.named_parameters():
            local, index = local_shard(param)
            if local.numel() == 0:
                continue  # an empty last chunk (a dim 0 shorter than the world)
            if name in self.fills:
                local.copy_(self.fills[name][index])
            elif name in self.sources:
                read_part(self.sources[name], index, local)
                read.append((f"{self.sources[name].key} ({self.sources[name].file.name})", local))
            else:  # a module added or renamed after planning (an adapter wrapper): plan after it
                raise RuntimeError(f"{self.folder}: parameter {name} was not in the loading plan; the model changed "
                                   "after plan_shard_loading")
            loaded += local.numel() * local.element_size()
        check_finite(read, self.where or str(self.folder))
        log.info("%s: loaded this rank's shards only (%.1f MB)", self.folder, loaded / 2**20)


def _ignored(key: str, patterns: tuple[str, ...]) -> bool:
    return any(re.search(pattern, key) for pattern in patterns)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _check_shape(stored: CheckpointTensor, shape: tuple[int, ...], where: str) -> None:
    if stored.shape != shape:
        raise UserError(f"{where}: tensor {stored.key} has shape {list(stored.shape)} in {stored.file.name} but the "
                        f"model built from config.json needs {list(shape)}; restore the config.json the weights "
                        "were saved with")


def _load_persistent_buffers(model: nn.Module, checkpoint: Mapping[str, CheckpointTensor], where: str,
                             candidates: Callable[[str], list[str]]) -> set[str]:
    """Read the persistent buffers the checkpoint holds into the (real, small) buffers now, as
    `from_pretrained` loads them; one it lacks keeps its built value. Returns the keys read."""
    read: set[str] = set()
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module._buffers.items():
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            key = next((k for k in candidates(name) if k in checkpoint), None)
            if key is not None:
                _check_shape(checkpoint[key], tuple(buffer.shape), where)
                read_part(checkpoint[key], tuple(slice(0, n) for n in buffer.shape), buffer)
                read.add(key)
    return read


def plan_shard_loading(
    model: nn.Module,
    checkpoint: Mapping[str, CheckpointTensor],
    folder: Path,
    where: str,
    candidates: Callable[[str], list[str]],
    ignored: tuple[str, ...] = (),
    fills: Mapping[str, Tensor] | None = None,
) -> SafetensorsShardLoader:
    """Match every parameter of `model` (on meta) with its checkpoint tensor and check them.

    `candidates(name)` lists the checkpoint keys a parameter name may be stored under, best first;
    a parameter shared under several names (tied embeddings) needs one of them. Checkpoint keys
    matching an `ignored` regex are left unused (logged); any other key no parameter (or persistent
    buffer) claims, any parameter without a key (and not in `fills`), and any shape that differs is
    a UserError naming the folder and the tensor (`where`: the flag and folder), as a full load
    fails on them."""
    fills = dict(fills or {})
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    sources: dict[str, CheckpointTensor] = {}
    claimed = _load_persistent_buffers(model, checkpoint, where, candidates)
    missing: list[str] = []
    for pid, names in names_of.items():
        keys = [key for name in names for key in candidates(name) if key in checkpoint]
        claimed.update(keys)
        if names[0] in fills:
            continue
        if not keys:
            missing.append(names[0])
            continue
        _check_shape(checkpoint[keys[0]], tuple(params[pid].shape), where)
        sources[names[0]] = checkpoint[keys[0]]
    if missing:
        raise UserError(f"{where}: {len(missing)} weight(s) missing from the checkpoint: {_shown(missing)}; "
                        "copy or export the model folder again")
    unused = sorted(key for key in checkpoint if key not in claimed)
    unexpected = [key for key in unused if not _ignored(key, ignored)]
    if unexpected:
        raise UserError(f"{where}: {len(unexpected)} checkpoint tensor(s) the model built from config.json "
                        f"has no parameter for: {_shown(unexpected)}; restore the config.json the weights were "
                        "saved with")
    if unused:
        log.info("%s: %d checkpoint tensor(s) not part of the model left unused (%s)", folder, len(unused),
                 _shown(unused))
    return SafetensorsShardLoader(folder, sources, fills, where)


def with_or_without_prefix(prefix: str) -> Callable[[str], list[str]]:
    """Candidate keys of a Hugging Face model's parameter: its own name, then the name with the
    base-model prefix (`model.`, `transformer.`) added or removed, as `from_pretrained` accepts a
    bare model's checkpoint for a model with a head and the other way round."""
    head = prefix + "."

    def candidates(name: str) -> list[str]:
        return [name, name.removeprefix(head)] if name.startswith(head) else [name, head + name]

    return candidates


__all__ = [
    "CheckpointTensor", "SafetensorsShardLoader", "local_checkpoint", "parameters_on_meta",
    "plan_shard_loading", "read_checkpoint", "renamed_by_transformers", "with_or_without_prefix",
]
