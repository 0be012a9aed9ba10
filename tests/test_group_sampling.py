"""Group sampling: one prefill per unique prompt, its KV cache shared by the prompt's N samples.

`generate(..., samples_per_prompt=N)` must give, token for token, what `generate` gives on the
prompts repeated N times (repeat_interleave order), on every runner (the fast decoder with its
fused CPU step, its Python step and its decode-attention step, the HF forward, windowed caches,
tensor parallelism), while the prompt is prefilled once over the unique rows.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.engine import generation
from rlhf.engine.distributed import exit_rank
from rlhf.engine.fast_decode import FastLlamaDecoder
from rlhf.engine.generation import GenerationOutput, HFForwardRunner, generate, group_index
from rlhf.engine.backends.base import generation_kernels
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
from rlhf.engine.backends.cuda.decoder import CudaLlamaDecoder
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.rollout import Rollout
from rlhf.engine.sampling import SamplingParams
from rlhf.models.tiny import build_char_tokenizer, build_tiny_model, tiny_config

PAD = 0
PROMPTS = ["Hello", "a much longer prompt, with padding", "x"]
FAMILIES = ("llama", "qwen2", "opt", "gpt2")  # qwen2, opt and gpt2 tie their embeddings
FAST_FAMILIES = ("llama", "qwen2")
# How generate() runs the model: the fast decoder with its fused CPU decode step, the fast
# decoder's Python step (kernels off), or the model's own forward over RolloutKVCache.
PATHS = ("fast", "fast-python-step", "hf-forward")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _build(family: str, tok) -> PreTrainedModel:
    model = build_tiny_model(family, tok, seed=0).eval()
    if family == "qwen2":  # HF's zero q/k/v biases would hide a bias bug: make them matter
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(0.2 * torch.randn(proj.bias.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def models(tok) -> dict[str, PreTrainedModel]:
    return {family: _build(family, tok) for family in FAMILIES}


def _greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, pad_token_id=PAD, do_sample=False, **kwargs)


def _run(model, ids, mask, params, path: str, generator=None, samples_per_prompt=1) -> GenerationOutput:
    fast = False if path == "hf-forward" else "auto"
    with generation_kernels(path != "fast-python-step"):
        return generate(model, ids, mask, params, generator, fast=fast, samples_per_prompt=samples_per_prompt)


def _assert_same(group: GenerationOutput, repeated: GenerationOutput) -> None:
    assert torch.equal(group.sequences, repeated.sequences)
    assert torch.equal(group.attention_mask, repeated.attention_mask)
    assert group.attention_mask.dtype == repeated.attention_mask.dtype
    assert torch.equal(group.action_mask, repeated.action_mask)
    assert torch.equal(group.finished, repeated.finished)
    assert group.prompt_length == repeated.prompt_length


def _cases() -> list[tuple[str, str]]:
    return [(f, p) for f in FAMILIES for p in PATHS if f in FAST_FAMILIES or p == "hf-forward"]


class Spy:
    """Wraps the runner select_runner picks, recording the batch of every call."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.prefill_batches: list[int] = []
        self.expand_indices: list[list[int]] = []
        self.decode_batches: list[int] = []
        self.first_logits: torch.Tensor | None = None

    def prefill(self, input_ids, attention_mask, position_ids):
        self.prefill_batches.append(input_ids.shape[0])
        return self.runner.prefill(input_ids, attention_mask, position_ids)

    def expand(self, index):
        self.expand_indices.append(index.tolist())
        self.runner.expand(index)

    def decode(self, tokens, attention_mask, position_ids):
        self.decode_batches.append(tokens.shape[0])
        return self.runner.decode(tokens, attention_mask, position_ids)

    def run(self, loop):
        # Every row together through this spy's decode (the runner's own `run` would call its decode
        # directly), as the runner itself decodes these small batches (no row groups).
        if hasattr(self.runner, "rows_per_group"):
            assert self.runner.rows_per_group(loop.batch) >= loop.batch
        return loop.run_all(self)


