"""Generation kernels, three ways:

- CPU: the PyTorch references against independent definitions (SDPA, Hugging Face's logits
  warpers, hand-computed draws).
- CPU, @pytest.mark.slow: the unmodified CUDA kernel sources built with g++ against
  csrc/generation/emulator (fibers for threads, barriers checked) and compared with the
  references, so kernel logic is tested on machines without a GPU.
- GPU, @pytest.mark.gpu: the JIT-built CUDA ops against their references over odd shapes
  (batch 1/7, GQA groups, head_dim 32-256, context 1..4099) and dtypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import random
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from rlhf.engine.backends.cuda import kernels
from rlhf.engine.backends.cuda.kernels import decode_attention, sample_tokens
from rlhf.engine.decode_attention import decode_attention_reference
from rlhf.engine.sampling import draw_explained_by_rounding, filter_logits_reference, sample_tokens_reference
from rlhf.engine.ops import CSRC_DIR, OpSpec, build_directory, load_op, op_report
from tests.test_generation import hf_warp

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Independent definition: torch SDPA with the KV heads expanded as repeat_kv does."""
    group = q.shape[1] // k.shape[1]
    used = mask.shape[1]
    k = k[:, :, :used].float().repeat_interleave(group, dim=1)
    v = v[:, :, :used].float().repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.squeeze(2)


