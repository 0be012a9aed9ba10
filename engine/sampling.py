"""Next-token selection: logits -> token ids, with greedy, temperature, top-k and top-p.

Pure tensor functions with no host synchronisation (no `.item()`, no branching on tensor
values), so they can run inside a decode step that is captured or compiled. The semantics follow
Hugging Face's `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper`, applied in
that order (the order `transformers.generate` uses), which tests/test_generation.py checks.
`process_logits` and `sample_from_logits` are the reference; `sample_next_token` (engine/next_token.py)
runs a backend's fused sampler behind it where one applies, drawing the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVCacheDtype = Literal["auto", "model", "fp16"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "model", "fp16")


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout picks its tokens and when it stops."""

    max_new_tokens: int
    """Tokens generated after the prompt; every output has exactly prompt + this many columns."""
    pad_token_id: int
    """Written after a sequence has finished (and in any column it never reached)."""
    eos_token_id: int | list[int] | None = None
    """A sequence stops after emitting any of these; None generates max_new_tokens always."""
    do_sample: bool = True
    """Sample from the processed distribution; False takes the argmax of the raw logits."""
    temperature: float = 1.0
    """Logits are divided by this before top-k/top-p; must be > 0 when sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens (ties with the k-th kept); 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1.0 disables."""
    min_new_tokens: int = 0
    """EOS is suppressed until this many tokens have been generated (HF's MinNewTokensLengthLogitsProcessor)."""
    sync_every: int = 8
    """Check on the host whether every sequence has finished once per this many decode steps
    (the only host synchronisation of the loop); 0 never checks and always runs max_new_tokens."""
    drop_finished: bool = True
    """At those checks, once a quarter of the rows still decoded have finished (EOS), drop them
    from the decode batch (their KV cache rows too): the rest decode on fewer rows, drawing the
    tokens they would have drawn."""
    kv_cache_dtype: KVCacheDtype = "model"
    """The fast decoder's KV cache: "model" in the model's dtype (the default here: generate() matches
    the model's own forward); "fp16" keeps a float32 model's keys and values in float16 on the CPU
    (rounded as they are written, widened as they are read): half the cache's memory and of the
    bytes each decode step reads; "auto" is fp16 where that applies, else the model's dtype
    (engine/fast_decode.py's kv_cache_torch_dtype; `rlhf ppo`'s default)."""
    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"SamplingParams.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.sync_every < 0:
            raise ValueError(f"SamplingParams.sync_every must be >= 0, got {self.sync_every}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"SamplingParams.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def eos_token_ids(self) -> list[int]:
        """The stop ids as a list (empty when generation never stops early)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)


def process_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p over [..., vocab] logits, in float32.

    Removed tokens get -inf, so `softmax` of the result is the distribution sampled from.
    At least one token (the most likely) always survives. This is the one definition of the
    filter: the generation loop, the fused CUDA sampling kernel (engine/backends/cuda/kernels.py,
    csrc/generation/sampling.cu) and its reference all follow it.

    x = logits / temperature. Top-k keeps x >= the k-th largest x (ties with the k-th are kept,
    as `TopKLogitsWarper`); 0 or >= vocab disables it. Top-p is `TopPLogitsWarper` with a
    stable sort: ordering the survivors from most to least likely, with tied tokens in
    descending id order (what HF's ascending sort gives when it is stable), a token is kept
    while the mass before it is below top_p of the total; 1 disables it. HF's own sort is not
    stable, so on a tie at the top-p boundary it keeps an arbitrary part of the tie group; here
    the tied tokens with the highest ids are kept, deterministically on every device.
    """
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if 0 < top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p < 1.0:
        scores = scores.masked_fill(_top_p_removed(scores, top_p), float("-inf"))
    return scores


def _top_p_removed(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the tokens top-p removes from float32 `scores` (see `process_logits`).

    Keep rule "mass strictly before the token < top_p x total", with masses e^(x - max): the
    same comparison as HF's "ascending cumulative probability <= 1 - top_p" removes, written so
    that the CUDA kernel, which finds the threshold without sorting, computes the same sums.
    """
    ascending, order = torch.sort(scores, dim=-1, stable=True)
    descending, order = ascending.flip(-1), order.flip(-1)
    mass = torch.exp(descending - descending[..., :1])
    inclusive = mass.cumsum(dim=-1)
    before = torch.nn.functional.pad(inclusive[..., :-1], (1, 0))
    keep = before < top_p * inclusive[..., -1:]
    keep[..., 0] = True  # the most likely token always survives
    removed = ~keep
    return removed.scatter(-1, order, removed)


def sample_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row from softmax(logits) by inverse CDF, without a host sync.

    With masses m_i = exp(x_i - max x) (0 for removed tokens) and one uniform u in [0, 1) per
    row, the token is the first index i whose running sum m_0 + ... + m_i exceeds u * sum(m);
    if rounding leaves none, the last index with m_i > 0. A token of zero mass can never be
    picked. `uniform` [B] is drawn with `generator` on the logits' device when not given; this
    is the contract of the fused sampling kernel (engine/backends/cuda/kernels.py), so both paths draw the
    same tokens from the same uniforms. Rows of [B, vocab] -> [B] int64.
    """
    scores = logits.float()
    if uniform is None:
        uniform = torch.rand(scores.shape[0], device=scores.device, dtype=torch.float32, generator=generator)
    mass = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    cdf = mass.cumsum(dim=-1)
    target = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    vocab = scores.shape[-1]
    last_positive = (vocab - 1) - torch.argmax((mass > 0).flip(-1).to(torch.uint8), dim=-1)
    return torch.where(token < vocab, token, last_positive)


def check_sampling_args(logits: torch.Tensor, top_k: int, top_p: float) -> None:
    if logits.dim() != 2 or logits.shape[-1] < 1:
        raise ValueError(f"sample_tokens: logits must be [batch, vocab], got {tuple(logits.shape)}")
    if top_k < 0:
        raise ValueError(f"sample_tokens: top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"sample_tokens: top_p must be in [0, 1], got {top_p}")


# The sampling kernels' filter is the generation loop's: one definition (see process_logits).
filter_logits_reference = process_logits


def sample_tokens_reference(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    uniform: torch.Tensor | None = None, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row of [B, V] logits -> [B] int64, without host synchronisation.

    temperature <= 0 is greedy: the first index of the maximum raw logit (`torch.argmax`).
    Otherwise `process_logits` (temperature, top-k, top-p), then one inverse-CDF draw per row
    by `sample_from_logits` from `uniform` [B] float32 (drawn with `generator` when not given).
    """
    check_sampling_args(logits, top_k, top_p)
    if not temperature > 0:
        return torch.argmax(logits, dim=-1)
    return sample_from_logits(process_logits(logits, temperature, top_k, top_p), generator, uniform)


def draw_explained_by_rounding(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float, token: int
) -> bool:
    """Whether a sampler that drew `token` from the 1-D `logits` with uniform `u` differs from
    `sample_tokens_reference` only by float32 rounding: `u` lies within rounding of the edge of
    `token`'s CDF step, and `token` has mass after filtering. How a fused sampler is judged."""
    if temperature <= 0:
        return False  # greedy has no draw to round
    scores = process_logits(logits[None].double(), temperature, top_k, top_p)[0]
    mass = torch.exp(scores - scores.max())
    cdf = mass.cumsum(0)
    target = u * cdf[-1]
    lo = cdf[token - 1] if token > 0 else cdf.new_zeros(())
    slack = 1e-5 * cdf[-1]
    return bool(mass[token] > 0 and lo - slack <= target <= cdf[token] + slack)
