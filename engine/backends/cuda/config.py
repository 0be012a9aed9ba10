"""The CUDA backend's tuning: the `cuda:` section of every stage's config (`--cuda-...` flags).

Each field's docstring opens with its CLI help (one paragraph of at most ~160 characters), as in
engine/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CudaConfig:
    """How a GPU runs the models' rollouts."""

    cuda_graph_decode: bool = False
    """Replay rollout decode steps as CUDA graphs (one per batch size; opt-in until validated on GPUs); also
    RLHF_CUDA_GRAPH_DECODE=1.

    A graph replays a whole decode step in one launch, where a small model's step is otherwise bound by
    ~25 kernel launches per layer from Python (engine/backends/cuda/decode_graph.py).
    """


__all__ = ["CudaConfig"]
