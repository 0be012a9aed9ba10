"""Rollout generation: parity with Hugging Face generate, sampling semantics, masks, no host syncs."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import rlhf.engine.backends.cuda as cuda_backend
from rlhf.engine.backends.base import generation_kernels, generation_kernels_enabled
from rlhf.engine.backends.cuda import kernels
from rlhf.engine.distributed import exit_rank
from rlhf.engine.generation import GenerationOutput, generate
from rlhf.engine.kv_cache import RolloutKVCache
from rlhf.engine.ops import load_op
from rlhf.engine.next_token import sample_next_token, sampler_path
from rlhf.engine.sampling import SamplingParams, process_logits, sample_from_logits
from rlhf.models.tiny import FAMILIES, build_char_tokenizer, build_tiny_model, tiny_config
from tests.conftest import SyncCounter

PAD = 0
PROMPTS = ["Hello", "a much longer prompt, with padding", "x", "The quick brown fox"]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def batch(tok) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # left padding is exercised
    return enc.input_ids, enc.attention_mask


@pytest.fixture(scope="module")
def models(tok) -> dict[str, PreTrainedModel]:
    return {family: build_tiny_model(family, tok, seed=0).eval() for family in FAMILIES}


def _hf_generate(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, width: int, **kwargs) -> torch.Tensor:
    """HF's output, right-padded with PAD to `width` (HF stops early once every row is done)."""
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=PAD)


def _hf_greedy_no_stop(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """HF greedy for exactly n tokens: eos_token_id=None overrides the model's stop id."""
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD, eos_token_id=None
    )


def _greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, pad_token_id=PAD, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate_with_per_sequence_eos(models, batch, tok, family: str) -> None:
    model, (ids, mask) = models[family], batch
    n = 16
    free = generate(model, ids, mask, _greedy(n))
    # Use as EOS a token that row 0 emits at step 3, so at least one row stops mid-rollout;
    # the tokenizer's EOS stays in the list (a list of stop ids).
    eos = [int(free.sequences[0, ids.shape[1] + 3]), tok.eos_token_id]
    params = _greedy(n, eos_token_id=eos)
    ours = generate(model, ids, mask, params)
    hf = _hf_generate(model, ids, mask, ours.sequences.shape[1], max_new_tokens=n, do_sample=False, eos_token_id=eos)
    assert torch.equal(ours.sequences, hf)
    assert bool(ours.finished[0]) and int(ours.response_lengths[0]) <= 4


def test_greedy_without_eos_runs_max_new_tokens_like_hf(models, batch) -> None:
    # No stop id: every row gets exactly max_new_tokens, the EOS id being an ordinary token
    # (HF: eos_token_id=None overrides the model's generation config).
    model, (ids, mask) = models["llama"], batch
    n = 12
    ours = generate(model, ids, mask, _greedy(n))
    hf = _hf_greedy_no_stop(model, ids, mask, n)
    assert torch.equal(ours.sequences, hf)
    assert ours.action_mask[:, ids.shape[1]:].all() and not ours.finished.any()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_greedy_matches_hf_generate(tok, batch, family: str) -> None:
    model, (ids, mask) = build_tiny_model(family, tok, seed=2).to(torch.bfloat16).eval(), batch
    ours = generate(model, ids, mask, _greedy(10))
    hf = _hf_greedy_no_stop(model, ids, mask, 10)
    assert torch.equal(ours.sequences, hf)


def _check_masks(out: GenerationOutput, prompt_mask: torch.Tensor, eos: set[int]) -> None:
    """Masks and padding against a plain per-row walk over the generated tokens."""
    p = out.prompt_length
    assert out.sequences.shape == out.action_mask.shape == out.attention_mask.shape
    for b in range(out.sequences.shape[0]):
        generated = out.sequences[b, p:].tolist()
        stop = next((i for i, t in enumerate(generated) if t in eos), None)
        length = len(generated) if stop is None else stop + 1
        expected_action = [False] * p + [True] * length + [False] * (len(generated) - length)
        assert out.action_mask[b].tolist() == expected_action
        assert all(t == PAD for t in generated[length:])
        assert out.attention_mask[b].tolist() == prompt_mask[b].tolist() + [int(a) for a in expected_action[p:]]
        assert bool(out.finished[b]) == (stop is not None)


