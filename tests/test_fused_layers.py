"""Fused RMSNorm / RoPE / SwiGLU / attention (csrc/layers/, engine/backends/cpu/fused_layers.py) against their references.

The references are Hugging Face's code op for op; the fused kernels (every kernel set this CPU
runs) must match their values and autograd gradients, and a model whose layers were swapped
must give the logits and parameter gradients of the unswapped model: Llama with GQA and tied
embeddings, Qwen2 with q/k/v biases, Mistral, with left padding and through a KV cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.engine.backends.cpu import matmul as cpu_matmul
from rlhf.engine.backends.cpu import fused_layers as fused_layers_module
from rlhf.engine.backends.cpu.matmul import onednn_available, use_onednn_linears
from rlhf.engine.fsdp import enable_activation_checkpointing
from rlhf.engine.backends.cpu.fused_layers import (
    attention,
    attention_reference,
    fuse_layer_ops,
    packed_swiglu,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_attention,
    rope_reference,
    swiglu,
    swiglu_reference,
)
from rlhf.engine.kv_cache import cache_argument, returned_cache
from rlhf.engine.backends.cpu.layer_op import FUSED_LAYERS_OP, transposed
from rlhf.engine.ops import load_op
from rlhf.models.tiny import tiny_config

VOCAB = 97


@pytest.fixture(scope="module")
def op():
    module = load_op(FUSED_LAYERS_OP.name)
    if module is None:
        pytest.skip("rlhf_fused_layers cannot be built here (no C++ compiler?)")
    return module


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _value_and_grads(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    tracked = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*tracked)
    out.backward(grad)
    return [out.detach(), *[t.grad for t in tracked]]


@pytest.mark.parametrize("isa_index", [0, -1], ids=["scalar", "widest"])
def test_kernels_match_references(op, isa_index: int) -> None:
    """Each kernel set directly: widths off the vector width, GQA heads, shared and per-row RoPE tables."""
    isa = op.supported_isas()[isa_index]
    gen = torch.Generator().manual_seed(1)
    x, w, g = torch.randn(9, 7, 45, generator=gen), torch.randn(45, generator=gen), torch.randn(9, 7, 45, generator=gen)
    y, rstd = op.rms_norm_forward(x, w, 1e-5, isa)
    ref = _value_and_grads(lambda a, b: rms_norm_reference(a, b, 1e-5), [x, w], g)
    _close(y, ref[0])
    gx, gw = op.rms_norm_backward(g, x, w, rstd, isa)
    _close(gx, ref[1], rtol=1e-4, atol=1e-5)
    _close(gw, ref[2], rtol=1e-4, atol=1e-4)

    gate, up = 5 * torch.randn(4, 3, 29, generator=gen), torch.randn(4, 3, 29, generator=gen)
    g = torch.randn(4, 3, 29, generator=gen)
    ref = _value_and_grads(swiglu_reference, [gate, up], g)
    _close(op.swiglu_forward(gate, up, isa), ref[0])
    for got, want in zip(op.swiglu_backward(g, gate, up, isa), ref[1:]):
        _close(got, want)

    for heads, table_rows in ((6, 1), (2, 3)):
        x = torch.randn(3, 13, heads * 20, generator=gen)
        angles = torch.randn(table_rows, 13, 20, generator=gen)
        g = torch.randn(3, heads, 13, 20, generator=gen)
        ref = _value_and_grads(lambda a: rope_reference(a, angles.cos(), angles.sin(), heads), [x], g)
        _close(op.rope_forward(x, angles.cos(), angles.sin(), heads, isa), ref[0])
        _close(op.rope_backward(g, angles.cos(), angles.sin(), isa), ref[1])


def _shared_prompt_mask(seq: int, prompt: int, responses: int) -> torch.Tensor:
    """[seq, seq] mask of a pack [prompt | response 1 | ... | response n] (engine/packing.py): each
    response sees the prompt and itself causally, not the responses between."""
    segment = torch.zeros(seq, dtype=torch.long)
    bounds = torch.linspace(prompt, seq, responses + 1).long()
    for i in range(responses):
        segment[bounds[i] : bounds[i + 1]] = i + 1
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))


def test_a_mask_shared_by_the_layers_is_scanned_once(op, monkeypatch) -> None:
    """The row spans of a mask passed unchanged to every layer's attention are found once (and
    again after the mask is edited in place); forward and backward match the reference either way."""
    found: list[int] = []
    real = op.mask_spans
    monkeypatch.setattr(op, "mask_spans", lambda m: found.append(1) or real(m))
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    mask = _shared_prompt_mask(40, 8, 2)[None, None].contiguous()
    for edit, calls in ((False, 1), (False, 1), (True, 2)):
        if edit:
            mask[0, 0, 39, 8:20] = False  # in place: the spans are found again
        tracked = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*tracked, mask, 0.25).sum().backward()
        want = [t.clone().requires_grad_() for t in (q, k, v)]
        attention_reference(*want, mask, 0.25).sum().backward()
        assert len(found) == calls
        for got, ref in zip(tracked, want):
            _close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa_index", [0, 1, -1], ids=["scalar", "avx2", "widest"])
@pytest.mark.parametrize("heads,kv_heads,seq,head_dim,masking", [
    (4, 2, 21, 24, "causal"),     # GQA, widths off every vector width
    (3, 3, 37, 32, "holes"),      # left padding and random holes, longer than a score tile
    (2, 1, 1, 8, "causal"),       # one token
    (6, 2, 70, 40, "holes"),
    (2, 2, 75, 16, "left_padded"),  # whole score tiles of padding before the first real key
    (4, 2, 150, 32, "shared_prompt"),  # packed groups: whole score tiles between a prompt and a response skipped
    (2, 2, 97, 16, "shared_prompt"),
])
def test_attention_kernels_match_sdpa(op, isa_index: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                                      masking: str) -> None:
    """Values and q/k/v gradients of every kernel set against torch's SDPA, causal or with a
    boolean mask (rows that see one run of keys, or keys with holes); with a mask, the rows of a
    query that sees no key are zeros with no gradient."""
    isas = op.supported_isas()
    isa = isas[min(isa_index, len(isas) - 1)] if isa_index >= 0 else isas[-1]
    gen = torch.Generator().manual_seed(seq)
    batch, scale = 2, head_dim**-0.5
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, seq, heads, head_dim, generator=gen)
    mask, seen = None, torch.ones(batch, seq, dtype=torch.bool)
    if masking == "shared_prompt":
        mask = torch.stack([_shared_prompt_mask(seq, prompt, responses) for prompt, responses in
                            ((20, 3), (9, 2))])[:, None].contiguous()
    elif masking != "causal":
        holes = masking == "holes"
        valid = torch.rand(batch, seq, generator=gen) > 0.3 if holes else torch.ones(batch, seq, dtype=torch.bool)
        valid[0, : seq // 3 if holes else 2 * seq // 3] = False  # left padding: row 0's first queries see nothing
        mask = (torch.ones(seq, seq, dtype=torch.bool).tril() & valid[:, None, :])[:, None].contiguous()
        seen = mask[:, 0].any(-1)
    tracked = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention_reference(*tracked, mask, scale)
    grad = grad * seen[:, :, None, None]  # nothing reads a row that saw nothing (torch gives it NaN)
    want.backward(grad)
    out, lse = op.attention_forward(q, k, v, mask, scale, isa)
    _close(out[seen], want.detach()[seen], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    for got, t in zip(op.attention_backward(grad, q, k, v, mask, out, lse, scale, isa), tracked):
        _close(got, torch.nan_to_num(t.grad), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 3), (1023, 17), (16, 48), (1040, 48), (259, 4099), (1_000_007, 1),
                                        (1, 1_000_007)])
def test_transpose_is_torchs_transposed_copy(op, rows: int, cols: int) -> None:
    """Every kernel set's transpose (whole register tiles, edges, row blocks split across threads and
    256-row blocks within them) gives x.t().contiguous() exactly, and `transposed` takes the op for
    plain matrices only."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    want = x.t().contiguous()
    for isa in op.supported_isas():
        got = op.transpose(x, isa)
        assert got.is_contiguous() and torch.equal(got, want), isa
    assert torch.equal(transposed(x), want)
    assert torch.equal(transposed(x.double()), want.double())  # not float32: torch's copy


