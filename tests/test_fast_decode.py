"""The fast Llama-family decoder: parity with the HF-forward reference path and HF generate, fallbacks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from rlhf.engine.fast_decode import (
    FastLlamaDecoder,
    apply_rope,
    fast_decode_unsupported_reason,
    rms_norm,
    signed_sin,
)
from rlhf.engine.backends.cpu import CpuBackend
from rlhf.engine.backends.base import generation_kernels
from rlhf.engine.backends.registry import using_backend
from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
from rlhf.engine.backends.cuda import kernels
from rlhf.engine.backends.cuda.decoder import CudaLlamaDecoder
from rlhf.engine.backends.cuda.kernels import DECODE_ATTENTION_OP
from rlhf.engine.generation import GenerationOutput, HFForwardRunner, generate, select_runner
from rlhf.engine.ops import load_op
from rlhf.engine.positions import position_ids_from_mask
from rlhf.engine.sampling import SamplingParams
from rlhf.models.tiny import build_tiny_model, tiny_config
from tests.conftest import SyncCounter
from tests.test_generation import PAD, batch, tok  # noqa: F401 (the same left-padded prompts and fixtures)

FAST_FAMILIES = ("llama", "qwen2", "mistral")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _build(family: str, tok, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    model = build_tiny_model(family, tok, seed=0).to(dtype).eval()
    if family == "qwen2":
        # HF initialises Qwen2's q/k/v biases to zero; random ones make the fused bias matter.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(0.2 * torch.randn(proj.bias.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def models(tok) -> dict[str, PreTrainedModel]:
    return {family: _build(family, tok) for family in FAST_FAMILIES}


def _greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, pad_token_id=PAD, do_sample=False, **kwargs)


def test_pure_math_against_hand_values() -> None:
    # rms of [3, 4] is sqrt(12.5): [3, 4] / 3.5355 * [1, 2].
    out = rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), eps=0.0)
    assert torch.allclose(out, torch.tensor([[3.0, 8.0]]) / 12.5**0.5)
    # Rotate-half convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per frequency.
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cos, sin = torch.tensor([0.5, 0.25, 0.5, 0.25]), torch.tensor([0.5, 0.75, 0.5, 0.75])
    assert signed_sin(sin).tolist() == [-0.5, -0.75, 0.5, 0.75]
    expected = torch.tensor([1 * 0.5 - 3 * 0.5, 2 * 0.25 - 4 * 0.75, 3 * 0.5 + 1 * 0.5, 4 * 0.25 + 2 * 0.75])
    assert torch.equal(apply_rope(x, cos, signed_sin(sin)), expected)
    # Bit for bit HF's rotate-half form on random values.
    x, cos, sin = torch.randn(3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    hf = x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin
    assert torch.equal(apply_rope(x, cos, signed_sin(sin)), hf)


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_greedy_matches_reference_and_hf_with_eos(models, batch, tok, family: str) -> None:
    model, (ids, mask) = models[family], batch
    n = 16
    assert fast_decode_unsupported_reason(model) is None
    free = generate(model, ids, mask, _greedy(n), fast=True)
    # Row 0's token at step 3 as an extra stop id: that row stops mid-rollout, the others go on.
    eos = [int(free.sequences[0, ids.shape[1] + 3]), tok.eos_token_id]
    fast = generate(model, ids, mask, _greedy(n, eos_token_id=eos), fast=True)
    ref = generate(model, ids, mask, _greedy(n, eos_token_id=eos), fast=False)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                        eos_token_id=eos, pad_token_id=PAD)
    hf = torch.nn.functional.pad(hf, (0, fast.sequences.shape[1] - hf.shape[1]), value=PAD)
    assert torch.equal(fast.sequences, ref.sequences) and torch.equal(fast.sequences, hf)
    assert torch.equal(fast.action_mask, ref.action_mask) and torch.equal(fast.finished, ref.finished)
    assert bool(fast.finished[0]) and int(fast.response_lengths[0]) <= 4 and not fast.finished.all()


STEP_KINDS = {
    # The torch path of every device (engine/fast_decode.py).
    "python-step": (FastLlamaDecoder, dict(attention_kernel=False)),
    # The CPU decoder's Python step (no fused op).
    "cpu-python-step": (CpuLlamaDecoder, dict(cpu_kernel=False, attention_kernel=False)),
    # Decode steps run the fused CPU op (engine/backends/cpu/decode_op.py) where it builds.
    "fused-step": (CpuLlamaDecoder, dict(cpu_kernel="auto")),
    # The torch step attending through decode_attention_reference over the whole cache under the key mask.
    "decode-attention": (FastLlamaDecoder, dict(attention_kernel=True)),
    # The CUDA decoder's step attending through kernels.decode_attention: on the CPU its reference, fed
    # the decoder's own cache buffers and key mask, which is what the CUDA op reads on a GPU.
    "cuda-decode-attention": (CudaLlamaDecoder, dict(attention_kernel=True)),
    # The step over static buffers a CUDA graph replays (engine/backends/cuda/decode_graph.py), run eagerly here.
    "static-step": (CudaLlamaDecoder, dict(cuda_graph=True)),
}


@pytest.mark.parametrize("step_kind", list(STEP_KINDS))
@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_logits_match_the_reference_every_step(models, batch, family: str, step_kind: str) -> None:
    model, (ids, mask) = models[family], batch
    b, p = ids.shape
    steps = 8
    decoder, kwargs = STEP_KINDS[step_kind]
    fast = decoder(model, b, p + steps, **kwargs)
    assert fast.uses_attention_kernel == step_kind.endswith("decode-attention")
    ref = HFForwardRunner(model, p + steps)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        fast_logits = fast.prefill(ids, mask, positions)
        ref_logits = ref.prefill(ids, mask, positions)
        full_mask = torch.cat([mask, torch.ones(b, steps, dtype=mask.dtype)], dim=1)
        for step in range(steps):
            torch.testing.assert_close(fast_logits, ref_logits, atol=1e-4, rtol=0)
            if step == steps - 1:
                break
            token = ref_logits.argmax(-1, keepdim=True)  # both fed the same token
            width = p + step + 1
            pos = positions[:, -1:] + step + 1
            fast_logits = fast.decode(token, full_mask[:, :width], pos)
            ref_logits = ref.decode(token, full_mask[:, :width], pos)
    assert fast.length == ref.cache.get_seq_length() == p + steps - 1
    assert getattr(fast, "wants_cuda_graph", False) == (step_kind == "static-step")


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_sampled_tokens_match_the_reference_under_one_seed(models, batch, family: str) -> None:
    model, (ids, mask) = models[family], batch
    params = SamplingParams(max_new_tokens=12, pad_token_id=PAD, temperature=0.8, top_k=20, top_p=0.9)
    fast = generate(model, ids, mask, params, torch.Generator().manual_seed(7), fast=True)
    ref = generate(model, ids, mask, params, torch.Generator().manual_seed(7), fast=False)
    other = generate(model, ids, mask, params, torch.Generator().manual_seed(8), fast=True)
    assert torch.equal(fast.sequences, ref.sequences)
    assert not torch.equal(fast.sequences, other.sequences)  # the seed does drive the draws


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_greedy_matches_the_reference(tok, batch, family: str) -> None:
    model, (ids, mask) = _build(family, tok, torch.bfloat16), batch
    fast = generate(model, ids, mask, _greedy(10), fast=True)
    ref = generate(model, ids, mask, _greedy(10), fast=False)
    assert torch.equal(fast.sequences, ref.sequences)


def test_scaled_rope_comes_from_the_models_rotary_module(tok, batch) -> None:
    ids, mask = batch
    # YaRN rescales frequencies and multiplies cos/sin by an attention factor (~1.14 here).
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    config = tiny_config("llama", vocab_size=len(tok))
    config.rope_parameters = rope
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.model.rotary_emb.attention_scaling > 1.1 and fast_decode_unsupported_reason(model) is None
    decoder = FastLlamaDecoder(model, ids.shape[0], 32)
    cos, _ = model.model.rotary_emb(torch.empty(0), torch.arange(32)[None])
    assert torch.equal(decoder.cos, cos[0])
    fast = generate(model, ids, mask, _greedy(10), fast=True)
    assert torch.equal(fast.sequences, generate(model, ids, mask, _greedy(10), fast=False).sequences)
    default_rope = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok))).eval()
    default_rope.load_state_dict(model.state_dict())
    assert not torch.equal(fast.sequences, generate(default_rope, ids, mask, _greedy(10), fast=True).sequences)


def _fallback_models(tok) -> dict[str, tuple[PreTrainedModel, str]]:
    """Models the fast decoder must refuse, with a word of the expected reason."""
    sliding = tiny_config("mistral", vocab_size=len(tok))
    sliding.sliding_window = 5
    dynamic = LlamaConfig(**{**tiny_config("llama", vocab_size=len(tok)).to_dict(),
                             "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    hooked = build_tiny_model("llama", tok, seed=0).eval()
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, out: None)
    torch.manual_seed(0)
    return {
        "opt": (build_tiny_model("opt", tok, seed=0).eval(), "model type"),
        "gpt2": (build_tiny_model("gpt2", tok, seed=0).eval(), "model type"),
        "sliding": (AutoModelForCausalLM.from_config(sliding).eval(), "window"),
        "dynamic rope": (AutoModelForCausalLM.from_config(dynamic).eval(), "rope type"),
        "hooks": (hooked, "hooks"),
        "training": (build_tiny_model("llama", tok, seed=0).train(), "training"),
    }


def test_unsupported_models_take_the_hf_forward(tok, batch) -> None:
    ids, mask = batch
    for name, (model, word) in _fallback_models(tok).items():
        reason = fast_decode_unsupported_reason(model)
        assert reason is not None and word in reason, (name, reason)
        assert isinstance(select_runner(model, ids.shape[0], ids.shape[1] + 4), HFForwardRunner)
        with pytest.raises(ValueError, match=word):
            generate(model, ids, mask, _greedy(4), fast=True)
        if name != "training":  # dropout-free configs, so "auto" must equal the reference exactly
            auto = generate(model, ids, mask, _greedy(6))
            assert torch.equal(auto.sequences, generate(model, ids, mask, _greedy(6), fast=False).sequences)


def test_fast_decode_steps_do_not_sync_with_the_host(models, batch) -> None:
    model, (ids, mask) = models["llama"], batch

    def syncs(max_new: int) -> int:
        params = SamplingParams(max_new_tokens=max_new, pad_token_id=PAD, top_k=5, top_p=0.9, sync_every=0)
        with SyncCounter() as counter:
            generate(model, ids, mask, params, generator=torch.Generator().manual_seed(0), fast=True)
        return counter.count

    assert syncs(12) == syncs(1)


def test_fast_path_stops_at_a_sync_point_once_every_row_finished(models, batch, monkeypatch) -> None:
    model, (ids, mask) = models["mistral"], batch
    p = ids.shape[1]
    eos = sorted(set(generate(model, ids, mask, _greedy(3), fast=True).sequences[:, p + 1].tolist()))
    calls = []
    decode = CpuLlamaDecoder.decode  # the CPU backend's fast decoder (generate's runner here)
    monkeypatch.setattr(
        CpuLlamaDecoder, "decode", lambda self, *args: calls.append(1) or decode(self, *args)
    )
    early = generate(model, ids, mask, _greedy(20, eos_token_id=eos, sync_every=2), fast=True)
    n_early = len(calls)
    full = generate(model, ids, mask, _greedy(20, eos_token_id=eos, sync_every=0), fast=True)
    assert (n_early, len(calls) - n_early) == (1, 19)  # every row done after step 1, vs all 19 steps
    assert torch.equal(early.sequences, full.sequences) and early.finished.all()


def test_decode_attention_kernel_is_not_used_on_cpu(models, batch, monkeypatch) -> None:
    """On the CPU "auto" keeps SDPA (the CUDA op cannot run there); greedy tokens are unchanged."""
    model, (ids, mask) = models["llama"], batch
    runner = select_runner(model, ids.shape[0], ids.shape[1] + 6)
    assert isinstance(runner, FastLlamaDecoder) and not runner.uses_attention_kernel
    assert not CudaLlamaDecoder(model, ids.shape[0], ids.shape[1] + 6, attention_kernel="auto").uses_attention_kernel

    def no_kernel(*args, **kwargs):
        raise AssertionError("decode_attention called on the CPU")

    monkeypatch.setattr(kernels, "decode_attention", no_kernel)
    monkeypatch.setattr(FastLlamaDecoder, "decode_attention", staticmethod(no_kernel))
    monkeypatch.setattr(CudaLlamaDecoder, "decode_attention", staticmethod(no_kernel))
    fast = generate(model, ids, mask, _greedy(6), fast=True)
    assert torch.equal(fast.sequences, generate(model, ids, mask, _greedy(6), fast=False).sequences)


def _peaked_cuda_model(tok, dtype: torch.dtype) -> PreTrainedModel:
    """A tiny Llama on the GPU with a head size the CUDA op is built for (32) and peaked next-token
    distributions, so tokens do not flip on the rounding differences between attention paths."""
    model = build_tiny_model("llama", tok, seed=0, hidden_size=128, num_heads=4, num_kv_heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to("cuda", dtype).eval()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_attention_kernel_generates_like_the_reference(tok, batch, dtype: torch.dtype) -> None:
    assert load_op(DECODE_ATTENTION_OP.name) is not None, "rlhf_decode_attention must build on a GPU machine"
    model = _peaked_cuda_model(tok, dtype)
    ids, mask = (t.cuda() for t in batch)
    runner = select_runner(model, ids.shape[0], ids.shape[1] + 16)
    assert isinstance(runner, CudaLlamaDecoder) and runner.uses_attention_kernel
    with generation_kernels(False):
        assert not select_runner(model, ids.shape[0], ids.shape[1] + 16).uses_attention_kernel
    if dtype == torch.bfloat16:
        # bf16 logits carry ~1% rounding noise whichever attention runs, so greedy paths part at
        # near-ties: every token the kernel picks must be the argmax of a teacher-forced forward
        # of its own sequence (SDPA), up to that noise.
        greedy = generate(model, ids, mask, _greedy(16), fast=True)
        _assert_greedy_under_teacher_forcing(model, greedy)
        return
    sampled = SamplingParams(max_new_tokens=16, pad_token_id=PAD, temperature=0.8, top_k=20, top_p=0.9)
    for params in (_greedy(16), sampled):
        kernel = generate(model, ids, mask, params, torch.Generator(device="cuda").manual_seed(5), fast=True)
        with generation_kernels(False):  # SDPA attention and the torch sampler
            ref = generate(model, ids, mask, params, torch.Generator(device="cuda").manual_seed(5), fast=True)
        assert torch.equal(kernel.sequences, ref.sequences), params
        assert torch.equal(kernel.action_mask, ref.action_mask)


def _assert_greedy_under_teacher_forcing(model: PreTrainedModel, out: GenerationOutput) -> None:
    """Each generated token's logit in a full forward of the sequence is within 3% of that
    position's logit range of the maximum (a wrong cache slot or mask picks far-off tokens)."""
    with torch.no_grad(), generation_kernels(False):
        positions = position_ids_from_mask(out.attention_mask)
        logits = model(out.sequences, attention_mask=out.attention_mask, position_ids=positions).logits
    start = out.prompt_length
    step_logits = logits[:, start - 1 : -1].float()
    chosen = step_logits.gather(-1, out.sequences[:, start:, None]).squeeze(-1)
    top, bottom = step_logits.max(-1).values, step_logits.min(-1).values
    shortfall = (top - chosen) / (top - bottom)
    assert shortfall.max().item() <= 0.03, shortfall


