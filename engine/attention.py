"""Attention under an explicit mask, with grouped-query heads, the way each device serves it fast.

    out = masked_attention(q, k, v, mask, scale)   # q [B, H, T, D], k/v [B, Hkv, S, D]

`scaled_dot_product_attention(..., enable_gqa=True)` shares each KV head among its query heads
without copying it. On the CPU that is the fast path under a mask too. On CUDA, SDPA's flash and
memory-efficient kernels take no `enable_gqa` together with an explicit mask: it falls back to the
math kernel, which materialises the [B, H, T, S] scores (and keeps them for backward) — every
padded batch of a GQA model. There the KV heads are repeated instead, so the efficient kernels
run. Hugging Face's own SDPA attention makes the same choice (`use_gqa_in_sdpa`).

This is the one place that passes `enable_gqa` (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_attention", "shares_kv_heads"]


def shares_kv_heads(device: torch.device, has_mask: bool) -> bool:
    """Whether SDPA on `device` is asked to share KV heads itself (`enable_gqa`) rather than given
    repeated ones: on the CPU always, elsewhere only without a mask."""
    return device.type == "cpu" or not has_mask


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, is_causal: bool = False) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over k, v [B, Hkv, S, D] (H a multiple of Hkv) under `mask` (boolean,
    True = visible, or additive; broadcastable to [B, H, T, S]) -> [B, H, T, D]."""
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1
    if gqa and not shares_kv_heads(query.device, mask is not None):
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, is_causal=is_causal,
                                          enable_gqa=gqa)