def left_padded_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] mask of left-padded rows: the last lengths[b] positions are real."""
    positions = torch.arange(width, device=lengths.device)
    return positions[None, :] >= (width - lengths)[:, None]


# (batch, heads, kv_heads, head_dim, context)
ATTENTION_CASES = [
    (1, 4, 4, 64, 1),
    (7, 8, 2, 64, 7),
    (1, 6, 1, 128, 1023),
    (7, 12, 4, 32, 1023),
    (2, 8, 8, 128, 4099),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_reference_decode_attention_matches_sdpa(case: tuple[int, int, int, int, int]) -> None:
    batch, heads, kv_heads, head_dim, context = case
    gen = torch.Generator().manual_seed(sum(case))
    q = torch.randn(batch, heads, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, context + 3, head_dim, generator=gen)  # cache longer than context
    v = torch.randn(batch, kv_heads, context + 3, head_dim, generator=gen)
    lengths = torch.randint(1, context + 1, (batch,), generator=gen)
    lengths[0] = context
    # Per-sequence valid lengths (right-aligned cache filling).
    by_length = decode_attention_reference(q, k, v, lengths)
    want = sdpa_decode(q, k, v, torch.arange(context + 3)[None, :] < lengths[:, None])
    torch.testing.assert_close(by_length, want, rtol=1e-5, atol=1e-5)
    # Left-padded prompts: a key mask over the first `context` positions only.
    mask = left_padded_mask(lengths, context)
    by_mask = decode_attention_reference(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(by_mask, sdpa_decode(q, k, v, mask, scale=0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_decode_attention_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=gen).to(dtype) for s in [(3, 8, 64), (3, 2, 40, 64), (3, 2, 40, 64)])
    lengths = torch.tensor([40, 1, 17])
    out = decode_attention_reference(q.unsqueeze(2), k, v, lengths)
    assert out.shape == (3, 8, 1, 64) and out.dtype == dtype
    want = sdpa_decode(q, k, v, torch.arange(40)[None, :] < lengths[:, None]).to(dtype)
    torch.testing.assert_close(out.squeeze(2), want)


def test_reference_decode_attention_hand_computed_and_masking() -> None:
    # One head, D = 2, keys e0 and e1 with scale 1: weights softmax([q.e0, q.e1]).
    q = torch.tensor([[[math.log(3.0), 0.0]]])  # [1, 1, 2]
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]]])  # [1, 1, 3, 2]
    v = torch.tensor([[[[10.0, 0.0], [0.0, 10.0], [float("nan"), float("nan")]]]])
    out = decode_attention_reference(q, k, v, torch.tensor([2]), scale=1.0)
    # exp(log 3) : exp(0) = 3 : 1 -> 0.75 * v0 + 0.25 * v1; the NaN slot past the length is never read.
    torch.testing.assert_close(out, torch.tensor([[[7.5, 2.5]]]))
    masked = decode_attention_reference(q, k, v, torch.tensor([[False, True, False]]), scale=1.0)
    torch.testing.assert_close(masked, torch.tensor([[[0.0, 10.0]]]))
    # A sequence with nothing to attend to gets zeros, not NaN.
    empty = decode_attention_reference(q, k, v, torch.tensor([0]), scale=1.0)
    torch.testing.assert_close(empty, torch.zeros(1, 1, 2))


def test_decode_attention_validates_inputs_and_uses_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 32, generator=gen), torch.randn(2, 2, 9, 32, generator=gen), torch.randn(2, 2, 9, 32, generator=gen)
    lengths = torch.tensor([9, 4])
    torch.testing.assert_close(decode_attention(q, k, v, lengths), decode_attention_reference(q, k, v, lengths))
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, k, v, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="key mask"):
        decode_attention(q, k, v, torch.ones(2, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.randn(2, 3, 32), k, v, lengths)


def test_ops_are_registered() -> None:
    names = {row["name"]: row for row in op_report()}
    for spec in (kernels.DECODE_ATTENTION_OP, kernels.SAMPLING_OP, kernels.SELECTIVE_LOG_SOFTMAX_OP):
        assert names[spec.name]["needs_cuda"] is True
        assert all((CSRC_DIR / s).is_file() for s in spec.sources), spec.sources


# --------------------------------------------------------------------------------------------
# Sampling reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 50, 1.0), (0.8, 40, 0.95), (1.3, 0, 0.5), (1.0, 5, 0.3), (0.5, 1, 1.0)]
)
def test_filter_matches_hf_warpers_without_ties(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = torch.randn(32, 1000, generator=gen) * 3  # continuous values: no ties
    ours = filter_logits_reference(logits, temperature, top_k, top_p)
    theirs = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_filter_hand_computed_thresholds_and_ties() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    logits = probs.log()
    kept = lambda **kw: torch.isfinite(filter_logits_reference(logits, 1.0, **kw))[0].tolist()  # noqa: E731
    # Most to least likely, tied tokens by descending id (HF's order under a stable sort):
    # 0, 2, 1, 3 with mass before each 0, 0.5, 0.7, 0.9. Only part of the 0.2 tie survives 0.6.
    assert kept(top_p=0.6) == [True, False, True, False]
    assert kept(top_p=0.75) == [True, True, True, False]
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(top_p=0.0) == [True, False, False, False]  # the maximum always survives
    assert kept(top_k=2) == [True, True, True, False]  # ties with the k-th are kept
    assert kept(top_k=1) == [True, False, False, False]
    assert kept(top_k=3, top_p=0.95) == [True, True, True, False]  # top-p renormalises over top-k
    assert kept(top_k=4) == kept(top_k=0) == [True] * 4


def test_sample_hand_computed_draws() -> None:
    logits = torch.tensor([0.1, 0.2, 0.7]).log().expand(5, 3)
    u = torch.tensor([0.05, 0.15, 0.29, 0.31, 0.999])
    assert sample_tokens_reference(logits, uniform=u).tolist() == [0, 1, 1, 2, 2]
    # top_k=2 leaves (0.2, 0.7)/0.9: boundary at 0.2/0.9 = 0.222.
    assert sample_tokens_reference(logits, top_k=2, uniform=u).tolist() == [1, 1, 2, 2, 2]
    # u = 1 is outside [0, 1) but shows the rounding fallback: the last token with mass.
    edge = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert sample_tokens_reference(edge, uniform=torch.tensor([1.0])).tolist() == [1]


def test_sample_frequencies_equal_kept_probabilities() -> None:
    """Inverse CDF over an even grid of u: each token's share equals its renormalised probability."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 50, generator=gen) * 2
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.2, 0, 0.8), (1.0, 20, 0.9)]:
        tokens = sample_tokens_reference(logits.expand(n, 50), temperature, top_k, top_p, uniform=u)
        counts = torch.bincount(tokens, minlength=50).double() / n
        probs = torch.softmax(filter_logits_reference(logits, temperature, top_k, top_p).double(), -1)[0]
        assert (counts - probs).abs().max() <= 1.5 / n
        assert counts[probs == 0].sum() == 0


