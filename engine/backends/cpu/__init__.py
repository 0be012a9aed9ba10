"""The CPU backend: fused layer kernels, oneDNN linears, the fused decode step, row groups, malloc tuning.

Everything the engine does faster on a CPU than its torch path, behind `Backend`'s interface
(engine/backends/base.py), tuned by the `cpu:` config section (`CpuConfig`):

    fused_layers.py  RMSNorm, RoPE, SwiGLU and attention of Llama-family layers as csrc kernels
    matmul.py        float32 linears through oneDNN where MKL is the slower library (AMD CPUs)
    layer_op.py      the `rlhf_fused_layers` op's loader and its register-tiled transpose
    decode_op.py     the `rlhf_cpu_decode` op: the whole decode step, packed GEMMs, the sampler
    decoder.py       `CpuLlamaDecoder`: the fast decoder with the fused step and fused prefill
    row_groups.py    decoding a rollout's rows in groups that stay in the last-level cache
    host_memory.py   glibc malloc thresholds and heap population
    plan_terms.py    what the memory plan counts for them
    selftests.py     the load-time self-tests of its two ops
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlhf.engine.backends.base import Backend, Sampler
from rlhf.engine.backends.tuning import CpuConfig
from rlhf.engine.backends.cpu.decode_op import CPU_DECODE_OP, load_cpu_decode_op
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder, kv_cache_halved, kv_cache_torch_dtype
from rlhf.engine.backends.cpu.fused_layers import (FUSED_LAYER_FAMILIES, fuse_layer_ops, fused_attention_runs,
                                                   uses_fused_layers)
from rlhf.engine.backends.cpu.host_memory import populate_heap, tune_glibc_malloc
from rlhf.engine.backends.cpu.layer_op import FUSED_LAYERS_OP
from rlhf.engine.backends.cpu.matmul import cpu_matmul_line, resolve_cpu_matmul, use_onednn_linears, uses_onednn_linears
from rlhf.engine.backends.cpu.plan_terms import packed_weight_bytes
from rlhf.engine.backends.cpu.selftests import cpu_decode_self_test, fused_layers_self_test
from rlhf.engine.memory_plan import ModelShape
from rlhf.engine.ops import register_self_test
from rlhf.engine.sampling import KVCacheDtype, SamplingParams

register_self_test(CPU_DECODE_OP.name, cpu_decode_self_test)
register_self_test(FUSED_LAYERS_OP.name, fused_layers_self_test)

_CPU = torch.device("cpu")


class CpuBackend(Backend):
    """The CPU's fast paths, as `config` (the `cpu:` section) chooses them."""

    name = "cpu"
    device_type = "cpu"

    def __init__(self, config: CpuConfig | None = None) -> None:
        self.config = config or CpuConfig()

    def start(self) -> None:
        tune_glibc_malloc()  # large per-step tensors stay in the heap (host_memory.py)

    def prepare_model(self, model: nn.Module, compile: bool = False) -> dict[str, int]:
        """Fused Llama-family layers (--cpu-fused-layers) and oneDNN linears (--cpu-matmul), except
        under --compile, where inductor fuses these ops itself."""
        if compile:
            return {}
        fused = fuse_layer_ops(model) if self.config.cpu_fused_layers else 0
        onednn = use_onednn_linears(model) if resolve_cpu_matmul(self.config.cpu_matmul) == "onednn" else 0
        return {"fused_modules": fused, "onednn_linears": onednn}

    def prepare_like(self, model: nn.Module, trained: nn.Module) -> None:
        if uses_fused_layers(trained):
            fuse_layer_ops(model)  # the fast decoder's prefill too
        if uses_onednn_linears(trained):
            use_onednn_linears(model)

    def fast_decoder(self, model: nn.Module, batch: int, max_len: int,
                     kv_cache_dtype: KVCacheDtype = "model") -> CpuLlamaDecoder:
        return CpuLlamaDecoder(model, batch, max_len, kv_cache_dtype=kv_cache_dtype,
                               rows_per_group=self.config.cpu_decode_rows_per_group)

    def kv_cache_dtype(self, choice: KVCacheDtype, model_dtype: torch.dtype, model_type: str | None = None) -> torch.dtype:
        if model_type is not None and not kv_cache_halved(choice, model_dtype, _CPU, model_type):
            return model_dtype
        return kv_cache_torch_dtype(choice, model_dtype, _CPU)

    def sampler(self, logits: torch.Tensor, params: SamplingParams) -> tuple[str, Sampler] | None:
        """The decode op's sampler for float32 CPU logits under plain temperature sampling (top-k/top-p
        take the torch path): one call instead of ~15 small ops (its exp may round differently in the
        last bit, so a token can differ only where a uniform falls on a CDF step's edge)."""
        if params.top_k or params.top_p < 1.0 or logits.device.type != "cpu" or logits.dtype != torch.float32:
            return None
        op = load_cpu_decode_op()
        return None if op is None else ("cpu_kernel", op.sample)

    def recorder(self, logits: torch.Tensor, params: SamplingParams) -> Callable[..., torch.Tensor] | None:
        """The decode op's `sample_record` (sample and write a step's column) where its sampler applies."""
        if not params.do_sample or self.sampler(logits, params) is None:
            return None
        op = load_cpu_decode_op()
        return None if op is None else op.sample_record

    def runs_packed_attention(self, model: nn.Module) -> bool:
        return fused_attention_runs(model)

    def peak_memory_note(self) -> str | None:
        if any(k.startswith("MALLOC_") for k in os.environ):
            return None  # the user's own malloc settings, which tune_glibc_malloc leaves alone
        return ("CPU phase peaks are peak RSS, which keeps what glibc keeps after a free (the CPU backend's malloc "
                "tuning): a phase's figure includes what earlier phases freed; MALLOC_MMAP_THRESHOLD_=65536 makes "
                "them the phase's own")

    def after_step(self) -> None:
        populate_heap()  # the pages later steps would fault in one by one (host_memory.py)

    def fuses_layers(self, model_type: str, dtype: str, compile: bool) -> bool:
        return self.config.cpu_fused_layers and not compile and dtype == "fp32" and model_type in FUSED_LAYER_FAMILIES

    def decode_weight_copies(self, shape: ModelShape, compute_bytes: int) -> dict[str, int]:
        """The fused weights' [in, out] copies, and the fused decode step's packed weights where --cpu-matmul
        resolves to oneDNN (float32)."""
        packs = compute_bytes == 4 and resolve_cpu_matmul(self.config.cpu_matmul) == "onednn"
        return {**super().decode_weight_copies(shape, compute_bytes),
                "packed weights": packed_weight_bytes(shape, compute_bytes) if packs else 0}

    def report_lines(self) -> list[tuple[str, str]]:
        return [("cpu matmul", cpu_matmul_line())]

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "cpu_matmul": resolve_cpu_matmul(self.config.cpu_matmul),
                "cpu_fused_layers": self.config.cpu_fused_layers}


__all__ = ["CpuBackend"]