def test_swiglu_backward_over_its_saved_inputs(op) -> None:
    """swiglu(..., overwrite_saved=True) (the fused MLP's temporaries) writes the gradients over the
    saved gate and up: the same gradients as fresh outputs, and a second backward through the graph
    fails loudly instead of reading gradients as activations; by default the inputs stay as they were."""
    gen = torch.Generator().manual_seed(11)
    gate, up, grad = (torch.randn(37, 29, generator=gen) for _ in range(3))
    want = op.swiglu_backward(grad, gate, up)
    for overwrite in (False, True):
        tracked = [t.clone().requires_grad_() for t in (gate, up)]
        inner = [t * 1.0 for t in tracked]  # the temporaries swiglu saves
        out = swiglu(*inner, overwrite_saved=overwrite)
        out.backward(grad, retain_graph=True)
        for t, w in zip(tracked, want):
            assert torch.equal(t.grad, w)
        if overwrite:
            assert torch.equal(inner[0], want[0]) and torch.equal(inner[1], want[1])
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward(grad)
        else:
            assert torch.equal(inner[0], gate) and torch.equal(inner[1], up)
            out.backward(grad)


@pytest.mark.parametrize("isa_index", [0, 1, -1], ids=["scalar", "avx2", "widest"])
@pytest.mark.parametrize("heads,kv_heads,seq,head_dim,masking,tables", [
    (4, 2, 21, 24, "causal", 2),          # GQA, a table per batch row
    (6, 2, 70, 40, "holes", 1),           # one table for the batch
    (4, 2, 150, 32, "shared_prompt", 1),  # a packed group's mask (per-token positions in the table)
])
def test_rope_inside_attention_equals_rope_then_attention(op, isa_index: int, heads: int, kv_heads: int, seq: int,
                                                          head_dim: int, masking: str, tables: int) -> None:
    """With RoPE tables the kernels rotate the projections' token-major rows themselves: outputs,
    statistics and the gradients (before RoPE) are bit for bit those of rope_forward, attention and
    rope_backward run one after the other; through autograd, `rope_attention` matches the reference."""
    isas = op.supported_isas()
    isa = isas[min(isa_index, len(isas) - 1)] if isa_index >= 0 else isas[-1]
    gen = torch.Generator().manual_seed(seq + 1)
    batch, scale = 2, head_dim**-0.5
    query = torch.randn(batch, seq, heads * head_dim, generator=gen)
    key = torch.randn(batch, seq, kv_heads * head_dim, generator=gen)
    value = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).transpose(1, 2)  # a projection's view
    angles = torch.randn(tables, seq, head_dim // 2, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(batch, seq, heads, head_dim, generator=gen)
    mask, seen = None, torch.ones(batch, seq, dtype=torch.bool)
    if masking == "shared_prompt":
        mask = torch.stack([_shared_prompt_mask(seq, 20, 3)] * batch)[:, None].contiguous()
    elif masking == "holes":
        valid = torch.rand(batch, seq, generator=gen) > 0.3
        valid[0, : seq // 3] = False
        mask = (torch.ones(seq, seq, dtype=torch.bool).tril() & valid[:, None, :])[:, None].contiguous()
        seen = mask[:, 0].any(-1)
    grad = grad * seen[:, :, None, None]

    q4, k4 = query.view(batch, seq, heads, head_dim), key.view(batch, seq, kv_heads, head_dim)
    out, stats = op.attention_forward(q4, k4, value, mask, scale, isa, cos=cos, sin=sin)
    q_rot, k_rot = op.rope_forward(query, cos, sin, heads, isa), op.rope_forward(key, cos, sin, kv_heads, isa)
    want_out, want_stats = op.attention_forward(q_rot, k_rot, value, mask, scale, isa)
    assert torch.equal(out, want_out) and torch.equal(stats, want_stats)
    gq, gk, gv = op.attention_backward(grad, q4, k4, value, mask, out, stats, scale, isa, cos=cos, sin=sin)
    want_gq, want_gk, want_gv = op.attention_backward(grad, q_rot, k_rot, value, mask, out, stats, scale, isa)
    assert torch.equal(gq.view_as(query), op.rope_backward(want_gq, cos, sin, isa))
    assert torch.equal(gk.view_as(key), op.rope_backward(want_gk, cos, sin, isa))
    assert torch.equal(gv, want_gv)

    tracked = [t.clone().requires_grad_() for t in (query, key, value)]
    got = rope_attention(*tracked, cos, sin, mask, scale)
    got.backward(grad)
    reference = [t.clone().requires_grad_() for t in (query, key, value)]
    want = attention_reference(rope_reference(reference[0], cos, sin, heads),
                               rope_reference(reference[1], cos, sin, kv_heads), reference[2], mask, scale)
    want.backward(grad)
    _close(got.detach()[seen], want.detach()[seen], rtol=1e-5, atol=1e-5)
    for t, r in zip(tracked, reference):
        _close(t.grad, torch.nan_to_num(r.grad), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa_index", [0, -1], ids=["first-isa", "widest-isa"])
@pytest.mark.parametrize("layout", ["transposed", "narrowed"])
def test_attention_reads_values_through_their_strides(op, isa_index: int, layout: str) -> None:
    """Values as a projection's [B, S, Hkv, D] seen transposed (dense: the value gradient comes
    back in that layout, so the view's backward needs no copy) or a slice of a wider qkv (not
    dense: a contiguous gradient): the same outputs and gradients as contiguous values, and the
    autograd function makes no copy of them."""
    isa = op.supported_isas()[isa_index]
    gen = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 37, 24
    q, k = torch.randn(batch, heads, seq, head_dim, generator=gen), torch.randn(batch, kv_heads, seq, head_dim, generator=gen)
    if layout == "transposed":
        v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).transpose(1, 2)
    else:
        v = torch.randn(batch, seq, 3 * kv_heads * head_dim, generator=gen).narrow(2, kv_heads * head_dim,
                                                                                   kv_heads * head_dim)
        v = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    assert not v.is_contiguous()
    grad = torch.randn(batch, seq, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out, stats = op.attention_forward(q, k, v, None, scale, isa)
    dense_out, dense_stats = op.attention_forward(q, k, v.contiguous(), None, scale, isa)
    assert torch.equal(out, dense_out) and torch.equal(stats, dense_stats)
    got = op.attention_backward(grad, q, k, v, None, out, stats, scale, isa)
    want = op.attention_backward(grad, q, k, v.contiguous(), None, out, stats, scale, isa)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert (got[2].stride() == v.stride()) == (layout == "transposed")
    tracked_v = v.detach().clone().requires_grad_() if layout == "narrowed" else None
    if tracked_v is None:  # through autograd: the gradient of the projection's own tensor
        base = v.transpose(1, 2).detach().clone().requires_grad_()
        attention(q, k, base.transpose(1, 2), None, scale).backward(grad)
        _close(base.grad.transpose(1, 2), want[2], rtol=1e-6, atol=1e-6)
    else:
        attention(q, k, tracked_v, None, scale).backward(grad)
        _close(tracked_v.grad, want[2], rtol=1e-6, atol=1e-6)


def test_attention_falls_back_where_the_kernels_do_not_apply(op) -> None:
    """A float mask, a bf16 input or a KV cache longer than the queries without a mask take the reference."""
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8)
    additive = torch.zeros(1, 1, 5, 7)
    assert torch.equal(attention(q, k, k, additive, 0.3), attention_reference(q, k, k, additive, 0.3))
    qb = q.bfloat16()
    assert torch.equal(attention(qb, qb, qb, None, 0.3), attention_reference(qb, qb, qb, None, 0.3))
    assert attention(q, q, q, None, 0.3).grad_fn is None


def test_public_functions_fuse_float32_cpu_and_fall_back_elsewhere(op) -> None:
    """Non-contiguous inputs are fine; bf16 (and any tensor the kernels do not take) runs the
    reference itself, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(2, 5, 64, generator=gen)
    gate, up = gate_up[..., :32], gate_up[..., 32:]  # non-contiguous halves, as a fused projection gives
    _close(swiglu(gate, up), swiglu_reference(gate, up))
    assert swiglu(gate, up).grad_fn is None  # no autograd outside a graph
    x, w = torch.randn(2, 5, 16, generator=gen).transpose(0, 1), torch.randn(16, generator=gen)
    _close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(rms_norm(xb, wb, 1e-6), rms_norm_reference(xb, wb, 1e-6))
    q = torch.randn(2, 5, 32, generator=gen)
    cos, sin = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 5, 8, generator=gen)
    assert rope(q, cos, sin, 4).is_contiguous()
    _close(rope(q, cos, sin, 4), rope_reference(q, cos, sin, 4))
    assert torch.equal(rope(q.bfloat16(), cos.bfloat16(), sin.bfloat16(), 4),
                       rope_reference(q.bfloat16(), cos.bfloat16(), sin.bfloat16(), 4))


def _model(family: str, **overrides) -> PreTrainedModel:
    config = tiny_config(family, vocab_size=VOCAB, hidden_size=72, num_layers=2, num_heads=6, num_kv_heads=2,
                         intermediate_size=100, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fused_model_matches_hugging_face(op, family: str) -> None:
    """Logits and every parameter gradient of a swapped model equal the original's, with left
    padding (per-row positions); the KV-cache path (prefill + one step) gives the same logits."""
    model = _model(family)
    fused = copy.deepcopy(model)
    assert fuse_layer_ops(fused) == 2 * 5 + 1  # per layer: 2 norms, MLP, attention, the layer; the final norm
    assert fuse_layer_ops(fused) == 0  # already swapped
    assert list(fused.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    for m in (model, fused):
        logits = m(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        (logits[mask.bool()].float().log_softmax(-1)[:, :7].sum()).backward()
    _close(fused(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits,
           model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits,
           rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()))
    with torch.no_grad():
        steps = []
        for m in (model, fused):
            out = m(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
            step = m(input_ids=ids[:, :1], attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
                     position_ids=position_ids[:, -1:] + 1, **cache_argument(m, returned_cache(out)), use_cache=True)
            steps.append(step.logits)
    _close(steps[1], steps[0], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_epilogue_fusions_of_onednn_linears_match_hugging_face(op) -> None:
    """With oneDNN linears (hidden 256: deep enough for them) the decoder layers' residual adds run
    in the output and down projections' epilogues, and without autograd SiLU(gate) * up in the
    gate and up projections' too: logits, with and without autograd, and every gradient match the
    original model's up to rounding."""
    config = tiny_config("llama", vocab_size=VOCAB, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=344)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    fused = copy.deepcopy(model)
    fuse_layer_ops(fused)
    use_onednn_linears(fused)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    calls = {"add": 0, "swiglu": 0, "packed": 0}
    real_add, real_swiglu, real_packed = cpu_matmul._OneDnnLinearAdd.apply, cpu_matmul.swiglu_linears, packed_swiglu
    packs = cpu_matmul.panel_gemm_op() is not None  # AVX-512: the packed SwiGLU GEMM, with autograd too

    def counting_add(*args):
        calls["add"] += 1
        return real_add(*args)

    def counting_swiglu(*args):
        out = real_swiglu(*args)
        calls["swiglu"] += out is not None
        return out

    def counting_packed(*args):
        out = real_packed(*args)
        calls["packed"] += out is not None
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_matmul._OneDnnLinearAdd, "apply", counting_add)
        patch.setattr(fused_layers_module, "swiglu_linears", counting_swiglu)
        patch.setattr(fused_layers_module, "packed_swiglu", counting_packed)
        for m in (model, fused):
            m(input_ids=ids, use_cache=False).logits.log_softmax(-1)[..., :7].sum().backward()
        # two adds per layer; autograd: the packed SwiGLU GEMM where there is one, else the fused SwiGLU
        assert calls == {"add": 2 * 2, "swiglu": 0, "packed": 2 * packs}
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
            got = fused(input_ids=ids, use_cache=False).logits
        assert calls == {"add": 2 * 2 * 2, "swiglu": 2, "packed": 2 * packs}
    _close(got, want, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()))


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [64, 301])
def test_packed_swiglu_gradients_match_two_linears_and_the_reference(op, rows: int) -> None:
    """The packed SwiGLU GEMM with autograd (`packed_swiglu`: both products from one packed GEMM,
    stored for the backward past the caches): the activation and the gradients of x, gate and up
    match torch's silu(x @ gate^T) * (x @ up^T) to rounding, for a width that is not a multiple of
    the panels' 16 columns; its backward writes over the saved products, so a second backward
    through the graph fails loudly; a gate with a bias is not taken."""
    if cpu_matmul.panel_gemm_op() is None:
        pytest.skip("no AVX-512 rlhf_cpu_decode op here")
    gen = torch.Generator().manual_seed(11)
    gate, up = nn.Linear(256, 200, bias=False), nn.Linear(256, 200, bias=False)
    with torch.no_grad():
        for p in (gate.weight, up.weight):
            p.copy_(torch.randn(p.shape, generator=gen) / 16)
    plain = [copy.deepcopy(gate), copy.deepcopy(up)]
    use_onednn_linears(gate)
    use_onednn_linears(up)
    x = torch.randn(1, rows, 256, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = torch.randn(1, rows, 200, generator=gen)
    got = packed_swiglu(x, gate, up)
    assert got is not None
    want = F.silu(plain[0](x_ref)) * plain[1](x_ref)
    _close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()))
    got.backward(grad, retain_graph=True)
    want.backward(grad)
    pairs = ((x.grad, x_ref.grad), (gate.weight.grad, plain[0].weight.grad), (up.weight.grad, plain[1].weight.grad))
    for a, b in pairs:
        _close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.backward(grad)
    with torch.no_grad():
        assert packed_swiglu(x, gate, up) is None  # no autograd: swiglu_in_epilogue's
    biased = nn.Linear(256, 200)
    use_onednn_linears(biased)
    assert packed_swiglu(x, biased, up) is None