def test_sample_greedy_and_seeded_reproducibility() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    assert sample_tokens_reference(logits, temperature=0.0).tolist() == [1, 2]  # first max
    assert sample_tokens(logits, temperature=0.0).tolist() == [1, 2]
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    a = sample_tokens(logits, 0.9, 20, 0.9, generator=torch.Generator().manual_seed(3))
    b = sample_tokens_reference(logits, 0.9, 20, 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.dtype == torch.int64
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(logits, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        sample_tokens(logits, top_k=-1)


# --------------------------------------------------------------------------------------------
# CUDA parity (GPU only)
# --------------------------------------------------------------------------------------------


def _require_op(spec: OpSpec) -> None:
    assert load_op(spec.name) is not None, f"{spec.name} must build on a GPU machine (see the warning above)"


# The CPU cases plus larger head counts, every head size the op is built for, and odd contexts.
GPU_ATTENTION_CASES = [*ATTENTION_CASES, (1, 32, 8, 128, 1023), (7, 14, 2, 128, 1023), (1, 16, 1, 64, 4099),
                       (7, 12, 4, 128, 4099), (3, 4, 2, 32, 300), (2, 8, 2, 256, 777)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_ATTENTION_CASES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cuda_decode_attention_matches_reference(
    case: tuple[int, int, int, int, int], dtype: torch.dtype, layout: str
) -> None:
    _require_op(kernels.DECODE_ATTENTION_OP)
    batch, heads, kv_heads, head_dim, context = case
    gen = torch.Generator(device="cuda").manual_seed(sum(case))
    cache_len = context + 5
    shape = (batch, kv_heads, cache_len, head_dim) if layout == "bhsd" else (batch, cache_len, kv_heads, head_dim)
    k = torch.randn(*shape, device="cuda", generator=gen).to(dtype)
    v = torch.randn(*shape, device="cuda", generator=gen).to(dtype)
    if layout == "bshd":  # [B, S, Hkv, D] storage viewed as [B, Hkv, S, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    q = torch.randn(batch, heads + kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    q = q[:, :heads] if layout == "bshd" else q[:, :heads].contiguous()  # strided as FastLlamaDecoder's
    lengths = torch.randint(1, context + 1, (batch,), device="cuda", generator=gen)
    lengths[0] = context
    # Stale NaN past every length: a kernel that reads masked slots fails loudly.
    k[:, :, context:] = float("nan")
    v[:, :, context:] = float("nan")
    mask = left_padded_mask(lengths, context)
    for key_info in (lengths, mask, lengths.int()):
        got = decode_attention(q, k, v, key_info)
        want = decode_attention_reference(q.float(), k.float(), v.float(), key_info)
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.gpu
@requires_cuda
def test_cuda_decode_attention_edge_cases() -> None:
    _require_op(kernels.DECODE_ATTENTION_OP)
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 50, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # A zero length gives zeros; a 4-D query round-trips its shape; the cache prefix view works.
    lengths = torch.tensor([0, 50, 3], device="cuda")
    got = decode_attention(q.unsqueeze(2), k[:, :, :40], v[:, :, :40], lengths.clamp(max=40))
    want = decode_attention_reference(q.unsqueeze(2).float(), k[:, :, :40].float(), v[:, :, :40].float(), lengths.clamp(max=40))
    assert got.shape == (3, 4, 1, 64)
    assert torch.all(got[0] == 0)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


SAMPLING_SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 50, 1.0),
    (1.0, 0, 0.9),
    (0.8, 40, 0.95),
    (1.3, 1, 1.0),
    (1.0, 0, 0.0),
    (0.0, 0, 1.0),  # greedy
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 1023, 32003, 151936])
def test_cuda_sampling_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    _require_op(kernels.SAMPLING_OP)
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    for batch in (1, 7, 64):
        logits = (torch.randn(batch, vocab, device="cuda", generator=gen) * 4).to(dtype)
        logits[:, : min(3, vocab)] = logits.max(dim=-1, keepdim=True).values  # a three-way tie at the top
        u = torch.rand(batch, device="cuda", generator=gen)
        for setting in SAMPLING_SETTINGS:
            got = sample_tokens(logits, *setting, uniform=u)
            want = sample_tokens_reference(logits, *setting, uniform=u)
            assert got.dtype == torch.int64 and got.shape == (batch,)
            for row in torch.nonzero(got != want).flatten().tolist():
                assert draw_explained_by_rounding(logits[row].float(), *setting, u[row].item(), got[row].item()), (
                    f"row {row} setting {setting}: kernel {got[row].item()} reference {want[row].item()}"
                )


