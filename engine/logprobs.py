"""Log-probabilities and entropies of token distributions without an fp32 [B, T, V] copy.

`log_softmax(logits.float()).gather(...)` holds two fp32 tensors of the whole logits' size (the
upcast and the log-softmax, which autograd keeps for backward): for 64 x 2048 tokens and a
152k vocabulary that is 80 GB each. Here rows (B*T) are processed in chunks: each chunk is
upcast, its log-sum-exp taken and the chosen logit gathered, so the extra memory is
O(chunk * V) in fp32 and only [B, T] log-sum-exps are kept for backward, which recomputes the
softmax chunk by chunk. The gradient itself has the logits' size and dtype, as any backward
through logits must.

On CUDA the forward is one fused kernel (csrc/generation/selective_log_softmax.cu, online
log-sum-exp, no fp32 chunk at all) when it is built; the backward stays in chunked torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from rlhf.engine.backends.registry import backend_for

SMALL_BATCH_ROW = 2**16
"""Logits in one batch row ([T, V]) up to which a strided input's rows are copied a chunk at a time
rather than walked as views (a tiny model's [64, 98] row: the copy is microseconds; a 49k
vocabulary's row is megabytes, which its view reads in place)."""
DEFAULT_CHUNK_BYTES = 128 * 2**20
"""fp32 working set per chunk when no chunk size is given: rows = this // (4 * vocab)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every floating dtype except fp64, which stays fp64 (for gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (rows per chunk), got {chunk_size}")
        return chunk_size
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(vocab, 1)))


def _row_chunks(logits: torch.Tensor, rows: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """(chunk [n, V], r0, r1) covering the rows of [B, T, V] logits, r = b * T + t.

    Views where the rows flatten; a strided input such as logits[:, :-1] cannot be flattened to
    [B*T, V] without a copy, so it is walked one batch row at a time, except where a batch row is
    small (at most SMALL_BATCH_ROW logits): there whole batch rows are copied a chunk at a time (at
    most `rows` rows), as copying them costs less than a batch row's handful of small ops.
    """
    batch, time, vocab = logits.shape
    try:
        flat = logits.view(batch * time, vocab)
    except RuntimeError:
        flat = None
    if flat is not None:
        for r0 in range(0, batch * time, rows):
            r1 = min(r0 + rows, batch * time)
            yield flat[r0:r1], r0, r1
        return
    per_chunk = rows // max(time, 1)
    if per_chunk >= 1 and time * vocab <= SMALL_BATCH_ROW:
        for b0 in range(0, batch, per_chunk):
            b1 = min(b0 + per_chunk, batch)
            yield logits[b0:b1].reshape(-1, vocab), b0 * time, b1 * time
        return
    for b in range(batch):
        for t0 in range(0, time, rows):
            t1 = min(t0 + rows, time)
            yield logits[b, t0:t1], b * time + t0, b * time + t1


def _to_3d(logits: torch.Tensor, index_shape: torch.Size) -> torch.Tensor:
    """[..., V] logits as [B, T, V] (a view whenever the leading dims allow one)."""
    vocab = logits.shape[-1]
    if logits.dim() == 3:
        return logits
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 1:
        return logits.view(1, 1, vocab)
    return logits.reshape(-1, index_shape[-1], vocab)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[index] per row, fp32; backward recomputes softmax per chunk."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        batch, time, _ = logits.shape
        fused = backend_for(logits.device).selective_log_softmax(logits, index)
        if fused is not None:
            logp, lse = fused
        else:
            flat_index = index.reshape(-1, 1)
            compute = _compute_dtype(logits.dtype)
            logp = torch.empty(batch * time, dtype=compute, device=logits.device)
            lse = torch.empty_like(logp)
            for chunk, r0, r1 in _row_chunks(logits, rows):
                x = chunk.to(compute)
                chunk_lse = torch.logsumexp(x, dim=-1)
                lse[r0:r1] = chunk_lse
                logp[r0:r1] = x.gather(-1, flat_index[r0:r1]).squeeze(-1) - chunk_lse
            logp, lse = logp.view(batch, time), lse.view(batch, time)
        ctx.save_for_backward(logits, index, lse)
        ctx.rows = rows
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logp: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, index, lse = ctx.saved_tensors
        batch, time, vocab = logits.shape
        grad = torch.empty((batch, time, vocab), dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(batch * time, vocab)
        compute = _compute_dtype(logits.dtype)
        go = grad_logp.reshape(-1, 1).to(compute)
        flat_index = index.reshape(-1, 1)
        flat_lse = lse.reshape(-1, 1)
        for chunk, r0, r1 in _row_chunks(logits, ctx.rows):
            # d logp / d x = onehot(index) - softmax(x); copy=True so fp32 logits stay untouched.
            g = chunk.to(compute, copy=True)
            g.sub_(flat_lse[r0:r1]).exp_().mul_(-go[r0:r1])
            g.scatter_add_(1, flat_index[r0:r1], go[r0:r1])
            grad_flat[r0:r1].copy_(g)
        return grad, None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """log_softmax(logits, -1).gather(-1, index[..., None])[..., 0] in fp32 (fp64 for fp64 logits).

    logits [..., V] in float32/bfloat16/float16 (strided views such as logits[:, :-1] are read
    in place); index [...] integer ids in [0, V). chunk_size is rows per chunk (default: about
    DEFAULT_CHUNK_BYTES of fp32 per chunk). Differentiable with respect to logits.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"selective_log_softmax: index shape {tuple(index.shape)} != logits shape "
                         f"{tuple(logits.shape)} without its last dimension")
    logits3d = _to_3d(logits, index.shape)
    index2d = index.reshape(logits3d.shape[:2]).long().contiguous()
    rows = _rows_per_chunk(logits.shape[-1], chunk_size)
    return _SelectiveLogSoftmax.apply(logits3d, index2d, rows).reshape(index.shape)


