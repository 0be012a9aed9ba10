"""The fused float32 CPU decode step (csrc/generation/cpu_decode*.cpp) against the Python step.

FastLlamaDecoder's Python decode step is the reference (it is itself checked against the HF
forward and HF generate in test_fast_decode.py); every kernel set this CPU runs (scalar, AVX2)
must give the same logits and write the same KV cache, step after step, for the shapes that
reach the kernels' edge cases: GQA and MHA, Qwen2's q/k/v biases and Llama's optional
attention and MLP biases, head and MLP widths that are not multiples of the vector width,
left padding, one thread and several, projections through MKL and through packed weights.
The op's sampler must draw what sample_from_logits draws from the same uniforms.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.engine.backends.cpu.decode_op import load_cpu_decode_op
from rlhf.engine.backends.cpu.matmul import onednn_available, use_onednn_linears
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder, kv_cache_halved
from rlhf.engine.decode_loop import Transcript, record_python
from rlhf.engine.generation import generate
from rlhf.engine.next_token import sample_next_token
from rlhf.engine.sampling import SamplingParams, process_logits, sample_from_logits
from rlhf.models.tiny import tiny_config

VOCAB = 97


@pytest.fixture(scope="module")
def op():
    module = load_cpu_decode_op()
    if module is None:
        pytest.skip("rlhf_cpu_decode cannot be built here (no C++ compiler?)")
    return module


def _model(family: str, hidden: int, heads: int, kv_heads: int, ffn: int, biases: bool = False) -> PreTrainedModel:
    config = tiny_config(
        family, vocab_size=VOCAB, hidden_size=hidden, num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=ffn,
    )
    if biases:  # Llama's optional biases on every projection
        config.attention_bias = config.mlp_bias = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zero-initialises biases: random ones make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model


SHAPES = {
    # family, hidden, heads, kv_heads, ffn, biases
    "llama-gqa": ("llama", 64, 4, 2, 128, False),
    "llama-mha-biases": ("llama", 48, 4, 4, 72, True),  # head_dim 12, ffn 72: vector tails
    "qwen2-gqa-qkv-bias": ("qwen2", 64, 8, 2, 96, False),
    "mistral-mqa": ("mistral", 40, 2, 1, 60, False),  # head_dim 20
    # head_dim 32 and 64: AVX-512's attention_tasks_wide (head_dim 16 above: its one-register queries)
    "llama-gqa-d32": ("llama", 128, 4, 2, 96, False),
    "qwen2-mqa-d64": ("qwen2", 128, 2, 1, 80, False),
}


def _prompts(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch, 2):  # left padding of various widths on every other row
        mask[row, : min(width - 1, row + 1)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, positions


def _run_steps(decoder: CpuLlamaDecoder, ids, mask, positions, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill, then feed `tokens` [B, steps] one column per step; -> logits of every call."""
    batch, width = ids.shape
    steps = tokens.shape[1]
    full_mask = torch.cat([mask, torch.ones(batch, steps, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = [decoder.prefill(ids, mask, positions)]
        for step in range(steps):
            pos = positions[:, -1:] + step + 1
            logits.append(decoder.decode(tokens[:, step : step + 1], full_mask[:, : width + step + 1], pos))
    return logits


@pytest.mark.parametrize("packed", [False, True], ids=["mkl", "packed"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_kernel_set_matches_the_python_step(op, shape: str, packed: bool) -> None:
    """Batch 5: a block of four rows and a remainder row in the packed GEMM; vocab 97 and the
    shapes' odd widths: partial panels."""
    model = _model(*SHAPES[shape])
    ids, mask, positions = _prompts(batch=5, width=7)
    steps = 9
    tokens = torch.randint(3, VOCAB, (5, steps), generator=torch.Generator().manual_seed(3))
    reference = CpuLlamaDecoder(model, 5, 7 + steps, cpu_kernel=False)
    assert reference.kernel_isa is None
    want = _run_steps(reference, ids, mask, positions, tokens)
    for isa in op.supported_isas():
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                fused = CpuLlamaDecoder(model, 5, 7 + steps, cpu_kernel=True, kernel_isa=isa, packed_gemm=packed)
                got = _run_steps(fused, ids, mask, positions, tokens)
            finally:
                torch.set_num_threads(previous)
            assert fused.kernel_isa == isa and fused.packed_gemm == packed
            scale = max(float(w.abs().max()) for w in want)
            for step, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w, atol=2e-6 * scale, rtol=0, msg=lambda m: f"{isa} step {step}: {m}")
            for layer in range(len(model.model.layers)):
                for cache in ("keys", "values"):
                    g, w = getattr(fused, cache)[layer], getattr(reference, cache)[layer]
                    torch.testing.assert_close(g[:, :, : 7 + steps], w[:, :, : 7 + steps], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [3, 8, 11, 17])
def test_avx512_panel_gemm_gives_avx2s_bits(op, batch: int) -> None:
    """The avx512 kernel set runs the packed projections on 16-float registers (8-row blocks, then
    a tail of 1-7 rows; 3 panels side by side, then single panels, a partial last one included:
    hidden 48, q/k/v 144, MLP 72): every output is the same multiply-add chain over k in order as
    avx2's. At head_dim 12 its attention is avx2's too, so the logits and caches are equal to the bit."""
    if "avx512" not in op.supported_isas():
        pytest.skip("this CPU has no AVX-512F")
    model = _model(*SHAPES["llama-mha-biases"])
    ids, mask, positions = _prompts(batch=batch, width=7)
    steps = 5
    tokens = torch.randint(3, VOCAB, (batch, steps), generator=torch.Generator().manual_seed(3))
    runs = {}
    for isa in ("avx2", "avx512"):
        decoder = CpuLlamaDecoder(model, batch, 7 + steps, cpu_kernel=True, kernel_isa=isa, packed_gemm=True)
        assert decoder.kernel_isa == isa and decoder.packed_gemm
        runs[isa] = (_run_steps(decoder, ids, mask, positions, tokens), decoder.keys, decoder.values)
    for step, (a, b) in enumerate(zip(runs["avx2"][0][1:], runs["avx512"][0][1:])):  # [0]: the Python prefill
        assert torch.equal(a, b), f"step {step}: max |diff| {float((a - b).abs().max())}"
    for a, b in zip(runs["avx2"][1] + runs["avx2"][2], runs["avx512"][1] + runs["avx512"][2]):
        assert torch.equal(a[:, :, : 7 + steps], b[:, :, : 7 + steps])


@pytest.mark.parametrize("kv_cache_dtype", ["model", "fp16"])
@pytest.mark.parametrize("shape", ["llama-gqa", "llama-gqa-d32", "qwen2-mqa-d64"])
def test_attention_over_masked_blocks_and_partial_blocks(op, shape: str, kv_cache_dtype: str) -> None:
    """Prompts of 37 with 20-36 pad keys on every other row (whole 16-key blocks that no query sees,
    which attention_tasks_wide skips) and caches of 38-56 keys (whole blocks, then 1-15 keys of a
    last one), GQA and MQA, float32 and float16 caches: every kernel set gives the Python step's
    logits."""
    model = _model(*SHAPES[shape])
    batch, width, steps = 6, 37, 19
    ids, mask, positions = _prompts(batch=batch, width=width)
    for row in range(1, batch, 2):
        mask[row, : 18 + 6 * row] = 0
    mask[:, -1] = 1
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    tokens = torch.randint(3, VOCAB, (batch, steps), generator=torch.Generator().manual_seed(3))
    reference = CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=False, kv_cache_dtype=kv_cache_dtype)
    want = _run_steps(reference, ids, mask, positions, tokens)
    scale = max(float(w.abs().max()) for w in want)
    # float16: a key one float32 ulp apart may round to a neighbouring float16, which moves the logits by up
    # to ~4e-5 of their scale here (the scalar set's too); a pad key attended to or a value missed moves them
    # by far more than 1e-3.
    atol = (2e-6 if kv_cache_dtype == "model" else 1e-3) * scale
    for isa in op.supported_isas():
        fused = CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=True, kernel_isa=isa, packed_gemm=True,
                                 kv_cache_dtype=kv_cache_dtype)
        got = _run_steps(fused, ids, mask, positions, tokens)
        for step, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m: f"{isa} step {step}: {m}")


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_panel_linear_is_the_packed_projection(op, rows: int) -> None:
    """panel_linear (the step's packed GEMM on its own, bench_ppo's decode reference) equals x @ w_t
    + bias up to float32 rounding on every kernel set, partial last panels and odd widths
    included, and refuses panels of the wrong shape."""
    gen = torch.Generator().manual_seed(5)
    for d_in, d_out in ((256, 98), (37, 211), (64, 16)):
        x = torch.randn(rows, d_in, generator=gen)
        w_t = torch.randn(d_in, d_out, generator=gen) / d_in**0.5
        bias = torch.randn(d_out, generator=gen)
        panels = op.pack_panels(w_t)
        for isa in op.supported_isas():
            torch.testing.assert_close(op.panel_linear(x, panels, d_out, isa=isa), x @ w_t, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(op.panel_linear(x, panels, d_out, bias, isa=isa), x @ w_t + bias,
                                       rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="panels"):
        op.panel_linear(x, panels, d_out + 16)


@pytest.mark.parametrize("rows", [1, 7, 32, 301])
def test_panel_swiglu_is_silu_of_gate_times_up(op, rows: int) -> None:
    """panel_swiglu over pack_swiglu_panels (the SwiGLU MLP's activation with both products kept in
    registers) equals silu(x @ gate_t) * (x @ up_t) to float32 rounding on every kernel set, the
    same bits on AVX2 and AVX-512 (each product one multiply-add chain over k in order on both),
    partial last panels, rows past the last whole block and past one row block (252 rows at 256
    inputs) and odd widths included; refuses weights of different shapes and panels of the wrong
    shape."""
    gen = torch.Generator().manual_seed(7)
    for d_in, ffn in ((256, 98), (37, 211), (64, 16), (64, 48)):
        x = torch.randn(rows, d_in, generator=gen)
        gate_t, up_t = (torch.randn(d_in, ffn, generator=gen) / d_in**0.5 for _ in range(2))
        panels = op.pack_swiglu_panels(gate_t, up_t)
        assert panels.shape == (2 * -(-ffn // 16), d_in, 16)
        want = (torch.nn.functional.silu(x.double() @ gate_t.double()) * (x.double() @ up_t.double())).float()
        got = {isa: op.panel_swiglu(x, panels, ffn, isa=isa) for isa in op.supported_isas()}
        for isa, out in got.items():
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=isa)
        if "avx512" in got:
            assert torch.equal(got["avx2"], got["avx512"])
        # an [ffn, in] weight viewed transposed packs the same
        assert torch.equal(op.pack_swiglu_panels(gate_t.t().contiguous().t(), up_t.t().contiguous().t()), panels)
    with pytest.raises(RuntimeError, match="differ in shape"):
        op.pack_swiglu_panels(gate_t, up_t[:, 1:])
    with pytest.raises(RuntimeError, match="panels"):
        op.panel_swiglu(x, panels, ffn + 16)


@pytest.mark.parametrize("rows", [1, 5, 300, 1100])
def test_tn_weight_grad_is_dy_transposed_times_x(op, rows: int) -> None:
    """tn_weight_grad (a linear's weight gradient dY^T X straight from the rows of dY and X) equals
    dy.t() @ x to float32 rounding on every kernel set, the same bits on AVX2 and AVX-512 (each
    output one multiply-add chain over the rows in order, whatever the chunking), output rows past
    the last whole block and more rows than one chunk included; refuses an input width that is not
    a multiple of 16 and rows that differ."""
    gen = torch.Generator().manual_seed(11)
    for d_out, d_in in ((256, 256), (98, 256), (37, 48), (7, 16), (300, 64)):
        dy, x = torch.randn(rows, d_out, generator=gen), torch.randn(rows, d_in, generator=gen)
        want = (dy.double().t() @ x.double()).float()
        got = {isa: op.tn_weight_grad(dy, x, isa=isa) for isa in op.supported_isas()}
        for isa, out in got.items():
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * rows**0.5, msg=isa)
        if "avx512" in got:
            assert torch.equal(got["avx2"], got["avx512"])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op.tn_weight_grad(torch.randn(8, 4), torch.randn(8, 20))
    with pytest.raises(RuntimeError, match="same rows"):
        op.tn_weight_grad(torch.randn(8, 4), torch.randn(9, 16))


@pytest.mark.parametrize("shape", ["llama-gqa", "llama-mha-biases"])
def test_fp16_kv_cache_kernels_match_the_python_step_over_the_same_cache(op, shape: str) -> None:
    """kv_cache_dtype="fp16": every kernel set rounds this step's key and value into the float16
    cache and attends over the cache as it holds them, as the Python step does; both stay within
    a float16 rounding of the float32 cache's logits. head_dim 12 (llama-mha-biases): the scalar
    tail of the conversions."""
    model = _model(*SHAPES[shape])
    ids, mask, positions = _prompts(batch=5, width=7)
    steps = 9
    tokens = torch.randint(3, VOCAB, (5, steps), generator=torch.Generator().manual_seed(3))
    exact = _run_steps(CpuLlamaDecoder(model, 5, 7 + steps, cpu_kernel=False), ids, mask, positions, tokens)
    reference = CpuLlamaDecoder(model, 5, 7 + steps, cpu_kernel=False, kv_cache_dtype="fp16")
    assert reference.cache_dtype == torch.float16 and reference.keys[0].dtype == torch.float16
    want = _run_steps(reference, ids, mask, positions, tokens)
    scale = max(float(w.abs().max()) for w in want)
    for w, e in zip(want, exact):  # a float16 rounding of keys and values, no more
        assert 0 < float((w - e).abs().max()) < 2e-3 * scale
    for isa in op.supported_isas():
        fused = CpuLlamaDecoder(model, 5, 7 + steps, cpu_kernel=True, kernel_isa=isa, packed_gemm=True,
                                 kv_cache_dtype="fp16")
        got = _run_steps(fused, ids, mask, positions, tokens)
        for step, (g, w) in enumerate(zip(got, want)):
            # A key one float32 ulp apart may round to a neighbouring float16, and a few such keys
            # add up (1.1e-5 seen on the scalar set): 3e-5, still 60x inside a float16 cache's rounding.
            torch.testing.assert_close(g, w, atol=3e-5 * scale, rtol=0, msg=lambda m: f"{isa} step {step}: {m}")
        for layer in range(len(model.model.layers)):
            for cache in ("keys", "values"):
                g = getattr(fused, cache)[layer][:, :, : 7 + steps]
                w = getattr(reference, cache)[layer][:, :, : 7 + steps]
                assert g.dtype == torch.float16
                torch.testing.assert_close(g.float(), w.float(), atol=2e-3, rtol=1e-3)  # one float16 ulp


def test_fp16_kv_cache_is_for_float32_models_on_the_cpu() -> None:
    model = _model(*SHAPES["llama-gqa"])
    assert CpuLlamaDecoder(model, 2, 8).cache_dtype == torch.float32  # generate()'s default: "model"
    assert CpuLlamaDecoder(model, 2, 8, kv_cache_dtype="model").cache_dtype == torch.float32
    assert CpuLlamaDecoder(model, 2, 8, kv_cache_dtype="auto").cache_dtype == torch.float16  # rlhf ppo's default
    model = model.to(torch.bfloat16)
    for choice in ("auto", "fp16"):  # a 16-bit model's cache is already 16-bit
        assert CpuLlamaDecoder(model, 2, 8, kv_cache_dtype=choice).cache_dtype == torch.bfloat16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_halved("auto", torch.float32, cpu, "llama") and kv_cache_halved("fp16", torch.float32, cpu)
    assert not kv_cache_halved("model", torch.float32, cpu, "llama")
    assert not kv_cache_halved("auto", torch.float32, cuda, "llama")
    assert not kv_cache_halved("auto", torch.float32, cpu, "gpt2")  # the Hugging Face forward's own cache
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        SamplingParams(max_new_tokens=4, pad_token_id=0, kv_cache_dtype="fp8")


@pytest.mark.parametrize("layout", ["column-major", "row-major", "column slice", "strided both"])
@pytest.mark.parametrize("depth", [12, 40])
def test_pack_panels_lays_out_sixteen_columns_per_panel_zero_padded(op, layout: str, depth: int) -> None:
    # The [in, out] views the step packs: a [out, in] weight's .t() (through every ISA's register
    # transposes where `depth` has whole tiles, the rest one float at a time), a transposed copy,
    # gate's or up's columns of the fused gate/up copy, and a view strided both ways.
    weight_t = {"column-major": lambda: torch.randn(37, depth).t(), "row-major": lambda: torch.randn(depth, 37),
                "column slice": lambda: torch.randn(depth, 50)[:, 5:42],
                "strided both": lambda: torch.randn(2 * depth, 74)[::2, ::2]}[layout]()
    for isa in op.supported_isas():
        packed = op.pack_panels(weight_t, isa=isa)
        assert packed.shape == (3, depth, 16)
        for p in range(3):
            cols = weight_t[:, 16 * p : 16 * (p + 1)]
            assert torch.equal(packed[p, :, : cols.shape[1]], cols)
            assert not packed[p, :, cols.shape[1] :].any()
        gate_t, up_t = weight_t, weight_t * 2
        pairs = op.pack_swiglu_panels(gate_t, up_t, isa=isa)
        assert torch.equal(pairs[0::2], packed) and torch.equal(pairs[1::2], op.pack_panels(up_t, isa=isa))


def test_packed_gemm_follows_the_models_linears_unless_asked(op) -> None:
    """"auto" packs where the model's linears left MKL for oneDNN (--cpu-matmul), else keeps MKL."""
    model = _model(*SHAPES["llama-gqa"])
    assert not CpuLlamaDecoder(model, 2, 8).packed_gemm
    assert CpuLlamaDecoder(model, 2, 8, packed_gemm=True).packed_gemm
    if onednn_available():
        use_onednn_linears(model)
        assert CpuLlamaDecoder(model, 2, 8).packed_gemm
        assert not CpuLlamaDecoder(model, 2, 8, packed_gemm=False).packed_gemm


def test_expanded_packed_decoder_shares_its_packed_weights_and_matches(op) -> None:
    """Group sampling rebuilds the step over the expanded cache: the packed weights are reused,
    the logits stay the reference's."""
    model = _model(*SHAPES["qwen2-gqa-qkv-bias"])
    ids, mask, positions = _prompts(batch=2, width=5)
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    full = torch.cat([mask.index_select(0, index), torch.ones(6, 3, dtype=mask.dtype)], dim=1)
    logits = {}
    with torch.no_grad():
        for packed in (False, True):
            decoder = CpuLlamaDecoder(model, 2, 8, cpu_kernel=True, packed_gemm=packed)
            decoder.prefill(ids, mask, positions)
            before = decoder._packed
            decoder.expand(index)
            assert decoder.packed_gemm == packed and decoder._packed is before
            pos = positions.index_select(0, index)[:, -1:]
            tokens = torch.arange(6)[:, None] + 3
            logits[packed] = [decoder.decode(tokens + step, full[:, : 6 + step], pos + step + 1) for step in range(3)]
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, atol=2e-6 * float(want.abs().max()), rtol=0)


def test_generate_uses_the_kernel_and_keeps_greedy_tokens(op, monkeypatch) -> None:
    model = _model(*SHAPES["qwen2-gqa-qkv-bias"])
    ids, mask, _ = _prompts(batch=4, width=6)
    params = SamplingParams(max_new_tokens=12, pad_token_id=0, do_sample=False)
    built: list[str | None] = []
    init = CpuLlamaDecoder.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.kernel_isa)

    monkeypatch.setattr(CpuLlamaDecoder, "__init__", spy)
    fused = generate(model, ids, mask, params)
    assert built == [op.supported_isas()[-1]]
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.sequences, hf)


