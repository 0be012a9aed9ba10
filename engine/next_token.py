"""The next token of every row through the device backend's fused sampler, or the reference.

    tokens = sample_next_token(logits, params, generator)   # [B, V] -> [B] int64

`engine/sampling.py` defines what is drawn (`process_logits`, then `sample_from_logits`: one
inverse-CDF draw per row from a uniform); a backend's sampler (`Backend.sampler`: the CUDA sampling
kernel, the CPU decode op's sampler) draws by the same contract in one call, so a seeded generator
gives the same tokens on every path, except where a uniform falls within rounding of a CDF step's
edge. `generation_kernels(False)` (engine/backends/base.py) keeps every draw on the reference.
"""

from __future__ import annotations

import torch

from rlhf.engine.backends.registry import backend_for
from rlhf.engine.backends.base import generation_kernels_enabled
from rlhf.engine.sampling import SamplingParams, process_logits, sample_from_logits


def sampler_path(logits: torch.Tensor, params: SamplingParams) -> str:
    """Which implementation `sample_next_token` runs for these logits: "greedy", the backend's
    sampler's name ("cuda_kernel", "cpu_kernel"), or "reference" (all draw the same tokens)."""
    if not params.do_sample:
        return "greedy"
    fused = backend_for(logits.device).sampler(logits, params) if generation_kernels_enabled() else None
    return "reference" if fused is None else fused[0]


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next token of every row of [batch, vocab] logits under `params` -> [batch] int64.

    Every path draws one uniform per row with `generator` on the logits' device, as
    `sample_from_logits` does, so a seeded generator gives the same tokens on each of them; or
    takes `uniform` [batch] float32 (generation draws a whole batch's and passes the rows it
    still decodes, so dropping finished rows leaves the others' draws unchanged).
    """
    if not params.do_sample:
        return torch.argmax(logits, dim=-1)
    fused = backend_for(logits.device).sampler(logits, params) if generation_kernels_enabled() else None
    if fused is not None:
        if uniform is None:  # as sample_from_logits draws
            uniform = torch.rand(logits.shape[0], device=logits.device, dtype=torch.float32, generator=generator)
        return fused[1](logits, uniform, params.temperature)
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p)
    return sample_from_logits(scores, generator, uniform)


__all__ = ["sample_next_token", "sampler_path"]