@pytest.mark.gpu
@requires_cuda
def test_cuda_sampling_distribution() -> None:
    _require_op(kernels.SAMPLING_OP)
    logits = torch.randn(1, 300, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 2
    n = 50000
    u = (torch.arange(n, device="cuda", dtype=torch.float64) + 0.5).div(n).float()
    for setting in [(1.0, 0, 1.0), (0.7, 30, 1.0), (1.0, 0, 0.8), (1.1, 50, 0.9)]:
        tokens = sample_tokens(logits.expand(n, 300).contiguous(), *setting, uniform=u)
        counts = torch.bincount(tokens, minlength=300).double() / n
        probs = torch.softmax(filter_logits_reference(logits, *setting).double(), -1)[0]
        assert (counts - probs).abs().max() <= 2.0 / n, setting


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_selective_log_softmax_kernel(dtype: torch.dtype) -> None:
    _require_op(kernels.SELECTIVE_LOG_SOFTMAX_OP)
    gen = torch.Generator(device="cuda").manual_seed(11)
    for batch, time, vocab in [(1, 1, 1), (1, 7, 7), (3, 341, 1023), (1, 1023, 32003), (2, 9, 128256)]:
        base = (torch.randn(batch, time + 1, vocab + 1, device="cuda", generator=gen) * 5).to(dtype)
        index = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
        # Contiguous, shifted along T, and sliced along V (misaligned rows: the scalar path).
        for logits in (base[:, :time, :vocab].contiguous(), base[:, 1:, :vocab], base[:, :time, 1:]):
            result = kernels.fused_selective_log_softmax_forward(logits, index)
            assert result is not None
            logp, lse = result
            want_lse = torch.logsumexp(logits.float(), dim=-1)
            want = logits.float().gather(-1, index[..., None]).squeeze(-1) - want_lse
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logp, want, rtol=1e-5, atol=5e-5)
    bad = kernels.fused_selective_log_softmax_forward(base[:, :time, :vocab], torch.full_like(index, vocab))
    assert bad is not None and torch.isnan(bad[0]).all()


# --------------------------------------------------------------------------------------------
# The CUDA sources run on the CPU through csrc/generation/emulator (no GPU needed, slow to build)
# --------------------------------------------------------------------------------------------

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)
_EMULATED_SOURCES = ("decode_attention.cu", "sampling.cu", "selective_log_softmax.cu")
_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{<"
        depth -= ch in ")]}>"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def _emulated_source(text: str) -> str:
    """`kernel<<<grid, block, smem, stream>>>(args);` -> `::emu::launch(&kernel, grid, block, args);`"""

    def replace(match: re.Match[str]) -> str:
        grid, block = _split_top_level(match.group(2))[:2]
        return f"::emu::launch(&{match.group(1)}, dim3({grid}), dim3({block}), {match.group(3)});"

    out, count = _LAUNCH.subn(replace, text)
    assert count > 0, "no kernel launch found"
    return out


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The three kernels and emulator/driver.cpp built with g++ into one shared library (cached by source hash)."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    gen_dir = CSRC_DIR / "generation"
    inputs = sorted([*gen_dir.glob("*.cu"), *gen_dir.glob("*.cuh"), *gen_dir.glob("*.h"), *(gen_dir / "emulator").rglob("*.*")])
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()[:16]
    library = build_directory("generation_emulator") / f"libgenemu-{digest}.so"
    if not library.exists():
        work = tmp_path_factory.mktemp("emulator")
        flags = ["g++", "-std=c++20", "-O1", "-fPIC", "-c", f"-I{gen_dir / 'emulator' / 'include'}", f"-I{gen_dir}"]
        jobs, objects = [], []
        for name in _EMULATED_SOURCES:
            source = work / f"{name}.cpp"
            source.write_text(_emulated_source((gen_dir / name).read_text()))
            objects.append(work / f"{name}.o")
            jobs.append(subprocess.Popen([*flags, str(source), "-o", str(objects[-1])], stderr=subprocess.PIPE, text=True))
        objects.append(work / "driver.o")
        jobs.append(subprocess.Popen([*flags, str(gen_dir / "emulator" / "driver.cpp"), "-o", str(objects[-1])], stderr=subprocess.PIPE, text=True))
        for job in jobs:
            _, err = job.communicate()
            assert job.returncode == 0, err
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["g++", "-shared", "-o", str(partial), *map(str, objects)], check=True)
        os.replace(partial, library)  # atomic: concurrent test runs never load a half-written file
    lib = ctypes.CDLL(str(library))
    lib.emu_last_message.restype = ctypes.c_char_p
    return lib


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _check(lib: ctypes.CDLL, rc: int) -> None:
    assert rc == 0, f"emulated launch failed ({rc}): {lib.emu_last_message().decode()}"


