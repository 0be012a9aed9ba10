"""The fused float32 CPU decode step of Llama-family models (csrc/generation/cpu_decode*.cpp).

On the CPU a decode step of a small model is mostly per-op overhead: a layer is ~40 small
PyTorch ops (norms, RoPE, cache writes, attention over one query, activation, residuals),
each a dispatch plus a pass over tiny tensors. The `rlhf_cpu_decode` op runs the whole step
in one call: per layer four matmuls through ATen/MKL or, over weights packed once per rollout,
its own panel GEMM (the output and down projections add into the residual stream in place)
and three kernels of its own (AVX2 + FMA where the CPU has them, else portable C++; on AVX-512
CPUs the packed projections run 16-float registers: the "avx512" kernel set) on
torch's intra-op threads: RMSNorm, SiLU(gate) * up, and one pass per (sequence, KV head)
that applies RoPE, writes the new key and value into the cache and attends over the visible
keys.

`FastLlamaDecoder` (engine/fast_decode.py) uses it for its decode steps where
`cpu_decode_unsupported_reason` finds nothing against it; its own Python step is the
reference the op must match (tests/test_cpu_decode.py), and prefill stays in Python (it is
matmul-bound: fusing saves nothing there). The op shares the decoder's weights, RoPE tables
and KV cache, so prefill and decode steps interleave freely. `RLHF_DISABLE_OPS=1` turns it
off like every csrc op.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from rlhf.engine.ops import OpSpec, load_op, register_op

__all__ = ["CPU_DECODE_OP", "cpu_decode_unsupported_reason", "load_cpu_decode_op"]

CPU_DECODE_OP = OpSpec(
    "rlhf_cpu_decode",
    sources=(
        "generation/cpu_decode.cpp",
        "generation/cpu_decode_scalar.cpp",
        "generation/cpu_decode_avx2.cpp",
        "generation/cpu_decode_avx512.cpp",
    ),
    # at::parallel_for is inline OpenMP code: without -fopenmp it would run on one thread.
    # No contraction of a * b + c into FMAs: the elementwise math follows PyTorch's op for op.
    extra_cflags=("-fopenmp", "-ffp-contract=off"),
    extra_ldflags=("-fopenmp",),
    build_seconds=70.0,
)
register_op(CPU_DECODE_OP)


def cpu_decode_unsupported_reason(device: torch.device, dtype: torch.dtype, activation: object) -> str | None:
    """Why the fused CPU step cannot run a decoder with these properties, or None when it can."""
    if device.type != "cpu":
        return f"the model is on {device.type}, not the CPU"
    if dtype != torch.float32:
        return f"the model is {dtype}, the op is float32 only"
    if activation is not F.silu:
        return "the MLP activation is not SiLU"
    return None


def load_cpu_decode_op() -> ModuleType | None:
    """The built `rlhf_cpu_decode` module, or None (logged once) where it cannot be built."""
    return load_op(CPU_DECODE_OP.name)
