"""The `rlhf_fused_layers` op (csrc/layers/): its build spec, the loader the layers use, and its transpose.

    layer_op(x, w)     # the built op where every tensor is float32 on the CPU, else None
    transposed(x)      # x.t().contiguous() through the op's register-tiled transpose where it is faster

engine/backends/cpu/fused_layers.py wraps the op's RMSNorm, RoPE, SwiGLU and attention kernels in autograd
Functions; engine/backends/cpu/matmul.py's weight gradient takes `transposed`. This module depends on
nothing but the op loader, so both can import it.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from rlhf.engine.ops import OpSpec, load_op, register_op

__all__ = ["FUSED_LAYERS_OP", "layer_op", "transposed"]

FUSED_LAYERS_OP = OpSpec(
    "rlhf_fused_layers",
    sources=("layers/fused_layers.cpp", "layers/fused_layers_scalar.cpp", "layers/fused_layers_avx2.cpp",
             "layers/fused_layers_avx512.cpp"),
    # at::parallel_for is inline OpenMP code: without -fopenmp it would run on one thread.
    # No contraction of a * b + c into FMAs: the elementwise math follows PyTorch's op for op.
    extra_cflags=("-fopenmp", "-ffp-contract=off"),
    extra_ldflags=("-fopenmp",),
    build_seconds=50.0,
)
register_op(FUSED_LAYERS_OP)


def _cpu_float32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def layer_op(*tensors: torch.Tensor) -> ModuleType | None:
    """The built op where every tensor is float32 on the CPU, else None (the reference runs)."""
    if not _cpu_float32(*tensors) or torch.compiler.is_compiling():
        return None
    return load_op(FUSED_LAYERS_OP.name)


@cache
def _has_vector_transpose(op: ModuleType) -> bool:
    """The op has a register-tiled transpose here (AVX2 or AVX-512: 2x torch's copy at 4096 x 256 on
    an AMD EPYC); its scalar one is slower than torch's."""
    return op.supported_isas()[-1] != "scalar"


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] -> x.t().contiguous() (the same values, exactly)."""
    op = layer_op(x) if x.dim() == 2 and x.is_contiguous() else None
    if op is None or not _has_vector_transpose(op):
        return x.t().contiguous()
    return op.transpose(x)