def emu_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_info: torch.Tensor) -> tuple[torch.Tensor, int]:
    out = torch.empty(q.shape, dtype=q.dtype)  # contiguous, as the binding allocates it
    lengths = key_info.long().contiguous() if key_info.dtype != torch.bool else None
    mask = key_info.to(torch.uint8).contiguous() if key_info.dtype == torch.bool else None
    seq_len = mask.shape[1] if mask is not None else k.shape[2]
    strides = (ctypes.c_int64 * 11)(*q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *out.stride()[:2], mask.stride(0) if mask is not None else 0)
    dims = (ctypes.c_int * 5)(q.shape[0], q.shape[1], k.shape[1], q.shape[2], seq_len)
    splits = ctypes.c_int(0)
    rc = lib.emu_decode_attention(_DTYPE_CODE[q.dtype], _ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(lengths), _ptr(mask),
                                  strides, dims, ctypes.c_float(q.shape[2] ** -0.5), ctypes.byref(splits))
    _check(lib, rc)
    return out, splits.value


@pytest.mark.slow
@pytest.mark.parametrize("case", [(1, 4, 4, 64, 1), (2, 8, 2, 64, 7), (1, 6, 1, 128, 300), (3, 12, 4, 32, 130), (1, 16, 1, 64, 1100), (2, 8, 2, 256, 200)])
def test_emulated_decode_attention_matches_reference(emulator: ctypes.CDLL, case: tuple[int, int, int, int, int]) -> None:
    batch, heads, kv_heads, head_dim, context = case
    gen = torch.Generator().manual_seed(sum(case))
    for dtype, sm_count, layout in [(torch.bfloat16, 132, "bhsd"), (torch.float16, 1, "bshd")]:
        emulator.emu_set_sm_count(sm_count)  # many SMs -> split-K with a merge; one SM -> a single split
        shape = (batch, kv_heads, context + 5, head_dim) if layout == "bhsd" else (batch, context + 5, kv_heads, head_dim)
        k, v = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
        if layout == "bshd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        k[:, :, context:] = float("nan")  # stale slots past every length must never be read
        v[:, :, context:] = float("nan")
        # q as FastLlamaDecoder passes it: the query heads narrowed out of its fused q/k rows.
        q = torch.randn(batch, heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]
        lengths = torch.randint(1, context + 1, (batch,), generator=gen)
        lengths[0] = context
        for key_info in (lengths, left_padded_mask(lengths, context)):
            got, splits = emu_decode_attention(emulator, q, k, v, key_info)
            want = decode_attention_reference(q.float(), k.float(), v.float(), key_info)
            assert (splits > 1) == (sm_count > 1 and context > 128), splits
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 if dtype == torch.bfloat16 else 3e-3)
    got, _ = emu_decode_attention(emulator, q, k, v, torch.zeros(batch, dtype=torch.long))
    assert torch.all(got == 0)


@pytest.mark.slow
def test_emulated_sampling_matches_reference(emulator: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    for trial in range(30):
        vocab = rng.choice([1, 2, 31, 600, 2049])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        kind = rng.choice(["normal", "ties", "masked"])
        logits = torch.randn(4, vocab, generator=gen) * rng.choice([0.5, 4.0, 20.0])
        if kind == "ties":
            logits = torch.randint(0, 4, (4, vocab), generator=gen).float()
        if kind == "masked":
            logits[torch.rand(4, vocab, generator=gen) < 0.5] = float("-inf")
            logits[:, 0] = 0.0
        logits = logits.to(dtype)
        setting = (rng.choice([0.0, 0.1, 0.7, 1.0, 1.5]), rng.choice([0, 1, 2, 5, vocab - 1, vocab + 3]), rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]))
        u = torch.rand(4, generator=gen)
        out = torch.empty(4, dtype=torch.long)
        rc = emulator.emu_sample_tokens(_DTYPE_CODE[dtype], _ptr(logits), ctypes.c_int64(logits.stride(0)), 4, vocab, _ptr(u), _ptr(out),
                                        ctypes.c_float(setting[0]), max(setting[1], 0), ctypes.c_float(setting[2]))
        _check(emulator, rc)
        want = sample_tokens_reference(logits, max(setting[0], 0.0), max(setting[1], 0), setting[2], uniform=u)
        assert torch.equal(out, want), (trial, vocab, dtype, kind, setting, out.tolist(), want.tolist())