def test_masks_and_pad_after_eos(models, batch) -> None:
    model, (ids, mask) = models["qwen2"], batch
    free = generate(model, ids, mask, _greedy(10))
    eos = int(free.sequences[1, ids.shape[1] + 2])
    out = generate(model, ids, mask, _greedy(10, eos_token_id=eos))
    assert out.finished.any()
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    _check_masks(out, mask, {eos})
    hot = SamplingParams(max_new_tokens=10, pad_token_id=PAD, eos_token_id=[eos, 5], temperature=2.0)
    sampled = generate(model, ids, mask, hot, generator=torch.Generator().manual_seed(3))
    assert sampled.finished.any() and not sampled.finished.all()  # rows stop at different steps
    _check_masks(sampled, mask, {eos, 5})


def _reference_rollout(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """The plainest loop: no cache, the whole sequence through the model at every step."""
    seqs, seq_mask = ids.clone(), mask.clone()
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(params.max_new_tokens):
        positions = (seq_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=seqs, attention_mask=seq_mask, position_ids=positions).logits[:, -1]
        token = sample_next_token(logits, params, generator)
        token = torch.where(finished, PAD, token)
        finished = finished | torch.isin(token, torch.tensor(params.eos_token_ids, dtype=torch.long))
        seqs = torch.cat([seqs, token[:, None]], dim=1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(token)[:, None]], dim=1)
    return seqs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sampling_matches_uncached_reference_loop(models, batch, family: str) -> None:
    model, (ids, mask) = models[family], batch
    params = SamplingParams(
        max_new_tokens=12, pad_token_id=PAD, eos_token_id=[7, 40], temperature=0.8, top_k=20, top_p=0.9
    )
    ours = generate(model, ids, mask, params, generator=torch.Generator().manual_seed(3))
    ref = _reference_rollout(model, ids, mask, params, torch.Generator().manual_seed(3))
    assert torch.equal(ours.sequences, ref)
    again = generate(model, ids, mask, params, generator=torch.Generator().manual_seed(3))
    other = generate(model, ids, mask, params, generator=torch.Generator().manual_seed(4))
    assert torch.equal(again.sequences, ours.sequences)
    assert not torch.equal(other.sequences, ours.sequences)


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's warpers in `generate`'s order: the independent definition of process_logits."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9),
        (1.3, 10, 0.8), (0.5, 3, 0.5), (1.0, 1, 1.0), (2.0, 0, 0.05),
    ],
)
def test_process_logits_matches_hf_warpers(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = process_logits(logits, temperature, top_k, top_p)
    hf = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    kept = ~torch.isinf(hf)
    assert kept.any(dim=-1).all()
    torch.testing.assert_close(ours[kept], hf[kept])
    torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(hf, -1))


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.3), (0, 0.6), (0, 0.9), (3, 0.5), (40, 0.7), (0, 0.05)])
def test_process_logits_cuts_top_p_ties_like_hf_with_a_stable_sort(monkeypatch, top_k: int, top_p: float) -> None:
    """HF's TopPLogitsWarper sorts without `stable`, so which part of a tie group it keeps at the
    boundary is arbitrary; with a stable sort it is defined, and process_logits matches it."""
    logits = torch.randint(0, 4, (64, 50), generator=torch.Generator().manual_seed(top_k + int(100 * top_p))).float()
    ours = process_logits(logits, 1.0, top_k, top_p)
    unstable_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *args, **kwargs: unstable_sort(*args, **{**kwargs, "stable": True}))
    hf = hf_warp(logits, 1.0, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    # Tie groups really were cut: some token is dropped while another of the same value is kept.
    kept_min = torch.where(torch.isinf(ours), float("inf"), logits).amin(dim=-1, keepdim=True)
    assert ((logits == kept_min) & torch.isinf(ours)).any()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (dict(), [0.5, 0.25, 0.15, 0.1]),
        (dict(temperature=0.5), [25 / 34.5, 6.25 / 34.5, 2.25 / 34.5, 1 / 34.5]),  # p^2 renormalised
        (dict(top_k=2), [2 / 3, 1 / 3, 0.0, 0.0]),
        # Ascending cumulative mass 0.1, 0.25, 0.5, 1: top_p=0.7 drops what stays <= 0.3.
        (dict(top_p=0.7), [2 / 3, 1 / 3, 0.0, 0.0]),
        (dict(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0]),
        (dict(do_sample=False), [1.0, 0.0, 0.0, 0.0]),
    ],
)
def test_sampling_frequencies_on_a_fixed_distribution(params: dict, expected: list[float]) -> None:
    n = 200_000
    # Token order shuffled so "most likely" is not simply index 0.
    order = torch.tensor([2, 0, 3, 1])
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.empty(4).index_copy_(0, order, probs.log()).expand(n, 4)
    params = SamplingParams(max_new_tokens=1, pad_token_id=0, **params)
    tokens = sample_next_token(logits, params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).double() / n
    expected_t = torch.zeros(4, dtype=torch.float64).index_copy_(0, order, torch.tensor(expected).double())
    # 5 standard deviations of a binomial frequency, and exact zeros for removed tokens.
    tol = 5 * (expected_t * (1 - expected_t) / n).sqrt()
    assert ((freq - expected_t).abs() <= tol).all(), (freq, expected_t)