def test_weights_are_read_from_the_model_not_copied_where_no_fusion_is_needed(models, batch) -> None:
    qwen = models["qwen2"]  # tied embeddings: lm_head is the embedding table
    for decoder in (FastLlamaDecoder(qwen, 2, 8), CpuLlamaDecoder(qwen, 2, 8)):  # the CPU's transposes its own way
        assert decoder.lm_head.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
        layer, attn = decoder.layers[0], qwen.model.layers[0].self_attn
        assert layer.wo.data_ptr() == attn.o_proj.weight.data_ptr()
        assert torch.equal(layer.wqkv_t, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t())
        assert layer.wqkv_t.is_contiguous() and layer.w_gate_up_t.is_contiguous()
        assert torch.equal(layer.bqkv, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_a_fused_model_prefills_through_the_fused_layer_ops(models, batch, family: str, monkeypatch) -> None:
    # A model whose layers run the fused layer ops (--fused-layers) prefills through them too:
    # the same logits as the plain model's reference prefill, the same cache for later steps.
    import copy

    from rlhf.engine.backends.cpu import fused_layers

    plain, (ids, mask) = models[family], batch
    fused = copy.deepcopy(plain)
    assert fused_layers.fuse_layer_ops(fused) > 0 and fused_layers.uses_fused_layers(fused)
    assert not fused_layers.uses_fused_layers(plain)
    calls = {"attention": 0}
    kernel_attention = fused_layers.attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return kernel_attention(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "attention", counted)
    b, p = ids.shape
    decoder = CpuLlamaDecoder(fused, b, p + 4, cpu_kernel=False)
    assert decoder.fused_prefill and not CpuLlamaDecoder(plain, b, p + 4).fused_prefill
    ref = HFForwardRunner(plain, p + 4)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        torch.testing.assert_close(decoder.prefill(ids, mask, positions), ref.prefill(ids, mask, positions),
                                   atol=1e-4, rtol=0)
        assert calls["attention"] == len(plain.model.layers)
        token = torch.full((b, 1), 5)
        full_mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
        torch.testing.assert_close(decoder.decode(token, full_mask, positions[:, -1:] + 1),
                                   ref.decode(token, full_mask, positions[:, -1:] + 1), atol=1e-4, rtol=0)
    assert calls["attention"] == len(plain.model.layers)  # decode steps do not go through it
    assert torch.equal(generate(fused, ids, mask, _greedy(8)).sequences, generate(plain, ids, mask, _greedy(8)).sequences)


def test_static_step_generates_like_the_decoder_through_dropped_rows_and_groups(models, batch) -> None:
    """generate() over the static-buffer step (what a CUDA graph replays) gives the tokens of the
    decoder's own step, through finished rows dropped (expand) and group sampling's copies."""

    class StaticStepBackend(CpuBackend):
        """The CPU backend whose fast decoder is the CUDA one: its static-buffer step (run eagerly), or its
        own step."""

        def __init__(self, static: bool) -> None:
            super().__init__()
            self.static = static

        def fast_decoder(self, model, batch, max_len, kv_cache_dtype="model"):
            return CudaLlamaDecoder(model, batch, max_len, cuda_graph=self.static)

    model, (ids, mask) = models["llama"], batch
    params = SamplingParams(max_new_tokens=12, pad_token_id=PAD, eos_token_id=[7, 40], temperature=0.9,
                            sync_every=2)
    runs = {}
    for static in (False, True):
        with using_backend(StaticStepBackend(static)):
            assert select_runner(model, ids.shape[0], 20).wants_cuda_graph == static
            runs[static] = [generate(model, ids, mask, params, torch.Generator().manual_seed(3), fast=True,
                                     samples_per_prompt=n) for n in (1, 3)]
    for eager, static in zip(runs[False], runs[True]):
        assert torch.equal(eager.sequences, static.sequences) and torch.equal(eager.action_mask, static.action_mask)
    assert runs[True][0].finished.any()  # rows did finish, so some were dropped mid-rollout


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_decode_replays_the_static_step(tok, batch, monkeypatch) -> None:
    """On a GPU: the captured step's logits follow the eager decoder's step by step (fp16, the
    decode attention op in both), and generate() through graphs picks argmax tokens (bf16)."""
    model = _peaked_cuda_model(tok, torch.float16)
    ids, mask = (t.cuda() for t in batch)
    b, p = ids.shape
    steps = 8
    graphed = CudaLlamaDecoder(model, b, p + steps, cuda_graph=True)
    eager = CudaLlamaDecoder(model, b, p + steps, cuda_graph=False)
    positions = position_ids_from_mask(mask)
    full_mask = torch.cat([mask, torch.ones(b, steps, dtype=mask.dtype, device="cuda")], dim=1)
    with torch.no_grad():
        g, e = graphed.prefill(ids, mask, positions), eager.prefill(ids, mask, positions)
        for step in range(steps - 1):
            torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)
            token, pos = e.argmax(-1, keepdim=True), positions[:, -1:] + step + 1
            g = graphed.decode(token, full_mask[:, : p + step + 1], pos)
            e = eager.decode(token, full_mask[:, : p + step + 1], pos)
    assert graphed.graphs is not None and graphed.graphs.replays == steps - 2
    bf16 = _peaked_cuda_model(tok, torch.bfloat16)
    monkeypatch.setenv("RLHF_CUDA_GRAPH_DECODE", "1")  # how generate() is asked for graph-replayed steps
    _assert_greedy_under_teacher_forcing(bf16, generate(bf16, ids, mask, _greedy(16), fast=True))