def logprobs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) from a causal LM's [B, T, V] logits.

    Returns [B, T - 1] fp32: position t scores the token that follows it. No copy of the
    shifted logits is made.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logprobs_from_logits: logits {tuple(logits.shape)} must be [B, T, V] "
                         f"for input_ids {tuple(input_ids.shape)}")
    return selective_log_softmax(logits[:, :-1], input_ids[:, 1:], chunk_size)


class _ChunkedEntropy(torch.autograd.Function):
    """H = -sum_i p_i log p_i per row, fp32; dH/dx_i = -p_i (log p_i + H).

    Written over x - max(x) (log p_i = x_i - max - logsumexp(x - max)), so large logits do not
    cancel: logsumexp(x) - sum_i p_i x_i would lose H in the rounding of two numbers near max(x).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, rows: int) -> torch.Tensor:
        batch, time, _ = logits.shape
        compute = _compute_dtype(logits.dtype)
        entropy = torch.empty(batch * time, dtype=compute, device=logits.device)
        shifts = torch.empty_like(entropy)
        shifted_lse = torch.empty_like(entropy)
        for chunk, r0, r1 in _row_chunks(logits, rows):
            x = chunk.to(compute)
            row_max = x.amax(dim=-1, keepdim=True)
            shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
            chunk_lse = torch.logsumexp(x - shift, dim=-1, keepdim=True)
            log_p = x - shift - chunk_lse
            p = torch.exp(log_p)
            # -inf logits have p = 0; 0 * -inf would be NaN, their true contribution is 0.
            entropy[r0:r1] = -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)
            shifts[r0:r1] = shift.squeeze(-1)
            shifted_lse[r0:r1] = chunk_lse.squeeze(-1)
        ctx.save_for_backward(logits, shifts, shifted_lse, entropy)
        ctx.rows = rows
        return entropy.view(batch, time)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, shifts, shifted_lse, entropy = ctx.saved_tensors
        batch, time, vocab = logits.shape
        grad = torch.empty((batch, time, vocab), dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(batch * time, vocab)
        go = grad_entropy.reshape(-1, 1).to(entropy.dtype)
        shifts, shifted_lse, entropy = shifts[:, None], shifted_lse[:, None], entropy[:, None]
        for chunk, r0, r1 in _row_chunks(logits, ctx.rows):
            log_p = chunk.to(entropy.dtype) - shifts[r0:r1] - shifted_lse[r0:r1]
            p = torch.exp(log_p)
            g = torch.where(p > 0, p * (log_p + entropy[r0:r1]), 0.0).mul_(-go[r0:r1])
            grad_flat[r0:r1].copy_(g)
        return grad, None


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, fp32 [...], chunked like
    `selective_log_softmax` (no fp32 copy of the whole logits). Differentiable.

    The project's one entropy function (PPO's entropy bonus and metric): -inf logits (top-k/top-p
    masking) contribute 0 instead of NaN, and huge logits keep their precision.
    """
    leading = logits.shape[:-1]
    logits3d = _to_3d(logits, leading if len(leading) else torch.Size([1]))
    rows = _rows_per_chunk(logits.shape[-1], chunk_size)
    return _ChunkedEntropy.apply(logits3d, rows).reshape(leading)


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SMALL_BATCH_ROW",
    "entropy_from_logits_chunked",
    "logprobs_from_logits",
    "selective_log_softmax",
]