def test_inverse_cdf_draw_hand_values() -> None:
    # Masses e^0, e^0, e^-inf, e^0 -> cumulative 1, 2, 2, 3 of 3: u * 3 picks the first index
    # whose running sum exceeds it, never the removed token 2, and rounding past the end picks
    # the last positive-mass token.
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]]).expand(5, 4)
    uniform = torch.tensor([0.0, 0.33, 0.34, 0.67, 0.9999999])
    assert sample_from_logits(logits, uniform=uniform).tolist() == [0, 0, 1, 3, 3]


def test_sampling_dispatch_takes_no_cuda_kernel_on_cpu(models, batch, monkeypatch) -> None:
    logits = torch.randn(2, 10)
    filtered = SamplingParams(max_new_tokens=4, pad_token_id=PAD, top_k=5, top_p=0.9)
    plain = SamplingParams(max_new_tokens=4, pad_token_id=PAD, temperature=0.7)
    assert sampler_path(logits, filtered) == "reference"
    assert sampler_path(logits, plain) in ("cpu_kernel", "reference")  # the csrc CPU sampler where it builds
    assert sampler_path(logits, _greedy(4)) == "greedy"
    with generation_kernels(False):
        assert sampler_path(logits, plain) == "reference"
    assert generation_kernels_enabled()  # restored after the block

    def no_kernel(*args, **kwargs):
        raise AssertionError("the CUDA sampling kernel was called for CPU logits")

    monkeypatch.setattr(kernels, "sample_tokens", no_kernel)
    monkeypatch.setattr(cuda_backend, "sample_tokens", no_kernel)  # the CUDA backend's sampler calls it there
    model, (ids, mask) = models["llama"], batch
    for params in (filtered, plain):
        out = generate(model, ids, mask, params, generator=torch.Generator().manual_seed(0))
        assert out.action_mask.any()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "settings", [dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1.0), dict(top_p=0.5), dict(top_k=1)]
)
def test_cuda_sampling_kernel_generates_like_the_reference(models, batch, settings: dict) -> None:
    """On CUDA, sample_next_token runs kernels.sample_tokens: same uniforms, same tokens. The HF
    forward (fast=False) keeps the logits identical, so only the sampler differs."""
    assert load_op(kernels.SAMPLING_OP.name) is not None, "rlhf_sampling must build on a GPU machine"
    model = build_tiny_model("llama", build_char_tokenizer(), seed=0).cuda().eval()
    ids, mask = (t.cuda() for t in batch)
    params = SamplingParams(max_new_tokens=16, pad_token_id=PAD, eos_token_id=[7, 40], **settings)
    assert sampler_path(torch.zeros(1, 8, device="cuda"), params) == "cuda_kernel"
    kernel = generate(model, ids, mask, params, torch.Generator(device="cuda").manual_seed(3), fast=False)
    with generation_kernels(False):
        ref = generate(model, ids, mask, params, torch.Generator(device="cuda").manual_seed(3), fast=False)
    assert torch.equal(kernel.sequences, ref.sequences)
    assert torch.equal(kernel.action_mask, ref.action_mask)


