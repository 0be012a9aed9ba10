"""The interface between the generic engine and a device backend, and its torch reference.

    backend = backend_for(device)          # engine/backends/__init__.py: chosen once from the device
    backend.prepare_model(model, compile)  # before sharding: module swaps of the device's fast layers
    backend.fast_decoder(model, ...)       # the generation loop's decoder for this device
    backend.sampler(logits, params)        # a fused next-token sampler, or None (the reference)
    backend.after_step()                   # after each optimizer step / PPO iteration

`Backend` itself is the torch reference: every method is what the generic engine does without a
backend (no swaps, the Python fast decoder, the reference sampler), which is what every fast path
must match. `engine/backends/cpu/` and `engine/backends/cuda/` subclass it; the generic engine
(sharding, train engine, rollout switch, generation loop, memory plan) and the stages call these
methods and never name a vendor, an instruction set, a cache size or an allocator.

`generation_kernels(False)` turns every backend's generation fast paths off for a block (decode
steps, samplers, decode attention): how a test or a benchmark compares a fast path with the
reference inside one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rlhf.engine.fast_decode import FastLlamaDecoder, copied_projection_bytes
from rlhf.engine.memory_plan import ModelShape, fused_weight_bytes
from rlhf.engine.sampling import KVCacheDtype, SamplingParams

_generation_kernels_enabled = True


def generation_kernels_enabled() -> bool:
    """Whether generation may take a backend's fast paths (see `generation_kernels`)."""
    return _generation_kernels_enabled


@contextlib.contextmanager
def generation_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, generation's fast paths are used where they apply (True, the default
    outside any block) or every step runs its PyTorch reference (False), in the manner of
    `torch.nn.attention.sdpa_kernel`. Not thread-safe: a process-wide setting."""
    global _generation_kernels_enabled
    previous, _generation_kernels_enabled = _generation_kernels_enabled, enabled
    try:
        yield
    finally:
        _generation_kernels_enabled = previous


Sampler = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(logits [B, V], uniforms [B], temperature) -> tokens [B]: a fused draw by sample_from_logits' contract."""


class Backend:
    """The torch reference of every backend method (see the module docstring)."""

    name = "reference"
    device_type = "cpu"

    def start(self) -> None:
        """Once per process, when a stage chooses the backend (before any model loads)."""

    def prepare_model(self, model: nn.Module, compile: bool = False) -> dict[str, int]:
        """Swap `model`'s modules for the device's fast ones, in place, before sharding (parameters,
        state-dict names and LoRA wrapping untouched); -> how many of each kind (for the log)."""
        return {}

    def prepare_like(self, model: nn.Module, trained: nn.Module) -> None:
        """Give a rollout copy the swaps `prepare_model` gave the trained model it copies."""

    def fast_decoder(self, model: nn.Module, batch: int, max_len: int,
                     kv_cache_dtype: KVCacheDtype = "model") -> FastLlamaDecoder:
        """The decoder generation runs a supported model through (fast_decode_unsupported_reason is None)."""
        return FastLlamaDecoder(model, batch, max_len)

    def kv_cache_dtype(self, choice: KVCacheDtype, model_dtype: torch.dtype, model_type: str | None = None) -> torch.dtype:
        """The fast decoder's KV-cache dtype for SamplingParams.kv_cache_dtype `choice`."""
        return model_dtype

    def rounds_kv_cache(self, choice: KVCacheDtype, model_dtype: torch.dtype, model_type: str | None = None) -> bool:
        """Whether a rollout's KV cache is kept in a narrower dtype than the model's (its log-probs then
        drift from the training forward's by more than rounding)."""
        return self.kv_cache_dtype(choice, model_dtype, model_type) != model_dtype

    def sampler(self, logits: torch.Tensor, params: SamplingParams) -> tuple[str, Sampler] | None:
        """(its name, a fused sampler) for these logits under `params`, or None: the reference draws."""
        return None

    def recorder(self, logits: torch.Tensor, params: SamplingParams) -> Callable[..., torch.Tensor] | None:
        """An op that samples and records a decode step in one call (generation.py's `_record_python`
        is its reference), or None."""
        return None

    def selective_log_softmax(self, logits: torch.Tensor,
                              index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(log p(index), logsumexp) in fp32 by a fused op, or None: logprobs.py's reference runs."""
        return None

    def runs_packed_attention(self, model: nn.Module) -> bool:
        """`model`'s attention skips what a packed forward's block-diagonal mask hides (engine/packing.py)."""
        return False

    def peak_memory_note(self) -> str | None:
        """What the per-phase peak RSS figures include because of the backend's allocator settings, or None."""
        return None

    def after_step(self) -> None:
        """After every optimizer step of a stage (PPO: every iteration's training phase)."""

    # -- the memory plan (no model is loaded: shapes and settings only)

    def fuses_layers(self, model_type: str, dtype: str, compile: bool) -> bool:
        """A model of `model_type` trained in `dtype` runs fused layers (they save fewer activations)."""
        return False

    copies_fused_weights = True
    """The fast decoder keeps its own [in, out] copy of the fused q/k/v and gate/up weights (the
    reference's and the CPU's layout); False: it reads a rollout skeleton's shared storage in place."""

    def decode_weight_copies(self, shape: ModelShape, compute_bytes: int) -> dict[str, int]:
        """Copies of the weights the backend's decode steps keep during a rollout (a tp=1 rollout of a
        model the fast decoder runs), by name -> bytes."""
        return {"fused weights": fused_weight_bytes(shape, compute_bytes) if self.copies_fused_weights else 0}

    def decoder_weight_bytes(self, model: nn.Module) -> int:
        """Bytes of weight copies `fast_decoder(model, ...)` would allocate (generation checks they fit)."""
        return copied_projection_bytes(model, transpose_copies=self.copies_fused_weights)

    def report_lines(self) -> list[tuple[str, str]]:
        """(label, text) rows `rlhf report` prints for this backend."""
        return []

    def describe(self) -> dict[str, Any]:
        """What the backend chose, for the stage's log."""
        return {"backend": self.name}


__all__ = ["Backend", "Sampler", "generation_kernels", "generation_kernels_enabled"]
