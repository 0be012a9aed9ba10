"""The rollout KV cache: preallocated once per rollout, written in place, read as a prefix.

`RolloutKVCache` is a transformers `Cache`, so any Hugging Face decoder-only model takes it
through its own forward (`cache_argument`: `cache=` from transformers 5.2x on, `past_key_values=`
before; nothing is patched). Each full-attention layer
allocates [batch, kv_heads, prompt + max_new_tokens, head_dim] keys and values on its first
write (so dtype, device and the per-rank head count under tensor parallelism come from the
model itself) and never reallocates. Unlike `transformers.StaticCache`, a layer returns only
the filled prefix `[:, :, :length]`: attention reads the tokens that exist instead of the whole
buffer behind a mask (prefill attends over P keys instead of P + N, decode step t over
P + t + 1). The write position is a host-side int advanced by the known number of tokens, so
no step reads a device value; a CUDA-graph fast path, which needs fixed shapes, would read the
whole buffer instead.

Sliding-window and chunked layers (Mistral/Qwen2 configs that enable them) use transformers'
own `StaticSlidingWindowLayer`, whose mask sizes the model's mask functions already know.

Group sampling (several samples per prompt) prefills the unique prompts into a cache of that
many rows, then `batch_select_indices` copies each prompt's rows to its samples' rows, so the
prompt is never run N times.
"""

from __future__ import annotations

import inspect
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, StaticSlidingWindowLayer, get_layer_types_and_kwargs


class PrefixStaticLayer(CacheLayerMixin):
    """One full-attention layer: a preallocated buffer, appended in place, read as its filled prefix."""

    # Marks the cache as static to the masking code: a one-token decode step then always builds
    # its padding mask from tensors instead of testing `padding_mask.all()` on the host.
    is_compileable = True
    is_sliding = False

    def __init__(self, max_cache_len: int, **kwargs: object) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((batch, heads, self.max_cache_len, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, self.max_cache_len, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise RuntimeError(f"KV cache overflow: writing up to position {end} of {self.max_cache_len}")
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked before this step's keys are written: the step attends to length + query_length.
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rows `indices` of the cache become its rows (group sampling: one prefill per prompt,
        its keys and values copied to each sample's row). Only the filled prefix is copied into
        a new buffer for len(indices) rows; the old one is released when this returns."""
        if not self.is_initialized:
            return
        self.keys, self.values = (_select_prefix(t, indices, self.length) for t in (self.keys, self.values))

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


def _select_prefix(buffer: torch.Tensor, indices: torch.Tensor, length: int) -> torch.Tensor:
    """A [len(indices), heads, max_len, dim] buffer holding rows `indices` of `buffer`'s first
    `length` positions; the rest is left uninitialised (nothing reads past the filled prefix)."""
    out = buffer.new_empty((indices.numel(), *buffer.shape[1:]))
    out.narrow(2, 0, length).copy_(buffer.narrow(2, 0, length).index_select(0, indices))
    return out


@cache
def _cache_parameter(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    return "past_key_values" if "past_key_values" in parameters and "cache" not in parameters else "cache"


def cache_argument(model: nn.Module, kv_cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword that passes `kv_cache` to `model`'s forward: `cache` (transformers renamed
    `past_key_values` to it, keeping the old name as a deprecated alias) or, on a transformers
    whose models still take `past_key_values`, that. Read off the first Hugging Face module's
    forward (a PEFT or value-model wrapper's forward takes **kwargs)."""
    for module in model.modules():
        if type(module).__module__.startswith("transformers.models."):
            return {_cache_parameter(type(module)): kv_cache}
    return {"past_key_values": kv_cache}


def returned_cache(output: Any) -> Cache:
    """The KV cache a forward with use_cache=True returned (`cache`, or `past_key_values` before the rename)."""
    kv_cache = getattr(output, "cache", None)
    return output.past_key_values if kv_cache is None else kv_cache


class RolloutKVCache(Cache):
    """The KV cache of one rollout: every layer preallocated for `max_cache_len` tokens."""

    def __init__(self, config: PretrainedConfig, max_cache_len: int) -> None:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        if isinstance(layer_kwargs, dict):  # transformers 5.17: one dict shared by every layer
            layer_kwargs = [layer_kwargs] * len(layer_types)
        layers: list[CacheLayerMixin] = []
        for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
            if layer_type == "full_attention":
                layers.append(PrefixStaticLayer(max_cache_len))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len, **kwargs))
            else:
                raise NotImplementedError(
                    f"the rollout KV cache has no layer for {layer_type!r} attention "
                    f"(model type {config.model_type!r}); supported: full, sliding and chunked attention"
                )
        super().__init__(layers=layers)
        if not isinstance(getattr(type(self), "max_cache_len", None), property):
            self.max_cache_len = max_cache_len  # some transformers 5.x derive it from the layers instead

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` of every layer, in that order (group sampling expands each prompt's
        prefilled row to its samples' rows with repeat_interleave indices). Full-attention layers
        copy their filled prefix only; windowed layers (transformers' own) copy their window."""
        for layer in self.layers:
            if isinstance(layer, PrefixStaticLayer):
                layer.batch_select_indices(indices)
            elif layer.is_initialized:
                layer.keys, layer.values = layer.keys.index_select(0, indices), layer.values.index_select(0, indices)
                layer.batch_size = indices.numel()  # transformers' static layers record it at allocation

    def bytes_allocated(self) -> int:
        """Bytes held by the keys and values allocated so far (0 before the first forward)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total


def kv_cache_bytes(config: PretrainedConfig, rows: int, max_len: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of keys and values a rollout of `rows` sequences x `max_len` tokens allocates per rank
    (every layer as full attention: an upper bound for sliding-window layers). Computed from the
    config alone, so the size can be refused before anything is allocated."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * -(-kv_heads // tp_size) * head_dim * dtype.itemsize
    return rows * max_len * per_token


def _cgroup_memory_left() -> int | None:
    """The container's memory limit minus its usage (cgroup v2, then v1), or None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max" or int(limit_text) >= 1 << 60:
                return None
            return int(limit_text) - int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory an allocation on `device` can still take: free GPU memory (torch.cuda.mem_get_info),
    or the host's available memory (psutil, else /proc/meminfo) within the container's limit;
    None where it cannot be told."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Blocks torch's caching allocator holds but does not use are free to it too.
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    host: int | None = None
    try:
        import psutil

        host = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
        except OSError:
            pass
    container = _cgroup_memory_left() if os.name == "posix" else None
    known = [m for m in (host, container) if m is not None]
    return min(known) if known else None