def test_decode_steps_do_not_sync_with_the_host(models, batch) -> None:
    model, (ids, mask) = models["llama"], batch

    def syncs(max_new: int, sync_every: int) -> int:
        params = SamplingParams(max_new_tokens=max_new, pad_token_id=PAD, top_k=5, top_p=0.9, sync_every=sync_every)
        with SyncCounter() as counter:
            generate(model, ids, mask, params, generator=torch.Generator().manual_seed(0))
        return counter.count

    base = syncs(1, sync_every=0)  # input checks + prefill only
    assert syncs(12, sync_every=0) == base
    # The all-finished check runs after steps 4 and 8 (never after the last step).
    assert syncs(12, sync_every=4) == base + 2


def test_stops_at_a_sync_point_once_every_row_finished(models, batch) -> None:
    model, (ids, mask) = models["mistral"], batch
    p = ids.shape[1]
    free = generate(model, ids, mask, _greedy(3))
    eos = sorted(set(free.sequences[:, p + 1].tolist()))  # every row has finished after step 1
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        early = generate(model, ids, mask, _greedy(20, eos_token_id=eos, sync_every=2))
        n_early = len(calls)
        full = generate(model, ids, mask, _greedy(20, eos_token_id=eos, sync_every=0))
        n_full = len(calls) - n_early
    finally:
        handle.remove()
    assert (n_early, n_full) == (2, 20)  # prefill + 1 decode step, vs prefill + 19
    assert early.sequences.shape == (ids.shape[0], p + 20)
    assert torch.equal(early.sequences, full.sequences) and torch.equal(early.action_mask, full.action_mask)
    assert early.finished.all() and not early.action_mask[:, p + 2 :].any()
    _check_masks(early, mask, set(eos))


def test_sliding_window_attention_matches_hf(tok, batch) -> None:
    ids, mask = batch
    config = tiny_config("mistral", vocab_size=len(tok))
    config.sliding_window = 5  # much shorter than the prompts: the window really cuts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    full_config = tiny_config("mistral", vocab_size=len(tok))
    full_attention = AutoModelForCausalLM.from_config(full_config).eval()
    full_attention.load_state_dict(model.state_dict())
    params = _greedy(12)
    ours = generate(model, ids, mask, params)
    hf = _hf_greedy_no_stop(model, ids, mask, 12)
    assert torch.equal(ours.sequences, hf)
    assert not torch.equal(ours.sequences, generate(full_attention, ids, mask, params).sequences)


def test_eager_attention_implementation_matches_hf(tok, batch) -> None:
    ids, mask = batch
    model = build_tiny_model("llama", tok, seed=1)
    model.set_attn_implementation("eager")
    model.eval()
    ours = generate(model, ids, mask, _greedy(10))
    hf = _hf_greedy_no_stop(model, ids, mask, 10)
    assert torch.equal(ours.sequences, hf)


def test_kv_cache_is_preallocated_and_read_as_a_prefix(models) -> None:
    config = models["llama"].config
    cache = RolloutKVCache(config, max_cache_len=8)
    k = torch.randn(2, 2, 5, 16)
    keys, values = cache.update(k, -k, layer_idx=0)
    assert keys.shape[2] == 5 and torch.equal(keys, k) and torch.equal(values, -k)
    buffer = cache.layers[0].keys
    keys, _ = cache.update(k[:, :, :1] + 1, k[:, :, :1], layer_idx=0)
    assert cache.layers[0].keys is buffer and buffer.shape[2] == 8  # written in place, never regrown
    assert keys.shape[2] == 6 and torch.equal(keys[:, :, :5], k) and torch.equal(keys[:, :, 5:], k[:, :, :1] + 1)
    assert cache.get_seq_length(0) == 6 and cache.get_mask_sizes(1, 0) == (7, 0)
    assert cache.bytes_allocated() == 2 * 2 * 2 * 8 * 16 * 4
    with pytest.raises(RuntimeError, match="overflow"):
        cache.update(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16), layer_idx=0)