def emu_sample(lib: ctypes.CDLL, logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.long)
    rc = lib.emu_sample_tokens(_DTYPE_CODE[logits.dtype], _ptr(logits), ctypes.c_int64(logits.stride(0)), logits.shape[0],
                               logits.shape[1], _ptr(u), _ptr(out), ctypes.c_float(temperature), top_k, ctypes.c_float(top_p))
    _check(lib, rc)
    return out


@pytest.mark.slow
def test_emulated_sampling_cuts_top_p_tie_groups_like_process_logits(emulator: ctypes.CDLL) -> None:
    """Top-p through a tie group keeps its highest ids (process_logits); an even grid of uniforms
    draws every kept token, so the kernel's kept set must equal the reference's exactly."""
    n = 64
    u = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
    # The hand case of test_filter_hand_computed_thresholds_and_ties, then tie groups spread
    # over several 512-token tiles (the kernel counts tied tokens across tiles).
    hand = torch.tensor([0.5, 0.2, 0.2, 0.1]).log()
    wide = torch.zeros(1500)
    wide[::3] = 1.0  # 500 tokens tied at the top, 1000 tied below
    cuts = 0
    for logits, top_k, top_p in [(hand, 0, 0.6), (hand, 0, 0.75), (hand, 3, 0.6), (hand, 0, 0.0),
                                 (wide, 0, 0.3), (wide, 0, 0.7), (wide, 600, 0.6), (wide, 0, 0.0)]:
        rows = logits.expand(n, -1).contiguous()
        got = emu_sample(emulator, rows, u, 1.0, top_k, top_p)
        want = sample_tokens_reference(rows, 1.0, top_k, top_p, uniform=u)
        assert torch.equal(got, want), (top_k, top_p, got.tolist(), want.tolist())
        kept = torch.isfinite(filter_logits_reference(logits[None], 1.0, top_k, top_p))[0]
        groups = logits[kept].unique()
        cuts += int(((logits == groups.min()) & ~kept).any())
        assert set(got.tolist()) <= set(torch.nonzero(kept).flatten().tolist())
    assert cuts >= 6  # most cases cut through a tie group


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_emulated_selective_log_softmax(emulator: ctypes.CDLL, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for batch, time, vocab in [(1, 1, 1), (1, 7, 7), (2, 5, 1023), (1, 3, 32003), (1, 2, 4096)]:
        base = (torch.randn(batch, time + 1, vocab + 1, generator=gen) * 5).to(dtype)
        index = torch.randint(0, vocab, (batch, time), generator=gen)
        index[0, 0] = vocab if time > 1 else index[0, 0]  # out of range -> NaN
        for logits in (base[:, :time, :vocab].contiguous(), base[:, 1:, :vocab], base[:, :time, 1:]):
            logp, lse = torch.empty(batch, time), torch.empty(batch, time)
            strides = (ctypes.c_int64 * 4)(*logits.stride()[:2], *index.stride())
            rc = emulator.emu_selective_log_softmax(_DTYPE_CODE[dtype], _ptr(logits), _ptr(index), _ptr(logp), _ptr(lse), strides,
                                                    ctypes.c_int64(batch), ctypes.c_int64(time), vocab)
            _check(emulator, rc)
            want_lse = torch.logsumexp(logits.float(), dim=-1)
            want = logits.float().gather(-1, index.clamp(max=vocab - 1)[..., None]).squeeze(-1) - want_lse
            if time > 1:
                assert torch.isnan(logp[0, 0])
                want[0, 0] = float("nan")
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logp, want, rtol=1e-5, atol=2e-5, equal_nan=True)
