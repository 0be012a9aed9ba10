"""Attention of one new query token per sequence over a static KV cache: the reference.

`decode_attention_reference` defines the semantics of every decode-attention fast path (the CUDA
flash-decoding op, engine/backends/cuda/kernels.py): grouped-query attention over a [B, Hkv, S, D]
cache under per-sequence lengths or a key padding mask, never reading a masked slot.
"""

from __future__ import annotations

import torch


def check_lengths(lengths: torch.Tensor, batch: int) -> None:
    if lengths.dim() != 1 or lengths.shape[0] != batch or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(
            f"decode_attention: lengths must be an integer tensor of shape [batch={batch}], "
            f"got {lengths.dtype} {tuple(lengths.shape)}"
        )


def key_mask(lengths_or_mask: torch.Tensor, batch: int, cache_len: int) -> torch.Tensor:
    """[B, S'] bool: which cache positions each sequence attends to (S' <= cache_len)."""
    if lengths_or_mask.dtype == torch.bool:
        if lengths_or_mask.dim() != 2 or lengths_or_mask.shape[0] != batch or lengths_or_mask.shape[1] > cache_len:
            raise ValueError(
                f"decode_attention: a key mask must be [batch={batch}, <= cache_len={cache_len}], "
                f"got {tuple(lengths_or_mask.shape)}"
            )
        return lengths_or_mask
    check_lengths(lengths_or_mask, batch)
    positions = torch.arange(cache_len, device=lengths_or_mask.device)
    return positions[None, :] < lengths_or_mask[:, None]


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths_or_mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention of one new query token per sequence over a KV cache, in fp32.

    q: [B, H, D] or [B, H, 1, D]. k_cache, v_cache: [B, Hkv, S, D] with H a multiple of Hkv;
    query head h reads KV head h // (H // Hkv), as Hugging Face's `repeat_kv` does.
    lengths_or_mask: integer [B] (sequence b attends to positions < lengths[b]) or bool
    [B, S'] with S' <= S (attends to positions < S' where True; left padding is False).
    scale: softmax scale, default 1 / sqrt(D). Returns q's shape and dtype. Masked positions
    are never read (a stale or NaN cache slot cannot leak in); a sequence with no attended
    position gets zeros.
    """
    squeeze = q.dim() == 4
    q3 = q.squeeze(2) if squeeze else q
    batch, heads, head_dim = q3.shape
    kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(f"decode_attention: num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    scale = head_dim**-0.5 if scale is None else scale
    valid = key_mask(lengths_or_mask, batch, cache_len)
    used = valid.shape[1]
    keys = k_cache[:, :, :used].float()
    values = v_cache[:, :, :used].float().masked_fill(~valid[:, None, :, None], 0.0)
    grouped_q = q3.float().reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bkgd,bksd->bkgs", grouped_q, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid.any(dim=-1)[:, None, None, None], probs, 0.0)
    out = torch.einsum("bkgs,bksd->bkgd", probs, values).reshape(batch, heads, head_dim).to(q.dtype)
    return out.unsqueeze(2) if squeeze else out


__all__ = ["decode_attention_reference", "key_mask"]