@pytest.mark.parametrize("kwargs_form", ["per_layer", "shared_dict"])
def test_kv_cache_builds_every_layer_whichever_form_transformers_returns(models, monkeypatch, kwargs_form) -> None:
    """transformers 5.17 returns one kwargs dict for all layers (and derives max_cache_len from
    them, a property); later versions one dict per layer. Both must give a layer per layer."""
    from rlhf.engine import kv_cache

    config = models["mistral"].config  # sliding-window layers take kwargs
    real = kv_cache.get_layer_types_and_kwargs

    def shared_dict(text_config):
        types, per_layer = real(text_config)
        return types, (per_layer[0] if isinstance(per_layer, list) else per_layer)

    if kwargs_form == "shared_dict":
        monkeypatch.setattr(kv_cache, "get_layer_types_and_kwargs", shared_dict)
    cache = RolloutKVCache(config, max_cache_len=8)
    assert len(cache.layers) == config.num_hidden_layers
    k = torch.randn(1, config.num_key_value_heads, 3, config.hidden_size // config.num_attention_heads)
    for layer in range(config.num_hidden_layers):
        keys, _ = cache.update(k, k, layer_idx=layer)
        assert torch.equal(keys[:, :, :3], k)


def test_input_and_params_validation(models, batch) -> None:
    model, (ids, mask) = models["llama"], batch
    params = SamplingParams(max_new_tokens=2, pad_token_id=PAD)
    right_padded = torch.ones_like(mask)
    right_padded[0, -2:] = 0
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, right_padded, params)
    with pytest.raises(ValueError, match="same"):
        generate(model, ids, mask[:, 1:], params)
    bad_fields = (
        dict(max_new_tokens=0), dict(temperature=0.0), dict(top_k=-1),
        dict(top_p=0.0), dict(top_p=1.5), dict(sync_every=-1),
    )
    for bad in bad_fields:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**{"max_new_tokens": 2, "pad_token_id": PAD, **bad})
    assert SamplingParams(max_new_tokens=1, pad_token_id=0, temperature=0.0, do_sample=False).eos_token_ids == []


# -- tensor parallel (2 ranks, gloo) ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        tok = build_char_tokenizer()
        tok.padding_side = "left"
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        model = build_tiny_model("llama", tok, seed=0).eval()
        greedy = _greedy(10)
        single = generate(model, enc.input_ids, enc.attention_mask, greedy).sequences
        plan: dict[str, object] = {"lm_head": ColwiseParallel(use_local_output=False)}  # DTensor logits
        for i in range(len(model.model.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        tp_greedy = generate(model, enc.input_ids, enc.attention_mask, greedy).sequences
        sampling = SamplingParams(max_new_tokens=10, pad_token_id=PAD, top_k=20, top_p=0.9)
        seeded = torch.Generator().manual_seed(5)
        tp_sampled = generate(model, enc.input_ids, enc.attention_mask, sampling, seeded).sequences
        is_dtensor = isinstance(model.lm_head.weight, DTensor)
        results.put((rank, is_dtensor, torch.equal(tp_greedy, single), tp_sampled.tolist()))
        dist.barrier()  # no rank tears gloo down while its peer is still communicating
    finally:
        dist.destroy_process_group()
    exit_rank()  # as the CLI ends a rank: no interpreter finalization (exit_rank says why)


@pytest.mark.slow  # two spawned processes importing transformers: ~20 s on 2 cores
def test_tensor_parallel_model_generates_like_the_single_process_one() -> None:
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_worker, args=(2, _free_port(), results), nprocs=2, join=True)
    by_rank = dict((r[0], r[1:]) for r in (results.get(), results.get()))
    for rank in (0, 1):
        is_dtensor, greedy_equal, _ = by_rank[rank]
        assert is_dtensor and greedy_equal
    assert by_rank[0][2] == by_rank[1][2]  # one generator seed on both ranks -> same samples


def test_min_new_tokens_suppresses_eos_until_reached():
    from rlhf.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    model = build_tiny_model("llama", tok, seed=0, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2).eval()
    with torch.no_grad():  # a huge EOS row: EOS is sampled early in many rows
        model.lm_head.weight[eos] *= 100.0
    ids = torch.randint(3, 100, (64, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def first_eos(min_new: int) -> torch.Tensor:
        params = SamplingParams(max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD, min_new_tokens=min_new)
        out = generate(model, ids, mask, params, torch.Generator().manual_seed(1))
        gen = out.sequences[:, 5:]
        hit = gen == eos
        return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((64,), 99.0))

    free = first_eos(0)
    assert (free < 3).sum() > 5, "the test needs early EOS without min_new_tokens"
    held = first_eos(3)
    assert (held >= 3).all()
    assert (held == 3).sum() > 5  # EOS comes as soon as it is allowed
