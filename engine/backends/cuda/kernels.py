"""The CUDA backend's generation kernels behind plain functions: decode attention, sampling,
selective log-softmax.

Each public function takes the CUDA op from csrc/generation/ when it is built and the inputs
are CUDA tensors it supports, and otherwise runs its PyTorch reference (engine/decode_attention.py,
engine/sampling.py), which defines the semantics every fast path must match
(tests/test_generation_kernels.py checks the parity on a GPU). Neither path synchronises with the host.

- `decode_attention`: one query token per sequence over a static KV cache [B, Hkv, S, D] with
  grouped-query attention and per-sequence valid lengths or a key padding mask (left-padded
  prompts); the CUDA op is flash-decoding (split-K over the sequence plus a merge kernel).
- `sample_tokens`: `rlhf.engine.sampling.process_logits` (temperature, top-k, top-p in Hugging
  Face's warper order) then one inverse-CDF draw per row from a uniform number generated on the
  device, as `sample_from_logits` draws.
- `fused_selective_log_softmax_forward`: the CUDA forward used by
  `rlhf.engine.logprobs.selective_log_softmax` (log-prob of chosen tokens, fp32, one pass).

The CUDA backend (engine/backends/cuda/__init__.py) hands them to the generic engine: `generate`
samples with `sample_tokens`, the CUDA decoder's steps attend with `decode_attention`, and
engine/logprobs.py takes `fused_selective_log_softmax_forward`. `generation_kernels(False)`
(engine/backends/base.py) turns every generation fast path off for a block (the reference).
"""

from __future__ import annotations

from types import ModuleType

import torch

from rlhf.engine.ops import OpSpec, load_op, register_op
from rlhf.engine.backends.base import generation_kernels_enabled
from rlhf.engine.decode_attention import check_lengths, decode_attention_reference, key_mask
from rlhf.engine.sampling import check_sampling_args, sample_tokens_reference
from rlhf.logging import get_logger

log = get_logger(__name__)

DECODE_ATTENTION_OP = OpSpec(
    "rlhf_decode_attention",
    sources=("generation/decode_attention.cpp", "generation/decode_attention.cu"),
    needs_cuda=True,
)
SAMPLING_OP = OpSpec(
    "rlhf_sampling",
    sources=("generation/sampling.cpp", "generation/sampling.cu"),
    needs_cuda=True,
)
SELECTIVE_LOG_SOFTMAX_OP = OpSpec(
    "rlhf_selective_log_softmax",
    sources=("generation/selective_log_softmax.cpp", "generation/selective_log_softmax.cu"),
    needs_cuda=True,
)
for _spec in (DECODE_ATTENTION_OP, SAMPLING_OP, SELECTIVE_LOG_SOFTMAX_OP):
    register_op(_spec)