def test_models_the_kernel_cannot_run_keep_the_python_step(op) -> None:
    model = _model(*SHAPES["llama-gqa"])
    bf16 = _model(*SHAPES["llama-gqa"]).to(torch.bfloat16)
    assert CpuLlamaDecoder(bf16, 2, 8).kernel_isa is None
    with pytest.raises(ValueError, match="float32 only"):
        CpuLlamaDecoder(bf16, 2, 8, cpu_kernel=True)
    gelu = _model(*SHAPES["llama-gqa"])
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="not SiLU"):
        CpuLlamaDecoder(gelu, 2, 8, cpu_kernel=True)
    with pytest.raises(RuntimeError, match="unknown or unsupported isa"):
        CpuLlamaDecoder(model, 2, 8, cpu_kernel=True, kernel_isa="sse9")


def test_bad_steps_fail_with_a_clear_error(op) -> None:
    model = _model(*SHAPES["llama-gqa"])
    ids, mask, positions = _prompts(batch=2, width=3)
    decoder = CpuLlamaDecoder(model, 2, 4, cpu_kernel=True)
    with torch.no_grad():
        decoder.prefill(ids, mask, positions)
        full = torch.ones(2, 5, dtype=mask.dtype)
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            decoder.decode(torch.tensor([[1], [VOCAB]]), full[:, :4], positions[:, -1:] + 1)
        decoder.decode(torch.tensor([[1], [2]]), full[:, :4], positions[:, -1:] + 1)
        with pytest.raises(RuntimeError, match="KV cache overflow"):
            decoder.decode(torch.tensor([[1], [2]]), full[:, :5], positions[:, -1:] + 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_sampler_draws_what_sample_from_logits_draws(op, temperature: float) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(4000, 101, generator=gen)
    logits[:, 7] = float("-inf")  # a removed token
    uniform = torch.rand(4000, generator=gen)
    uniform[:2] = torch.tensor([0.0, 1.0 - 2**-24])  # the ends of [0, 1)
    want = sample_from_logits(process_logits(logits, temperature), uniform=uniform)
    for isa in op.supported_isas():
        got = op.sample(logits, uniform, temperature, isa)
        # The same contract; only a last-bit difference of exp could move a draw across a CDF step.
        assert int((got != want).sum()) <= 2, isa
        assert not bool((got == 7).any())
        assert int(got[0]) == 0  # u = 0: the first token of positive mass


def test_sample_next_token_takes_the_fused_sampler_without_top_k_or_top_p(op, monkeypatch) -> None:
    calls: list[int] = []
    real = op.sample
    monkeypatch.setattr(op, "sample", lambda *args: calls.append(1) or real(*args))
    logits = torch.randn(6, 50)
    plain = SamplingParams(max_new_tokens=1, pad_token_id=0, temperature=0.9)
    first = sample_next_token(logits, plain, torch.Generator().manual_seed(5))
    again = sample_next_token(logits, plain, torch.Generator().manual_seed(5))
    assert calls == [1, 1] and torch.equal(first, again)
    sample_next_token(logits, SamplingParams(max_new_tokens=1, pad_token_id=0, top_k=5), torch.Generator())
    sample_next_token(logits.double(), plain, torch.Generator())
    assert calls == [1, 1]  # top-k, and float64 logits, take the torch path


def _transcript(batch: int, width: int, eos: list[int], gen: torch.Generator) -> Transcript:
    sequences = torch.randint(1, VOCAB, (batch, width), generator=gen)
    finished = torch.rand(batch, generator=gen) < 0.3
    return Transcript(sequences, torch.zeros_like(sequences, dtype=torch.bool),
                                  torch.zeros_like(sequences, dtype=torch.float32), finished, torch.tensor(eos))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("suppress_eos", [False, True])
@pytest.mark.parametrize("subset", [False, True])
def test_fused_step_record_matches_the_python_loop_body(op, temperature: float, suppress_eos: bool,
                                                        subset: bool) -> None:
    """sample_record is decode_loop.record_python in one call: same tokens (the same sampler kernel),
    same bookkeeping of finished rows, EOS and pads; log-probs to the last bit of a sum's order."""
    gen = torch.Generator().manual_seed(11)
    batch, col, eos = 64, 5, [3, 9]
    params = SamplingParams(max_new_tokens=1, pad_token_id=0, eos_token_id=eos, temperature=temperature)
    for isa in op.supported_isas():
        want = _transcript(batch, 8, eos, gen)
        got = Transcript(*(t.clone() for t in (want.sequences, want.action_mask, want.token_logprobs,
                                                            want.finished, want.eos_ids)))
        # Decoded rows: all of them, or the unfinished ones and a few finished (not yet dropped).
        rows = (~want.finished | (torch.arange(batch) % 5 == 0)).nonzero().squeeze(1) if subset else None
        logits = 2 * torch.randn(batch if rows is None else rows.numel(), VOCAB, generator=gen)
        logits[:, eos] += 4.0  # EOS likely, so rows finish
        uniform = torch.rand(batch, generator=gen)
        record_python(want, logits, uniform, rows, col, suppress_eos, params, sample_next_token)
        tokens = op.sample_record(logits, uniform, torch.empty(0, dtype=torch.long) if rows is None else rows,
                                  temperature, got.eos_ids, suppress_eos, 0, col, got.sequences, got.action_mask,
                                  got.token_logprobs, got.finished, isa)
        assert torch.equal(got.sequences, want.sequences), isa
        assert torch.equal(got.action_mask, want.action_mask) and torch.equal(got.finished, want.finished)
        torch.testing.assert_close(got.token_logprobs, want.token_logprobs, atol=2e-6, rtol=1e-6)
        picked = want.sequences[:, col] if rows is None else want.sequences[rows, col]
        assert torch.equal(tokens, picked[:, None])
        assert bool(want.finished.any()) and bool((want.sequences[:, col] == 0).any())
        drew_eos = bool(torch.isin(want.sequences[want.action_mask[:, col], col], torch.tensor(eos)).any())
        assert drew_eos != suppress_eos  # EOS is likely, unless suppressed


def test_generate_records_steps_in_the_fused_op_and_matches_the_python_body(op, monkeypatch) -> None:
    """With EOS, min_new_tokens and finished rows dropped from the decode batch, generate() gives the
    same rollouts with the fused step record as with the Python loop body."""
    model = _model(*SHAPES["llama-gqa"])
    ids, mask, _ = _prompts(batch=8, width=6)
    params = SamplingParams(max_new_tokens=24, pad_token_id=0, eos_token_id=[5, 17, 30], min_new_tokens=3,
                            temperature=0.9, sync_every=2)
    calls: list[int] = []
    real = op.sample_record
    monkeypatch.setattr(op, "sample_record", lambda *args: calls.append(1) or real(*args))
    fused = generate(model, ids, mask, params, torch.Generator().manual_seed(2))
    assert calls and len(calls) <= 24
    monkeypatch.setattr(CpuBackend, "recorder", lambda self, logits, params: None)
    python = generate(model, ids, mask, params, torch.Generator().manual_seed(2))
    assert torch.equal(fused.sequences, python.sequences) and torch.equal(fused.action_mask, python.action_mask)
    torch.testing.assert_close(fused.logprobs, python.logprobs, atol=2e-6, rtol=1e-6)
    lengths = fused.action_mask.sum(1)
    assert int(lengths.min()) >= 3 and int(lengths.min()) < 24  # EOS after min_new_tokens ended some rows
