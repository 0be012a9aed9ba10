"""Load-time self-tests of the CUDA backend's generation ops (engine/op_selftests.py says what a
self-test is): decode attention against `decode_attention_reference`, the sampler against
`sample_tokens_reference`, selective log-softmax against torch's log-softmax. They run where an op
is loaded for a CUDA device; tests/test_op_selftests.py runs them on the CPU against the references.
The backend package registers them with their ops (engine/backends/cuda/__init__.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from rlhf.engine.backends.cuda.kernels import DECODE_ATTENTION_HEAD_DIMS
from rlhf.engine.decode_attention import decode_attention_reference
from rlhf.engine.op_selftests import OpMismatch, Worst
from rlhf.engine.sampling import draw_explained_by_rounding, sample_tokens_reference

SAMPLING_SETTINGS = ((1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.8, 40, 0.95))
"""(temperature, top_k, top_p) of the sampler checks: plain, top-k, top-p, both."""


def _left_padded_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    positions = torch.arange(width, device=lengths.device)
    return positions[None, :] >= (width - lengths)[:, None]


DECODE_ATTENTION_CASES = ((3, 4, 2, 37), (2, 8, 1, 700), (1, 12, 4, 2100), (2, 32, 4, 300))
"""(batch, heads, kv_heads, context) of the decode-attention checks: one split at a short context, and
long contexts that `decode_attention_splits` cuts into several splits (the merge kernel) on any GPU,
over GQA groups of 2, 8, 3 (no query chunk) and 8 (Llama-3's 32/4)."""

SELECTIVE_LOG_SOFTMAX_SHAPES = ((1, 1, 1), (2, 9, 1031), (2, 5, 4096))
"""(batch, time, vocab) of the log-softmax checks: odd vocabularies take the op's scalar loads, a
multiple of 8 its 16-byte vector loads (`selective_log_softmax_vectorised`)."""


def decode_attention_self_test(module: ModuleType, device: torch.device) -> str:
    """Every head size the op is built for, fp16 and bf16, GQA, per-row lengths and left-padding
    masks, one split and several (`DECODE_ATTENTION_CASES`), with NaN in the stale cache slots (a
    kernel that reads them fails)."""
    worst = Worst()
    gen = torch.Generator().manual_seed(1)
    for batch, heads, kv_heads, context in DECODE_ATTENTION_CASES:
        lengths = torch.tensor([context, 1, context // 2][:batch], device=device)
        mask = _left_padded_mask(lengths, context)
        for dtype in (torch.bfloat16, torch.float16):
            for head_dim in DECODE_ATTENTION_HEAD_DIMS:
                k = torch.randn(batch, kv_heads, context + 5, head_dim, generator=gen).to(device, dtype)
                v = torch.randn(batch, kv_heads, context + 5, head_dim, generator=gen).to(device, dtype)
                k[:, :, context:] = float("nan")
                v[:, :, context:] = float("nan")
                q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
                scale = head_dim**-0.5
                for name, by_length, by_mask, used in (("lengths", lengths, None, k.shape[2]),
                                                       ("mask", None, mask, context)):
                    got = module.decode_attention(q, k, v, by_length, by_mask, used, float(scale))
                    want = decode_attention_reference(q.float(), k.float(), v.float(),
                                                      mask if by_mask is not None else lengths)
                    tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
                    worst.close(f"decode_attention {dtype} {heads}/{kv_heads} heads context={context} "
                                f"head_dim={head_dim} by {name}", got, want, rtol=1e-2, atol=tol)
    return worst.summary()


def sampling_self_test(module: ModuleType, device: torch.device) -> str:
    """Greedy equals argmax; sampled tokens equal `sample_tokens_reference` from the same
    uniforms except where a uniform falls within rounding of a CDF step's edge."""
    gen = torch.Generator().manual_seed(2)
    rows = 0
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (7, 1031):
            logits = (4 * torch.randn(16, vocab, generator=gen)).to(device, dtype)
            logits[:, 0] = logits.max(dim=-1).values  # a tie at the top
            u = torch.rand(16, generator=gen).to(device)
            greedy = module.sample_tokens(logits, torch.zeros_like(u), 0.0, 0, 1.0)
            if not torch.equal(greedy.cpu(), torch.argmax(logits, dim=-1).cpu()):
                raise OpMismatch(f"sample_tokens {dtype} vocab={vocab}: greedy tokens differ from argmax")
            for setting in SAMPLING_SETTINGS:
                got = module.sample_tokens(logits, u, *setting).cpu()
                want = sample_tokens_reference(logits, *setting, uniform=u).cpu()
                for row in torch.nonzero(got != want).flatten().tolist():
                    if not draw_explained_by_rounding(logits[row].float().cpu(), *setting, u[row].item(), int(got[row])):
                        raise OpMismatch(f"sample_tokens {dtype} vocab={vocab} setting={setting} row {row}: "
                                         f"the op drew {int(got[row])}, the reference {int(want[row])}")
                rows += got.numel()
    return f"{rows} draws match"


def selective_log_softmax_self_test(module: ModuleType, device: torch.device) -> str:
    """log p(index) and logsumexp in fp32 for fp32/bf16/fp16 logits, contiguous and shifted
    (the logits[:, :-1] view every loss passes), through the op's scalar and vector loads."""
    worst = Worst()
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch, time, vocab in SELECTIVE_LOG_SOFTMAX_SHAPES:
            base = (5 * torch.randn(batch, time + 1, vocab, generator=gen)).to(device, dtype)
            index = torch.randint(0, vocab, (batch, time), generator=gen).to(device)
            for logits in (base[:, :time].contiguous(), base[:, 1:]):
                logp, lse = module.selective_log_softmax_forward(logits, index)
                want_lse = torch.logsumexp(logits.float(), dim=-1)
                want = logits.float().gather(-1, index[..., None]).squeeze(-1) - want_lse
                worst.close(f"selective_log_softmax {dtype} {tuple(logits.shape)} logsumexp", lse, want_lse,
                            rtol=1e-5, atol=1e-5)
                worst.close(f"selective_log_softmax {dtype} {tuple(logits.shape)} log-probs", logp, want,
                            rtol=1e-5, atol=5e-5)
    return worst.summary()


__all__ = ["DECODE_ATTENTION_CASES", "SELECTIVE_LOG_SOFTMAX_SHAPES", "decode_attention_self_test", "sampling_self_test",
           "selective_log_softmax_self_test"]
