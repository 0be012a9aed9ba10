"""What the memory plan (engine/memory_plan.py) counts for the CPU backend's decode step."""

from __future__ import annotations

import math

from rlhf.engine.memory_plan import ModelShape


def packed_weight_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """The fused CPU decode step's packed copy of every layer's projections (q/k/v together, o,
    gate, up, down: Llama-family) and the LM head, in panels of 16 output columns (the last one
    zero-padded)."""
    def padded(out: int, inputs: int) -> int:
        return math.ceil(out / 16) * 16 * inputs

    h, i = shape.hidden, shape.intermediate
    layer = padded(shape.q_dim + 2 * shape.kv_dim, h) + padded(h, shape.q_dim) + 2 * padded(i, h) + padded(h, i)
    return compute_bytes * (shape.layers * layer + padded(shape.vocab, h))


__all__ = ["packed_weight_bytes"]
