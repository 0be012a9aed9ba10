"""engine/attention.py: one SDPA call pattern per device under a mask, the same attention either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.engine import attention
from rlhf.engine.attention import masked_attention, shares_kv_heads


def _inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=gen)
    k, v = torch.randn(2, 2, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False
    mask |= torch.eye(5, dtype=torch.bool)
    return tuple(t.to(device) for t in (q, k, v, mask))


def test_shared_and_repeated_kv_heads_attend_alike() -> None:
    q, k, v, mask = _inputs()
    shared = masked_attention(q, k, v, mask, 0.25)
    repeated = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                              attn_mask=mask, scale=0.25)
    torch.testing.assert_close(shared, repeated)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_gqa_with_a_mask_off_the_cpu(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU ("meta" stands in for CUDA here) a masked call gets repeated KV heads and no enable_gqa."""
    seen: list[tuple[int, bool]] = []

    def spy(query, key, value, **kwargs):
        seen.append((key.shape[1], kwargs["enable_gqa"]))
        return torch.empty_like(query)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    q, k, v, mask = _inputs(device)
    masked_attention(q, k, v, mask, 0.25)
    masked_attention(q, k, v, None, 0.25, is_causal=True)
    if device == "cpu":
        assert seen == [(2, True), (2, True)]
    else:
        assert seen == [(8, False), (2, True)]
    assert shares_kv_heads(torch.device("cuda"), has_mask=False) and not shares_kv_heads(torch.device("cuda"), True)
