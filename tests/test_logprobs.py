"""Chunked log-prob / entropy of token distributions: values and gradients equal the naive fp32
log-softmax, strided views are read in place or a chunk of whole batch rows at a time, and the peak
memory stays O(chunk * V)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rlhf.engine.logprobs import (
    SMALL_BATCH_ROW,
    _row_chunks,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    selective_log_softmax,
)

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
}


def naive_logprobs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _value_and_grad(fn, logits: torch.Tensor, *args, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_(True)
    out = fn(leaf, *args)
    (grad,) = torch.autograd.grad((out * weights).sum(), leaf)
    return out.detach(), grad


# rows = B * T of 1, 7 and 1023 (as [1, 1], [1, 7], [3, 341]) x vocab 1, 7, 1023, 32003 x dtypes;
# the largest (1023 x 32003) runs in bf16 only to keep the CPU suite fast.
CASES = [
    (shape, vocab, dtype)
    for shape in [(1, 1), (1, 7), (3, 341)]
    for vocab in [1, 7, 1023, 32003]
    for dtype in [torch.float32, torch.bfloat16, torch.float16]
    if not (shape == (3, 341) and vocab == 32003 and dtype != torch.bfloat16)
]


@pytest.mark.parametrize("shape,vocab,dtype", CASES, ids=[f"{s[0]}x{s[1]}-V{v}-{str(d)[6:]}" for s, v, d in CASES])
def test_selective_log_softmax_matches_naive(shape: tuple[int, int], vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab * 31 + shape[1])
    logits = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
    index = torch.randint(0, vocab, shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    # chunk_size 5 does not divide 7 or 1023 rows: the ragged last chunk is exercised.
    got, got_grad = _value_and_grad(selective_log_softmax, logits, index, 5, weights=weights)
    want, want_grad = _value_and_grad(naive_logprobs, logits, index, weights=weights)
    assert got.dtype == torch.float32 and got.shape == shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad, **TOL[dtype])


def test_default_chunk_and_single_chunk_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 300, generator=gen)
    index = torch.randint(0, 300, (4, 9), generator=gen)
    want = naive_logprobs(logits, index)
    for chunk in (None, 1, 36, 1000):
        torch.testing.assert_close(selective_log_softmax(logits, index, chunk), want)


def test_hand_computed_values() -> None:
    # logits log([1, 2, 5]) -> probabilities 1/8, 2/8, 5/8.
    logits = torch.tensor([[1.0, 2.0, 5.0]]).log()
    index = torch.tensor([2])
    got = selective_log_softmax(logits, index)
    torch.testing.assert_close(got, torch.tensor([0.625]).log())
    (grad,) = torch.autograd.grad(selective_log_softmax(logits.requires_grad_(), index).sum(), logits)
    # d log p_2 / d x = onehot(2) - p
    torch.testing.assert_close(grad, torch.tensor([[-0.125, -0.25, 0.375]]))


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    index = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index, 2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits_chunked(x, 4), (logits,))


def test_leading_dims_and_index_dtypes() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 4, 11, generator=gen)
    index = torch.randint(0, 11, (2, 3, 4), generator=gen)
    torch.testing.assert_close(selective_log_softmax(logits, index.int(), 5), naive_logprobs(logits, index))
    flat = logits[0, 0]  # [4, 11]
    torch.testing.assert_close(selective_log_softmax(flat, index[0, 0]), naive_logprobs(flat, index[0, 0]))
    with pytest.raises(ValueError, match="index shape"):
        selective_log_softmax(logits, index[..., :2])


def test_logprobs_from_logits_shift_reads_views_in_place() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 13, generator=gen, dtype=torch.bfloat16)
    ids = torch.randint(0, 13, (3, 6), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    got, grad = _value_and_grad(logprobs_from_logits, logits, ids, 4, weights=weights)
    want, want_grad = _value_and_grad(lambda x, i: naive_logprobs(x[:, :-1], i[:, 1:]), logits, ids, weights=weights)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad, **TOL[torch.bfloat16])
    assert torch.all(grad[:, -1] == 0)  # the last position predicts nothing
    # The shifted view cannot be flattened without a copy: chunks must still share its storage.
    shifted = logits[:, :-1]
    chunks = list(_row_chunks(shifted, 4))
    assert all(c.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for c, _, _ in chunks)
    assert sorted((r0, r1) for _, r0, r1 in chunks) == [(0, 4), (4, 5), (5, 9), (9, 10), (10, 14), (14, 15)]


def test_strided_logits_copy_whole_batch_rows_per_chunk() -> None:
    """A strided input whose small batch rows fit a chunk is copied a few whole batch rows at a time
    (one op per chunk, not per batch row), with the same values and gradients; batch rows of more
    than SMALL_BATCH_ROW logits (a large vocabulary) are still read in place."""
    large = torch.zeros(2, 9, SMALL_BATCH_ROW // 8 + 1)[:, :-1]  # 8 positions: just over the limit
    views = list(_row_chunks(large, 13))
    assert [(r0, r1) for _, r0, r1 in views] == [(0, 8), (8, 16)]
    assert all(c.untyped_storage().data_ptr() == large.untyped_storage().data_ptr() for c, _, _ in views)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 7, 11, generator=gen)
    ids = torch.randint(0, 11, (5, 7), generator=gen)
    weights = torch.randn(5, 6, generator=gen)
    chunks = list(_row_chunks(logits[:, :-1], 13))  # 6 positions per batch row: 2 batch rows per chunk
    assert [(r0, r1) for _, r0, r1 in chunks] == [(0, 12), (12, 24), (24, 30)]
    for chunk, r0, r1 in chunks:
        torch.testing.assert_close(chunk, logits[:, :-1].reshape(-1, 11)[r0:r1])
    got, grad = _value_and_grad(logprobs_from_logits, logits, ids, 13, weights=weights)
    want, want_grad = _value_and_grad(lambda x, i: naive_logprobs(x[:, :-1], i[:, 1:]), logits, ids, weights=weights)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
    got, grad = _value_and_grad(lambda x: entropy_from_logits_chunked(x[:, :-1], 13), logits, weights=weights)
    want, want_grad = _value_and_grad(lambda x: naive_entropy(x[:, :-1]), logits, weights=weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_naive(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 7, 1023, generator=gen) * 2).to(dtype)
    weights = torch.randn(3, 7, generator=gen)
    got, grad = _value_and_grad(entropy_from_logits_chunked, logits, 5, weights=weights)
    want, want_grad = _value_and_grad(naive_entropy, logits, weights=weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, **TOL[dtype])


def test_entropy_hand_computed_and_masked_vocab() -> None:
    # Two equally likely tokens and two removed (-inf): entropy log 2, no NaN in value or grad.
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]], requires_grad=True)
    ent = entropy_from_logits_chunked(logits)
    torch.testing.assert_close(ent.detach(), torch.tensor([2.0]).log())
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.zeros_like(grad))  # uniform over survivors is a stationary point
    # p = (0.2, 0.8): H = -(0.2 log 0.2 + 0.8 log 0.8)
    logits = torch.tensor([0.2, 0.8]).log()
    expected = -(0.2 * math.log(0.2) + 0.8 * math.log(0.8))
    torch.testing.assert_close(entropy_from_logits_chunked(logits), torch.tensor(expected))


_MEMORY_PROBE = r"""
import json, sys
import torch
from rlhf.engine.logprobs import selective_log_softmax

