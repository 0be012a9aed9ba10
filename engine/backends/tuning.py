"""The device backends' tuning: the `cpu:` and `cuda:` sections of every stage's config.

Each field's docstring opens with its CLI help (one paragraph of at most ~160 characters), as in
engine/config.py; `--help` lists each section under a heading of its own. None of them changes what a
model computes beyond rounding: they choose how a device runs it. This module imports no torch, so the
CLI's configs compose it without loading the backends (engine/backends/registry.py does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf.engine.config import bounded

CpuMatmul = Literal["auto", "aten", "onednn"]


@dataclass
class CpuConfig:
    """How the CPU runs the models: fused layer kernels, the matmul library, rollout row groups."""

    cpu_fused_layers: bool = True
    """Run the RMSNorm, RoPE, SwiGLU and attention of Llama-family layers as fused csrc kernels (float32); false keeps
    Hugging Face's modules. Ignored with --compile.

    Llama, Qwen2 and Mistral layers are fused; other families and other devices run Hugging Face's
    modules. The kernels compute what those modules compute, up to rounding (engine/backends/cpu/fused_layers.py).
    """
    cpu_matmul: CpuMatmul = "auto"
    """Library of float32 linears' matmuls on the CPU: aten (torch's, MKL), onednn, or auto (onednn on AMD CPUs, else
    aten). Same results up to rounding.

    onednn runs the forward and the input gradient through oneDNN at 64+ rows and dot products of 256+
    (64+ on Zen 5), and the weight gradient too on AMD CPUs with AVX-512 (elsewhere on MKL); see
    engine/backends/cpu/matmul.py. auto takes oneDNN on AMD CPUs because MKL runs its AVX2 code path there.
    With onednn, rollout decode steps run over weights packed once per rollout.
    """
    cpu_decode_rows_per_group: int | None = bounded(None, ge=1)
    """Decode a rollout's rows in groups of this many, each to its end, so that its KV cache and the weights stay in
    the CPU's last-level cache.

    The draws are the same either way. Unset: the fused CPU decode step over packed weights (--cpu-matmul
    onednn; auto on AMD CPUs) picks the group from the last-level cache size, e.g. 8 rows for a 4-layer
    tiny Llama on a 32 MB L3 (engine/backends/cpu/row_groups.py). Models whose weights exceed the cache
    decode every row together, as every other decode path does.
    """


@dataclass
class CudaConfig:
    """How a GPU runs the models' rollouts."""

    cuda_graph_decode: bool = False
    """Replay rollout decode steps as CUDA graphs (one per batch size; opt-in until validated on GPUs); also
    RLHF_CUDA_GRAPH_DECODE=1.

    A graph replays a whole decode step in one launch, where a small model's step is otherwise bound by
    ~25 kernel launches per layer from Python (engine/backends/cuda/decode_graph.py).
    """


RENAMED_FIELDS: dict[str, str] = {"fused_layers": "cpu_fused_layers", "decode_rows_per_group": "cpu_decode_rows_per_group"}
"""Earlier names of these fields (the engine: section's fused_layers, ppo's decode_rows_per_group) -> today's:
config files, saved configs and flags read both."""

__all__ = ["CpuConfig", "CpuMatmul", "CudaConfig", "RENAMED_FIELDS"]