DECODE_ATTENTION_HEAD_DIMS = (32, 64, 128, 256)
"""Head dimensions the CUDA decode attention is compiled for; others take the reference."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _cuda_op(spec: OpSpec, *tensors: torch.Tensor) -> ModuleType | None:
    """The built op when every tensor is on CUDA (building it on first use), else None."""
    if not all(t.is_cuda for t in tensors):
        return None
    return load_op(spec.name)


# ---------------------------------------------------------------------------------------------
# Decode attention
# ---------------------------------------------------------------------------------------------


def _decode_attention_shape_reason(dtype: torch.dtype, head_dim: int, batch: int) -> str | None:
    """Why the CUDA op cannot take a cache of this dtype, head size and batch, or None."""
    if dtype not in _HALF_DTYPES:
        return f"dtype {dtype} (float16 or bfloat16 only)"
    if head_dim not in DECODE_ATTENTION_HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {DECODE_ATTENTION_HEAD_DIMS})"
    if batch > 65535:
        return f"batch {batch} > 65535"
    return None


_DECODE_TILE, _DECODE_MAX_SPLITS, _DECODE_BLOCKS_PER_SM = 128, 128, 2  # decode_attention.cu's kTile, ...


def decode_attention_splits(batch: int, heads: int, kv_heads: int, seq_len: int, sm_count: int) -> int:
    """How many splits of the sequence the CUDA op runs (csrc's `decode_attention_plan`, mirrored):
    enough blocks to fill the GPU, one tile of 128 keys at least per split; more than one runs the
    merge kernel. The self-tests' shapes are checked against it (tests/test_op_selftests.py)."""
    group = heads // kv_heads
    chunk = next((c for c in (8, 4, 2) if group % c == 0), 1)
    base_blocks = batch * kv_heads * (group // chunk)
    tiles = max(1, -(-seq_len // _DECODE_TILE))
    wanted = -(-(_DECODE_BLOCKS_PER_SM * sm_count) // max(1, base_blocks))
    splits = min(max(wanted, 1), min(tiles, _DECODE_MAX_SPLITS))
    split_len = -(-tiles // splits) * _DECODE_TILE
    return max(1, -(-seq_len // split_len))


def selective_log_softmax_vectorised(logits: torch.Tensor) -> bool:
    """Whether the CUDA op reads these logits with 16-byte vector loads (csrc's launch condition,
    mirrored): an aligned start, and a vocabulary and row strides that are multiples of 16 bytes."""
    vec = 16 // logits.element_size()
    return (logits.data_ptr() % 16 == 0 and logits.shape[-1] % vec == 0
            and logits.stride(0) % vec == 0 and logits.stride(1) % vec == 0)


def decode_attention_kernel_unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, batch: int
) -> str | None:
    """Why `decode_attention` would not run its CUDA op for a KV cache of these properties (a
    contiguous [B, Hkv, S, D] buffer, as FastLlamaDecoder's), or None when it will; builds the
    op on first use."""
    if not generation_kernels_enabled():
        return "generation kernels are turned off (generation_kernels(False))"
    if device.type != "cuda":
        return f"the cache is on {device.type}, not CUDA"
    reason = _decode_attention_shape_reason(dtype, head_dim, batch)
    if reason is None and load_op(DECODE_ATTENTION_OP.name) is None:
        reason = "the rlhf_decode_attention op could not be built (see the warning above)"
    return reason


def _decode_attention_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when the CUDA op accepts these tensors, else why not."""
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"dtype {q.dtype}/{k_cache.dtype}/{v_cache.dtype} (one dtype for q, keys and values)"
    reason = _decode_attention_shape_reason(q.dtype, q.shape[-1], q.shape[0])
    if reason is not None:
        return reason
    for t in (k_cache, v_cache):
        # 16-byte vector loads of K rows need aligned row starts.
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
            return "KV cache rows not contiguous and 16-byte aligned"
    if q.stride(-1) != 1:
        return "q head dimension not contiguous"
    return None


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths_or_mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """`decode_attention_reference` semantics; the CUDA flash-decoding op when available."""
    if q.dim() not in (3, 4) or (q.dim() == 4 and q.shape[2] != 1):
        raise ValueError(f"decode_attention: q must be [B, H, D] or [B, H, 1, D], got {tuple(q.shape)}")
    op = _cuda_op(DECODE_ATTENTION_OP, q, k_cache, v_cache, lengths_or_mask) if generation_kernels_enabled() else None
    if op is not None:
        reason = _decode_attention_supported(q, k_cache, v_cache)
        if reason is not None:
            _warn_once(f"decode_attention:{reason}", f"decode_attention: CUDA op skipped ({reason}); using the PyTorch reference")
            op = None
    if op is None:
        return decode_attention_reference(q, k_cache, v_cache, lengths_or_mask, scale)
    squeeze = q.dim() == 4
    q3 = q.squeeze(2) if squeeze else q
    scale = q3.shape[-1] ** -0.5 if scale is None else scale
    batch, cache_len = q3.shape[0], k_cache.shape[2]
    if lengths_or_mask.dtype == torch.bool:
        mask = key_mask(lengths_or_mask, batch, cache_len)
        out = op.decode_attention(q3, k_cache, v_cache, None, mask, mask.shape[1], float(scale))
    else:
        check_lengths(lengths_or_mask, batch)
        out = op.decode_attention(q3, k_cache, v_cache, lengths_or_mask, None, cache_len, float(scale))
    return out.unsqueeze(2) if squeeze else out


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def sample_tokens(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None, uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample_tokens_reference` semantics; the fused CUDA kernel when available.

    Randomness comes from `uniform` [B] (float32, on the logits' device) or, when None, from
    `torch.rand(..., generator=generator)` on the device, exactly as the reference draws it, so
    no step waits for the host and a seeded generator gives the same tokens on either path.
    """
    op = _cuda_op(SAMPLING_OP, logits) if generation_kernels_enabled() else None
    if op is None or logits.stride(-1) != 1 or logits.shape[-1] >= 2**31:
        return sample_tokens_reference(logits, temperature, top_k, top_p, uniform, generator)
    check_sampling_args(logits, top_k, top_p)
    if not temperature > 0:  # greedy: the kernel never reads the uniforms
        uniform = logits.new_zeros(logits.shape[0], dtype=torch.float32)
    elif uniform is None:
        uniform = torch.rand(logits.shape[0], device=logits.device, dtype=torch.float32, generator=generator)
    return op.sample_tokens(logits, uniform.float(), float(temperature), int(top_k), float(top_p))


# ---------------------------------------------------------------------------------------------
# Selective log-softmax (forward only; rlhf.engine.logprobs owns the autograd function)
# ---------------------------------------------------------------------------------------------


def fused_selective_log_softmax_forward(
    logits: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log p(index) [B, T], logsumexp [B, T]) in fp32 from the CUDA op, or None without it.

    logits [B, T, V] may be any strided view with a contiguous last dimension (such as
    logits[:, :-1]); index [B, T] integer.
    """
    op = _cuda_op(SELECTIVE_LOG_SOFTMAX_OP, logits, index)
    if op is None or logits.dim() != 3 or logits.stride(-1) != 1 or logits.shape[-1] >= 2**31:
        return None
    if logits.dtype not in (*_HALF_DTYPES, torch.float32):
        return None
    logp, lse = op.selective_log_softmax_forward(logits, index)
    return logp, lse


__all__ = [
    "DECODE_ATTENTION_HEAD_DIMS", "DECODE_ATTENTION_OP", "SAMPLING_OP", "SELECTIVE_LOG_SOFTMAX_OP", "decode_attention",
    "decode_attention_kernel_unsupported_reason", "decode_attention_splits", "fused_selective_log_softmax_forward",
    "sample_tokens", "selective_log_softmax_vectorised",
]