def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB

def reset_peak():
    # Linux >= 4.0: "5" resets VmHWM (peak RSS) to the current RSS. Unlike getrusage's maxrss,
    # VmHWM does not inherit the parent's peak across fork + exec.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")

mode, rows, vocab, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
logits = torch.empty(1, rows, vocab, dtype=torch.bfloat16).uniform_(-4, 4).requires_grad_(True)
index = torch.randint(0, vocab, (1, rows))
warm = torch.zeros(1, 4, 8, requires_grad=True)  # first-call allocations (thread pools, autograd)
selective_log_softmax(warm, torch.zeros(1, 4, dtype=torch.long)).sum().backward()
torch.log_softmax(warm.float(), -1).sum().backward()

base = reset_peak()
if mode == "chunked":
    out = selective_log_softmax(logits, index, chunk_size=chunk)
else:
    out = torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
forward = status_bytes("VmHWM") - base  # the graph (and what it saved) is still alive here
out.sum().backward()
backward = status_bytes("VmHWM") - base
print(json.dumps({"forward": forward, "backward": backward}))
"""


def _peak_memory(mode: str, rows: int, vocab: int, chunk: int) -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, mode, str(rows), str(vocab), str(chunk)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_chunked_vs_naive() -> None:
    """Peak resident memory of forward (graph alive) and backward, measured in fresh processes."""
    rows, vocab, chunk = 2048, 32000, 16
    fp32_bytes = rows * vocab * 4  # 262 MB: one fp32 copy of the logits
    chunked = _peak_memory("chunked", rows, vocab, chunk)
    naive = _peak_memory("naive", rows, vocab, chunk)
    # Naive: the fp32 upcast and the saved fp32 log-softmax are both whole-tensor sized.
    assert naive["forward"] > 1.5 * fp32_bytes, naive
    # Chunked: a few 2 MB chunk temporaries (measured 4-12 MB), far below one fp32 copy.
    assert chunked["forward"] < 0.1 * fp32_bytes, chunked
    # Backward must produce the bf16 gradient (fp32_bytes / 2); nothing else of that size.
    assert chunked["backward"] < 0.65 * fp32_bytes, chunked
    assert naive["backward"] > 2.5 * chunked["backward"], (naive, chunked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fused_forward_matches_naive(dtype: torch.dtype) -> None:
    from rlhf.engine.backends.cuda.kernels import SELECTIVE_LOG_SOFTMAX_OP
    from rlhf.engine.ops import load_op

    assert load_op(SELECTIVE_LOG_SOFTMAX_OP.name) is not None, "the fused op must build on a GPU machine"
    gen = torch.Generator(device="cuda").manual_seed(5)
    for batch, time, vocab in [(1, 2, 1), (1, 8, 7), (3, 342, 1023), (2, 65, 32003), (2, 33, 32000)]:
        logits = (torch.randn(batch, time, vocab, device="cuda", generator=gen) * 3).to(dtype)
        ids = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
        weights = torch.randn(batch, time - 1, device="cuda", generator=gen)
        got, grad = _value_and_grad(logprobs_from_logits, logits, ids, 16, weights=weights)
        want, want_grad = _value_and_grad(lambda x, i: naive_logprobs(x[:, :-1], i[:, 1:]), logits, ids, weights=weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
        torch.testing.assert_close(grad, want_grad, **TOL[dtype])