def test_tied_embeddings_and_other_families(op) -> None:
    """Tied embeddings keep one shared tensor; families without these modules are left alone."""
    model = _model("llama", tie_word_embeddings=True)
    fuse_layer_ops(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for family in ("gpt2", "opt"):
        assert fuse_layer_ops(AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=VOCAB))) == 0


def test_non_causal_attention_is_left_to_the_model(op) -> None:
    """A module marked non-causal (no mask: HF's SDPA attends to every key) is not run causally."""
    model = _model("llama")
    fused = copy.deepcopy(model)
    fuse_layer_ops(fused)
    for m in (model, fused):
        for layer in m.model.layers:
            layer.self_attn.is_causal = False
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _close(fused(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits,
               rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_recomputes_the_fused_layers_exactly(op) -> None:
    """A checkpointed fused model recomputes each layer in backward: the same gradients, bit for bit."""
    model = _model("llama")
    fuse_layer_ops(model)
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    checkpointed.train()
    model.train()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    for m in (model, checkpointed):
        m(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[..., :5].sum().backward()
    for p, q in zip(model.parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "no-fused-layers"])
def test_rollout_model_runs_the_layers_as_train_mode_does(tiny_model_dirs, fused: bool) -> None:
    # The rollout copy of the actor is fused exactly when train mode is (--cpu-fused-layers), so the
    # fast decoder's prefill (and an HF-forward fallback) runs the kernels the training forward
    # runs; the parity check between the two modes passes either way.
    from rlhf.engine.backends.cpu import CpuBackend
    from rlhf.engine.backends import CpuConfig
    from rlhf.engine.backends.registry import using_backend
    from rlhf.engine.backends.cpu.fused_layers import uses_fused_layers
    from rlhf.engine.config import EngineConfig
    from rlhf.engine.distributed import DistributedContext
    from rlhf.engine.rollout import rollout_mode
    from rlhf.engine.sampling import SamplingParams
    from rlhf.engine.train_engine import TrainEngine
    from rlhf.models.loading import load_causal_lm

    ctx = DistributedContext.initialize()
    config = EngineConfig(zero_stage=3, dtype="fp32", micro_batch_size=2)
    with using_backend(CpuBackend(CpuConfig(cpu_fused_layers=fused))):
        engine = TrainEngine(load_causal_lm(str(tiny_model_dirs["llama"])), config, ctx, total_steps=1, name="actor")
    assert uses_fused_layers(engine.model) == fused
    prompts = torch.randint(4, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    params = SamplingParams(max_new_tokens=5, do_sample=False, eos_token_id=2, pad_token_id=0)
    with rollout_mode(engine) as rollout:
        assert uses_fused_layers(rollout.model) == fused
        out = rollout.generate(prompts.masked_fill(mask == 0, 0), mask, params)
        assert rollout.parity_max_diff is not None and rollout.parity_max_diff < 1e-4
    assert out.sequences.shape == (2, 11)