@pytest.fixture
def spies(monkeypatch) -> list[Spy]:
    made: list[Spy] = []
    select = generation.select_runner

    def spying_select(*args, **kwargs):
        made.append(Spy(select(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(generation, "select_runner", spying_select)
    return made


# -- token-for-token parity with repeated prompts -----------------------------------------------


@pytest.mark.parametrize(("family", "path"), _cases())
def test_greedy_group_equals_repeated_prompts(models, batch, family: str, path: str) -> None:
    model, (ids, mask) = models[family], batch
    free = _run(model, ids, mask, _greedy(12), path)
    # A token row 0 emits at step 3 as the stop id: some rows stop mid-rollout, others run on.
    params = _greedy(12, eos_token_id=int(free.sequences[0, ids.shape[1] + 3]))
    group = _run(model, ids, mask, params, path, samples_per_prompt=3)
    repeated = _run(model, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), params, path)
    assert group.sequences.shape[0] == 3 * ids.shape[0]
    _assert_same(group, repeated)
    assert bool(group.finished[:3].all()) and not bool(group.finished.all())


@pytest.mark.parametrize(("family", "path"), [("llama", "fast"), ("qwen2", "fast-python-step"), ("opt", "hf-forward")])
def test_per_row_counts(models, batch, family: str, path: str) -> None:
    model, (ids, mask) = models[family], batch
    counts = torch.tensor([1, 3, 2])
    group = _run(model, ids, mask, _greedy(10), path, samples_per_prompt=counts)
    repeated = _run(model, ids.repeat_interleave(counts, 0), mask.repeat_interleave(counts, 0), _greedy(10), path)
    assert group.sequences.shape[0] == 6
    _assert_same(group, repeated)
    assert torch.equal(group.sequences[:, : ids.shape[1]], ids.repeat_interleave(counts, 0))


@pytest.mark.parametrize("path", PATHS)
def test_seeded_sampling_draws_what_the_repeated_prompts_draw(models, batch, path: str) -> None:
    model, (ids, mask) = models["llama"], batch
    params = SamplingParams(max_new_tokens=12, pad_token_id=PAD, temperature=0.9, top_k=30, top_p=0.95)
    group = _run(model, ids, mask, params, path, torch.Generator().manual_seed(3), samples_per_prompt=4)
    repeated = _run(model, ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0), params, path,
                    torch.Generator().manual_seed(3))
    _assert_same(group, repeated)
    # The samples of one prompt differ from each other: the copies are independent draws.
    generated = group.sequences[:, ids.shape[1]:]
    assert len({tuple(row) for row in generated[4:8].tolist()}) > 1


def test_sliding_window_cache_is_expanded_too(tok, batch) -> None:
    """Mistral with a window shorter than the prompt: transformers' windowed layer, full at expansion."""
    config = tiny_config("mistral", vocab_size=len(tok))
    config.sliding_window = 5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = batch
    group = generate(model, ids, mask, _greedy(10), samples_per_prompt=torch.tensor([2, 1, 3]))
    counts = torch.tensor([2, 1, 3])
    repeated = generate(model, ids.repeat_interleave(counts, 0), mask.repeat_interleave(counts, 0), _greedy(10))
    _assert_same(group, repeated)


# -- the prefill runs once over the unique prompts ----------------------------------------------


@pytest.mark.parametrize(("family", "fast"), [("llama", "auto"), ("llama", False), ("gpt2", "auto")])
def test_prefill_runs_once_over_the_unique_prompts(models, batch, spies, family: str, fast) -> None:
    model, (ids, mask) = models[family], batch
    out = generate(model, ids, mask, _greedy(5), fast=fast, samples_per_prompt=torch.tensor([2, 1, 3]))
    (spy,) = spies
    assert spy.prefill_batches == [3]
    assert spy.expand_indices == [[0, 0, 1, 2, 2, 2]]
    assert spy.decode_batches == [6] * 4
    assert out.sequences.shape[0] == 6
    runner = spy.runner
    if isinstance(runner, FastLlamaDecoder):
        assert all(k.shape[0] == 6 for k in runner.keys + runner.values)
    else:
        assert isinstance(runner, HFForwardRunner)
        assert all(layer.keys.shape[0] == 6 for layer in runner.cache.layers)


@pytest.mark.parametrize("counts", [1, torch.tensor([1, 1, 1])])
def test_one_sample_per_prompt_copies_nothing(models, batch, spies, counts) -> None:
    model, (ids, mask) = models["llama"], batch
    out = generate(model, ids, mask, _greedy(6), samples_per_prompt=counts)
    assert spies[0].expand_indices == [] and spies[0].prefill_batches == [3]
    assert torch.equal(out.sequences, generate(model, ids, mask, _greedy(6)).sequences)


RUNNER_KINDS = {
    "fast-fused-step": lambda m, b, n: CpuLlamaDecoder(m, b, n, cpu_kernel="auto"),
    "fast-python-step": lambda m, b, n: CpuLlamaDecoder(m, b, n, cpu_kernel=False, attention_kernel=False),
    "fast-torch-step": lambda m, b, n: FastLlamaDecoder(m, b, n),
    # On the CPU the decode-attention op's PyTorch reference, reading the expanded cache buffers.
    "fast-decode-attention": lambda m, b, n: CudaLlamaDecoder(m, b, n, attention_kernel=True),
    "fast-decode-attention-reference": lambda m, b, n: FastLlamaDecoder(m, b, n, attention_kernel=True),
    "hf-forward": lambda m, b, n: HFForwardRunner(m, n),
}


@pytest.mark.parametrize("kind", list(RUNNER_KINDS))
def test_expanded_cache_gives_the_repeated_prefills_logits_every_step(models, batch, kind: str) -> None:
    model, (ids, mask) = models["qwen2"], batch
    counts = torch.tensor([2, 3, 1])
    index = torch.arange(3).repeat_interleave(counts)
    steps, width = 5, ids.shape[1]
    group, repeated = RUNNER_KINDS[kind](model, 3, width + steps), RUNNER_KINDS[kind](model, 6, width + steps)
    positions = position_ids_from_mask(mask)
    full_mask = torch.cat([mask, torch.ones(3, steps, dtype=mask.dtype)], dim=1)[index]
    with torch.no_grad():
        group_logits = group.prefill(ids, mask, positions)
        group.expand(index)
        group_logits = group_logits[index]
        repeated_logits = repeated.prefill(ids[index], mask[index], positions[index])
        for step in range(steps):
            torch.testing.assert_close(group_logits, repeated_logits, atol=1e-5, rtol=0)
            token = torch.arange(6)[:, None] + 10 + step  # different tokens per copy of one prompt
            pos = positions[index, -1:] + step + 1
            group_logits = group.decode(token, full_mask[:, : width + step + 1], pos)
            repeated_logits = repeated.decode(token, full_mask[:, : width + step + 1], pos)


# -- the API ------------------------------------------------------------------------------------


def test_group_index_and_bad_counts() -> None:
    assert group_index(1, 3, torch.device("cpu")) is None
    assert group_index(2, 3, torch.device("cpu")).tolist() == [0, 0, 1, 1, 2, 2]
    counts = torch.tensor([1, 3, 2], dtype=torch.int32)
    assert group_index(counts, 3, torch.device("cpu")).tolist() == [0, 1, 1, 1, 2, 2]
    for bad in (0, -1, 2.0, True, torch.tensor([1, 0, 2]), torch.tensor([1, 2]), torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(ValueError, match="samples_per_prompt"):
            group_index(bad, 3, torch.device("cpu"))


def test_rollout_generate_passes_the_counts_through(models, batch) -> None:
    model, (ids, mask) = models["llama"], batch
    engine = SimpleNamespace(model=model, dtype="fp32",
                             ctx=SimpleNamespace(device=torch.device("cpu"), all_reduce_max=lambda t: t))
    rollout = Rollout(model, engine, tolerance=1e-4)  # type: ignore[arg-type]
    out = rollout.generate(ids, mask, _greedy(6), samples_per_prompt=2)
    assert out.sequences.shape[0] == 6 and rollout.parity_max_diff is not None and rollout.parity_max_diff < 1e-4
    repeated = generate(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), _greedy(6))
    _assert_same(out, repeated)


# -- tensor parallel (2 ranks, gloo) ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        tok = build_char_tokenizer()
        tok.padding_side = "left"
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        ids, mask = enc.input_ids, enc.attention_mask
        model = build_tiny_model("llama", tok, seed=0).eval()
        plan: dict[str, object] = {}
        for i in range(len(model.model.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        counts = torch.tensor([2, 1, 3])
        params = SamplingParams(max_new_tokens=8, pad_token_id=PAD, top_k=20)
        group = generate(model, ids, mask, params, torch.Generator().manual_seed(5), samples_per_prompt=counts)
        repeated = generate(model, ids.repeat_interleave(counts, 0), mask.repeat_interleave(counts, 0), params,
                            torch.Generator().manual_seed(5))
        results.put((rank, torch.equal(group.sequences, repeated.sequences), group.sequences.tolist()))
        dist.barrier()  # no rank tears gloo down while its peer is still communicating
    finally:
        dist.destroy_process_group()
    exit_rank()  # as the CLI ends a rank: no interpreter finalization (exit_rank says why)


@pytest.mark.slow  # two spawned processes importing transformers: ~20 s on 2 cores
def test_tensor_parallel_group_sampling_equals_repeated_prompts() -> None:
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_worker, args=(2, _free_port(), results), nprocs=2, join=True)
    by_rank = dict((r[0], r[1:]) for r in (results.get(), results.get()))
    assert by_rank[0][0] and by_rank[1][0]
    assert by_rank[0][1] == by_rank[1][1]
