"""Reading a resume checkpoint without running code from it.

A checkpoint folder is data a user may have copied from anywhere, and three of its parts are
pickles, whose loading can call any function the file names:

    host_rank{r}.pt      torch.save of RNG states, schedules, loop state: read with
                         torch.load(weights_only=True), numpy's RNG array types allowlisted
    .metadata            DCP's index (FileSystemReader reads it with pickle.load): read here by
                         `MetadataUnpickler`, which resolves only the classes DCP writes into it
    *.distcp byte items  the non-tensor values of a state dict (optimizer hyperparameters), which
                         DCP's DefaultLoadPlanner reads with torch.load(weights_only=False): read
                         by `SafeLoadPlanner` with weights_only=True

Any other global a file names stops the read with `UnsafeCheckpoint` (one line naming the file
and the global); nothing it names is imported or called.

    metadata = read_dcp_metadata(path / ".metadata")
    dcp.load(state, storage_reader=ValidatedReader(path, metadata), planner=SafeLoadPlanner())
    host = read_host_state(path / "host_rank0.pt")
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class UnsafeCheckpoint(Exception):
    """A checkpoint file that names a global outside the allowlist, or is not what it should be."""


# (module, name) of every class DCP pickles into .metadata (torch.distributed.checkpoint.metadata
# and the filesystem storage's per-item record), plus the plain types their fields hold.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles: by its name, looked up in torch
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # a checkpoint_id given as a Path
}
# torch's enum-like values a TensorProperties holds, pickled by name as attributes of `torch`.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only DCP's metadata classes and torch dtypes/layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"names {module}.{name}, which a DCP index never holds")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` at `path`, unpickled through the allowlist; UnsafeCheckpoint for a file
    that names anything else or is not a DCP index, with what was wrong."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        raise UnsafeCheckpoint(f"{path.name} {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any damage (truncation, random bytes) is one reason
        raise UnsafeCheckpoint(f"{path.name} is not a readable DCP index ({_first_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpoint(f"{path.name} holds a {type(metadata).__name__}, not a DCP index")
    return metadata


class ValidatedReader(FileSystemReader):
    """FileSystemReader that hands DCP the metadata `read_dcp_metadata` read, instead of
    pickle.load-ing `.metadata` itself."""

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: never written here
            raise UnsafeCheckpoint("per-rank DCP metadata is not read")
        metadata = self._metadata
        # What FileSystemReader.read_metadata adds to what it unpickled.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are read with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - refused or damaged, the item is not loaded
            raise UnsafeCheckpoint(f"item {read_item.dest_index.fqn}: {unsafe_reason(exc)}") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # now known to hold only weights_only types


def numpy_rng_globals() -> list[Any]:
    """What a pickled numpy RNG state (`np.random.get_state()`: a uint32 array) names: the array
    rebuild function under both of its module names (numpy 1 and 2), the array and dtype types."""
    rebuild = np.zeros(1, np.uint32).__reduce__()[0]
    names = {f"{rebuild.__module__}.{rebuild.__name__}", "numpy.core.multiarray._reconstruct",
             "numpy._core.multiarray._reconstruct"}
    return [*((rebuild, name) for name in sorted(names)), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_host_state(path: Path, lazy: bool = False) -> dict[str, Any]:
    """A rank's host state, loaded with torch.load(weights_only=True): tensors, plain Python
    values and numpy's RNG array; UnsafeCheckpoint for anything else or a damaged file. `lazy`:
    tensors memory-mapped on the CPU, for reading its small fields only (a PPO EMA is a model)."""
    try:
        # (warnings.catch_warnings: torch warns about a pickle protocol it then refuses anyway)
        with torch.serialization.safe_globals(numpy_rng_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            host = (torch.load(path, weights_only=True, mmap=True, map_location="cpu") if lazy
                    else torch.load(path, weights_only=True))
    except Exception as exc:  # noqa: BLE001 - refused or damaged: one reason either way
        raise UnsafeCheckpoint(f"{path.name}: {unsafe_reason(exc)}") from None
    if not isinstance(host, dict) or not {"rng", "engines", "loop", "world_size"} <= set(host):
        raise UnsafeCheckpoint(f"{path.name}: not a host state (expected rng, engines, loop, world_size)")
    return host


# torch.load(weights_only=True) names the global it refused: "Unsupported global: GLOBAL os.system
# was not an allowed global" (torch 2.4-2.6), "unsupported GLOBAL posix.system whose module posix
# is blocked" (later); its other lines are advice about weights_only=False.
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_WEIGHTS_ONLY_ADVICE = ("Weights only load failed", "Check the documentation", "Please file an issue")


def unsafe_reason(exc: BaseException) -> str:
    """torch.load's refusal as 'names posix.system, which a checkpoint never holds'; else the
    first line that says what was wrong."""
    text = str(exc)
    found = _REFUSED_GLOBAL.search(text)
    if found:
        return f"names {found.group(1)}, which a checkpoint never holds (refused, nothing run)"
    if text.startswith(_WEIGHTS_ONLY_ADVICE[0]):
        lines = [line.strip() for line in text.splitlines()
                 if line.strip() and not line.strip().startswith(_WEIGHTS_ONLY_ADVICE)]
        return f"refused by torch.load(weights_only=True): {lines[0][:200] if lines else type(exc).__name__}"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[0]
    end = line.find(". ", 40)  # torch's messages go on with advice after their first sentence
    return f"{type(exc).__name__}: {line[: end + 1] if 0 < end < 200 else line[:200]}"
