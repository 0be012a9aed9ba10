"""oneDNN linears (engine/backends/cpu/matmul.py): what F.linear computes, up to rounding, forward and backward;
the swap keeps parameters and names; auto picks oneDNN on AMD CPUs only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from rlhf.engine.backends.cpu import matmul as cpu_matmul
from rlhf.engine.backends.cpu.matmul import (
    ONEDNN_MIN_DEPTH, ONEDNN_MIN_DEPTH_FULL_WIDTH, ONEDNN_MIN_ROWS, linear, onednn_available, onednn_min_depth,
    resolve_cpu_matmul, use_onednn_linears, uses_onednn_linears,
)
from rlhf.errors import UserError
from rlhf.models.tiny import tiny_config

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _grads(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    out = fn(*leaves[:2], leaves[2] if b is not None else None)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(ONEDNN_MIN_ROWS,), (3, 67), (2, 5, 31)])
def test_linear_matches_torch(bias: bool, shape: tuple[int, ...]) -> None:
    """Output, input, weight and bias gradients equal F.linear's up to float32 rounding, for 2-D and
    batched inputs, odd sizes, with and without bias; the forward really runs oneDNN."""
    gen = torch.Generator().manual_seed(0)
    d_in, d_out = ONEDNN_MIN_DEPTH + 7, ONEDNN_MIN_DEPTH + 3
    x = torch.randn(*shape, d_in, generator=gen)
    w = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
    b = torch.randn(d_out, generator=gen) if bias else None
    grad = torch.randn(*shape, d_out, generator=gen)
    want = _grads(F.linear, x, w, b, grad)
    got = _grads(linear, x, w, b, grad)
    for name, g, r in zip(("out", "x", "weight", "bias"), got, want):
        # The weight gradient sums over every row (a few hundred here): rounding grows with its depth.
        atol = 1e-4 if name == "weight" else 1e-5
        torch.testing.assert_close(g, r, rtol=1e-5, atol=atol)
    out = linear(x.requires_grad_(), w, b)
    assert type(out.grad_fn).__name__ == "_OneDnnLinearBackward"


@needs_onednn
@pytest.mark.parametrize("d_in, d_out", [(67, 67), (67, 31), (31, 67), (40, 80), (256, 98), (256, 256), (48, 300),
                                         (528, 1100)])
@pytest.mark.parametrize("tn", [True, False], ids=["tn", "transposing"])
def test_weight_grad_through_onednn_matches_matmul(monkeypatch, d_in: int, d_out: int, tn: bool) -> None:
    """With oneDNN's weight gradient (Zen 5), dY^T X over a transposed dY, or over a transposed X
    when out >= 2 in and in <= TRANSPOSED_INPUT_MAX_WIDTH (the product transposed back), or straight
    from the rows (tn_weight_grad, on AVX-512 CPUs, both widths up to TN_MAX_WIDTH and in a multiple
    of 16), equals torch's matmul up to rounding, laid out as the weight; below ONEDNN_MIN_ROWS rows
    it is torch's matmul, bit for bit."""
    monkeypatch.setattr(cpu_matmul, "onednn_weight_grad", lambda: True)
    real = cpu_matmul.panel_gemm_op()
    if tn and real is None:
        pytest.skip("no AVX-512 rlhf_cpu_decode op here")
    calls = []

    class Counted:
        def tn_weight_grad(self, *args):
            calls.append(args)
            return real.tn_weight_grad(*args)

    monkeypatch.setattr(cpu_matmul, "panel_gemm_op", (lambda: Counted()) if tn else (lambda: None))
    takes_tn = tn and max(d_in, d_out) <= cpu_matmul.TN_MAX_WIDTH and d_in % 16 == 0
    gen = torch.Generator().manual_seed(2)
    for rows in (ONEDNN_MIN_ROWS, 1031):
        dy, x = torch.randn(rows, d_out, generator=gen), torch.randn(rows, d_in, generator=gen)
        got = cpu_matmul.weight_grad(dy, x)
        assert got.shape == (d_out, d_in) and got.is_contiguous()
        torch.testing.assert_close(got, dy.t() @ x, rtol=1e-5, atol=1e-4 * rows**0.5 / 8)
    assert len(calls) == 2 * takes_tn
    few = ONEDNN_MIN_ROWS - 1
    dy, x = torch.randn(few, d_out, generator=gen), torch.randn(few, d_in, generator=gen)
    assert torch.equal(cpu_matmul.weight_grad(dy, x), dy.t() @ x)
    monkeypatch.setattr(cpu_matmul, "onednn_weight_grad", lambda: False)
    dy, x = torch.randn(300, d_out, generator=gen), torch.randn(300, d_in, generator=gen)
    assert torch.equal(cpu_matmul.weight_grad(dy, x), dy.t() @ x)


@needs_onednn
@pytest.mark.parametrize("zen5", [True, False], ids=["zen5-onednn", "zen4-mkl"])
@pytest.mark.parametrize("outs, bias, frozen", [((ONEDNN_MIN_DEPTH + 3, 96, 32), False, None),
                                                ((2 * ONEDNN_MIN_DEPTH + 5, 2 * ONEDNN_MIN_DEPTH + 5), True, 1)])
def test_shared_input_linears_match_the_separate_linears(monkeypatch, zen5: bool, outs: tuple[int, ...], bias: bool,
                                                         frozen: int | None) -> None:
    """q/k/v-like (GQA widths: output gradients of 96 features, whose input gradient takes oneDNN on
    Zen 5 and torch's matmul before it, and of 32, torch's matmul on both) and gate/up-like linears
    of one input through the shared backward equal the separate OneDnnLinear modules: outputs to the
    bit, gradients up to float32 rounding (the input gradients' sum in another order; the weight
    gradients over one transposed x); a frozen weight gets none. Forwards that autograd does not
    record call the modules."""
    monkeypatch.setattr(cpu_matmul, "onednn_weight_grad", lambda: zen5)
    monkeypatch.setattr(cpu_matmul, "onednn_min_depth",
                        lambda: ONEDNN_MIN_DEPTH_FULL_WIDTH if zen5 else ONEDNN_MIN_DEPTH)
    gen = torch.Generator().manual_seed(4)
    d_in = ONEDNN_MIN_DEPTH + 9
    modules = [nn.Linear(d_in, d_out, bias=bias) for d_out in outs]
    for module in modules:
        use_onednn_linears(module)
    if frozen is not None:
        modules[frozen].weight.requires_grad_(False)
    x = torch.randn(2, 67, d_in, generator=gen)
    grads = [torch.randn(2, 67, d_out, generator=gen) for d_out in outs]

    def run(fn) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        for module in modules:
            module.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        outputs = fn(leaf)
        torch.autograd.backward(outputs, grads)
        params = [p.grad for m in modules for p in m.parameters()]
        return [o.detach() for o in outputs], [leaf.grad, *params]

    want_out, want = run(lambda leaf: [module(leaf) for module in modules])
    got_out, got = run(lambda leaf: cpu_matmul.shared_input_linears(leaf, tuple(modules)))
    assert all(torch.equal(g, w) for g, w in zip(got_out, want_out))
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    leaf = x.clone().requires_grad_()
    outputs = cpu_matmul.shared_input_linears(leaf, tuple(modules))
    assert {type(o.grad_fn).__name__ for o in outputs} == {"_OneDnnSharedInputLinearsBackward"}
    with torch.no_grad():
        assert all(o.grad_fn is None for o in cpu_matmul.shared_input_linears(x, tuple(modules)))


@needs_onednn
def test_shared_input_grads_mix_straight_and_transposing_weight_grads(monkeypatch) -> None:
    """Linears of one input whose weight gradients go partly through tn_weight_grad (widths up to
    TN_MAX_WIDTH) and partly over the input transposed once (a wider one): every gradient equals
    torch's matmul up to rounding."""
    if cpu_matmul.panel_gemm_op() is None:
        pytest.skip("no AVX-512 rlhf_cpu_decode op here")
    monkeypatch.setattr(cpu_matmul, "onednn_weight_grad", lambda: True)
    _check_shared_input_grads(seed=6, rows=700, d_in=64, outs=(64, 16, 300))


def _check_shared_input_grads(seed: int, rows: int, d_in: int, outs: tuple[int, ...]) -> None:
    """shared_input_grads of linears of one random input (`outs` features each) equals torch's
    matmul up to rounding, every weight gradient laid out as its weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=gen)
    weights = [torch.randn(d_out, d_in, generator=gen) for d_out in outs]
    grads = [torch.randn(rows, w.shape[0], generator=gen) for w in weights]
    grad_x, weight_grads = cpu_matmul.shared_input_grads(x, weights, grads, True, [True] * len(outs))
    torch.testing.assert_close(grad_x, sum(g @ w for g, w in zip(grads, weights)), rtol=1e-5, atol=1e-4)
    for got, g, w in zip(weight_grads, grads, weights):
        assert got.shape == w.shape and got.is_contiguous()
        torch.testing.assert_close(got, g.t() @ x, rtol=1e-5, atol=1e-4)


def test_transposes_input_only_for_a_narrow_input_under_a_wider_gradient() -> None:
    """X is transposed (and the product back) for a narrow input under an output gradient at least
    twice as wide (the tiny Llama's gate / up: 256 -> 688); from TRANSPOSED_INPUT_MAX_WIDTH + 1
    features in (SmolLM2's 576 -> 1536, its 49152-token head) and under narrower gradients, dY is."""
    assert cpu_matmul.transposes_input(688, 256)
    assert cpu_matmul.transposes_input(2 * cpu_matmul.TRANSPOSED_INPUT_MAX_WIDTH, cpu_matmul.TRANSPOSED_INPUT_MAX_WIDTH)
    assert not cpu_matmul.transposes_input(1536, 576)
    assert not cpu_matmul.transposes_input(49152, 576)
    assert not cpu_matmul.transposes_input(511, 256)
    assert not cpu_matmul.transposes_input(98, 256)


@needs_onednn
def test_shared_input_grads_split_between_the_two_transposing_paths(monkeypatch) -> None:
    """Linears of one input whose weight gradients take different transposes (the input once for
    those `transposes_input` sends that way, each other one's own output gradient): X is
    transposed once, every gradient equals torch's matmul up to rounding, laid out as its weight."""
    monkeypatch.setattr(cpu_matmul, "onednn_weight_grad", lambda: True)
    monkeypatch.setattr(cpu_matmul, "panel_gemm_op", lambda: None)  # no tn_weight_grad: the transposing paths only
    copies: list[tuple[int, ...]] = []
    real = cpu_matmul.transposed
    monkeypatch.setattr(cpu_matmul, "transposed", lambda t: copies.append(tuple(t.shape)) or real(t))
    rows, d_in = 300, 40
    _check_shared_input_grads(seed=7, rows=rows, d_in=d_in, outs=(100, 30, 80))
    # X once; the 30-wide gradient's dY; the 100- and 80-wide products transposed back.
    assert sorted(copies) == sorted([(rows, d_in), (rows, 30), (d_in, 100), (d_in, 80)])


def test_onednn_weight_grad_and_min_depth_follow_the_cpu(monkeypatch) -> None:
    """oneDNN takes the weight gradient on AMD CPUs with AVX-512 (Zen 4 on), and dot products from
    ONEDNN_MIN_DEPTH_FULL_WIDTH deep on AMD CPUs of family 0x1A (Zen 5) on; elsewhere MKL the weight
    gradient and oneDNN only from ONEDNN_MIN_DEPTH."""
    avx512 = "fpu sse avx2 fma avx512f avx512vl"
    cases = [("AuthenticAMD", "26", avx512, True, True), ("AuthenticAMD", "27", avx512, True, True),
             ("AuthenticAMD", "25", avx512, True, False), ("AuthenticAMD", "25", "fpu sse avx2 fma", False, False),
             ("GenuineIntel", "6", avx512, False, False), ("", "", "", False, False)]

    def clear() -> None:
        for fn in (cpu_matmul.cpu_vendor, cpu_matmul.full_width_avx512_amd, cpu_matmul.amd_avx512,
                   cpu_matmul.onednn_weight_grad):
            fn.cache_clear()

    for vendor, family, flags, weight_grad, full_width in cases:
        fields = {"vendor_id": vendor, "cpu family": family, "flags": flags}
        monkeypatch.setattr(cpu_matmul, "cpuinfo_field", fields.__getitem__)
        clear()
        assert cpu_matmul.onednn_weight_grad() is weight_grad, (vendor, family, flags)
        assert cpu_matmul.onednn_min_depth() == (ONEDNN_MIN_DEPTH_FULL_WIDTH if full_width else ONEDNN_MIN_DEPTH)
    monkeypatch.undo()
    clear()


@needs_onednn
@pytest.mark.parametrize("zen5", [True, False], ids=["zen5", "before-zen5"])
def test_shallow_linears_take_onednn_from_the_cpus_min_depth(monkeypatch, zen5: bool) -> None:
    """A linear 96 features deep with 80 outputs (SmolLM2's k/v input gradients are 192 deep): on
    Zen 5 (min depth ONEDNN_MIN_DEPTH_FULL_WIDTH) its forward and input gradient run oneDNN and equal
    F.linear's up to rounding; before it (ONEDNN_MIN_DEPTH) it is F.linear, bit for bit."""
    monkeypatch.setattr(cpu_matmul, "onednn_min_depth",
                        lambda: ONEDNN_MIN_DEPTH_FULL_WIDTH if zen5 else ONEDNN_MIN_DEPTH)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 50, 96, generator=gen)
    w = torch.randn(80, 96, generator=gen) / 96**0.5
    grad = torch.randn(3, 50, 80, generator=gen)
    want, got = _grads(F.linear, x, w, None, grad), _grads(linear, x, w, None, grad)
    out = linear(x.requires_grad_(), w, None)
    if zen5:
        assert type(out.grad_fn).__name__ == "_OneDnnLinearBackward"
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)
    else:
        assert type(out.grad_fn).__name__ != "_OneDnnLinearBackward"
        assert all(torch.equal(g, r) for g, r in zip(got, want))
    rows, weight = torch.randn(70, 32, generator=gen), torch.randn(32, 40, generator=gen)  # 32 deep: torch's matmul
    assert torch.equal(cpu_matmul._input_grad(rows, weight), rows @ weight)


@needs_onednn
def test_linear_takes_torch_below_its_limits() -> None:
    """Fewer rows than ONEDNN_MIN_ROWS, short dot products, bf16, a weight that is a column slice
    (oneDNN's reference code: seconds), or a non-contiguous input's transposed view: the same op as
    F.linear where oneDNN is not the faster library, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    cases = [
        (torch.randn(ONEDNN_MIN_ROWS - 1, 300, generator=gen), torch.randn(260, 300, generator=gen)),
        (torch.randn(128, onednn_min_depth() - 1, generator=gen),
         torch.randn(260, onednn_min_depth() - 1, generator=gen)),
        (torch.randn(128, 300, generator=gen).bfloat16(), torch.randn(260, 300, generator=gen).bfloat16()),
        (torch.randn(128, 300, generator=gen), torch.randn(300, 520, generator=gen)[:, :260].t()),
    ]
    for x, w in cases:
        assert torch.equal(linear(x, w), F.linear(x, w))
    x = torch.randn(300, 128, generator=gen).t()  # rows of a transposed view: oneDNN gets a contiguous copy
    w = torch.randn(260, 300, generator=gen) / 300**0.5
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_swapped_model_matches_and_keeps_its_parameters() -> None:
    """Every nn.Linear of a Llama (tied embeddings, GQA) is swapped, names and parameters stay,
    a second swap finds nothing; logits and gradients match the plain model's up to rounding."""
    config = tiny_config("llama", vocab_size=300, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=320, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    swapped = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_onednn_linears(swapped) == linears == 2 * 7 + 1
    assert use_onednn_linears(swapped) == 0 and uses_onednn_linears(swapped) and not uses_onednn_linears(model)
    assert list(swapped.state_dict()) == list(model.state_dict())
    assert swapped.lm_head.weight is swapped.model.embed_tokens.weight  # still tied
    assert all(isinstance(m, nn.Linear) for m in swapped.modules() if type(m).__name__.startswith("OneDnn"))
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(2))
    for m in (model, swapped):
        m(input_ids=ids).logits.log_softmax(-1)[..., :5].sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(swapped(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), swapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()), msg=name)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_inference_swiglu_runs_in_the_gemm_epilogue_and_matches(bias: bool, packed: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autograd, silu(gate(x)) * up(x) of two OneDnn linears comes from a GEMM epilogue and
    matches torch's ops to rounding: the packed SwiGLU GEMM (rlhf_cpu_decode.panel_swiglu) where
    there are no biases and `panel_gemm_op` has it, else oneDNN (swish in the gate's epilogue,
    the up projection's output multiplied in place); with autograd, or a plain nn.Linear, or too
    few rows, there is no such path (None: the caller's own)."""
    if packed and cpu_matmul.panel_gemm_op() is None:
        pytest.skip("no AVX-512 rlhf_cpu_decode op here")
    calls = []
    if packed:
        real = cpu_matmul.panel_gemm_op()

        class Counted:
            pack_swiglu_panels = real.pack_swiglu_panels

            def panel_swiglu(self, *args):
                calls.append(args)
                return real.panel_swiglu(*args)

        monkeypatch.setattr(cpu_matmul, "panel_gemm_op", Counted)
    else:
        monkeypatch.setattr(cpu_matmul, "panel_gemm_op", lambda: None)
    gen = torch.Generator().manual_seed(0)
    gate, up = nn.Linear(256, 344, bias=bias), nn.Linear(256, 344, bias=bias)
    with torch.no_grad():
        for p in (*gate.parameters(), *up.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / 16)
    plain_gate, plain_up = copy.deepcopy(gate), copy.deepcopy(up)
    for m in (gate, up):
        m.__class__ = cpu_matmul._onednn_class(nn.Linear)
    x = 2 * torch.randn(3, 40, 256, generator=gen)
    want = F.silu(plain_gate(x)) * plain_up(x)
    with torch.no_grad():
        got = cpu_matmul.swiglu_linears(x, gate, up)
        assert got is not None and got.shape == (3, 40, 344)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert len(calls) == (packed and not bias)
        assert cpu_matmul.swiglu_linears(x, plain_gate, plain_up) is None
        assert cpu_matmul.swiglu_linears(x[:, :1], gate, up) is None  # 3 rows: MKL's
    assert cpu_matmul.swiglu_linears(x, gate, up) is None  # autograd on: the fused SwiGLU's backward


def test_resolve_cpu_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: oneDNN on an AMD CPU whose torch has it, torch's matmul elsewhere; onednn without it is an error."""
    assert resolve_cpu_matmul("aten") == "aten"
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "GenuineIntel")
    assert resolve_cpu_matmul("auto") == "aten"
    assert resolve_cpu_matmul("onednn") == "onednn"
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "AuthenticAMD")
    assert resolve_cpu_matmul("auto") == "onednn"
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: False)
    assert resolve_cpu_matmul("auto") == "aten"
    with pytest.raises(UserError, match="no oneDNN"):
        resolve_cpu_matmul("onednn")
    with pytest.raises(ValueError, match="auto, aten or onednn"):
        resolve_cpu_matmul("mkl")


@needs_onednn
@pytest.mark.parametrize("choice", ["onednn", "aten"])
def test_engine_runs_the_linears_it_is_told_in_train_and_rollout_mode(tiny_model_dirs, choice: str) -> None:
    """--cpu-matmul onednn swaps the trained model's linears and its rollout copy's (whose parity
    check with train mode passes, and which the fast decoder still takes); aten leaves both alone."""
    from rlhf.engine.backends.cpu import CpuBackend
    from rlhf.engine.backends import CpuConfig
    from rlhf.engine.backends.registry import using_backend
    from rlhf.engine.config import EngineConfig
    from rlhf.engine.distributed import DistributedContext
    from rlhf.engine.fast_decode import fast_decode_unsupported_reason
    from rlhf.engine.rollout import rollout_mode
    from rlhf.engine.sampling import SamplingParams
    from rlhf.engine.train_engine import TrainEngine
    from rlhf.models.loading import load_causal_lm

    ctx = DistributedContext.initialize()
    config = EngineConfig(zero_stage=3, dtype="fp32", micro_batch_size=2)
    with using_backend(CpuBackend(CpuConfig(cpu_matmul=choice))):
        engine = TrainEngine(load_causal_lm(str(tiny_model_dirs["llama"])), config, ctx, total_steps=1, name="actor")
    assert uses_onednn_linears(engine.model) == (choice == "onednn")
    prompts = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=3, do_sample=False, eos_token_id=2, pad_token_id=0)
    with rollout_mode(engine) as rollout:
        assert uses_onednn_linears(rollout.model) == (choice == "onednn")
        assert fast_decode_unsupported_reason(rollout.model) is None
        out = rollout.generate(prompts, torch.ones_like(prompts), params)
        assert rollout.parity_max_diff is not None and rollout.parity_max_diff < 1e-4
    assert out.sequences.shape == (2, 43)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_linear_add_equals_the_linear_plus_the_residual_and_leaves_the_residual(bias: bool) -> None:
    """linear_add of a OneDnn linear: the same bits as the module's output plus the residual (the add
    in place on the product's own output), the residual tensor untouched, and the gradients autograd
    gives `residual + module(x)` (the residual's is the output's)."""
    gen = torch.Generator().manual_seed(5)
    module = nn.Linear(ONEDNN_MIN_DEPTH + 3, 48, bias=bias)
    use_onednn_linears(module)
    x = torch.randn(2, ONEDNN_MIN_ROWS, ONEDNN_MIN_DEPTH + 3, generator=gen)
    residual = torch.randn(2, ONEDNN_MIN_ROWS, 48, generator=gen)
    grad = torch.randn(2, ONEDNN_MIN_ROWS, 48, generator=gen)
    kept = residual.clone()

    def run(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        leaf, res = x.clone().requires_grad_(), residual.clone().requires_grad_()
        out = fn(leaf, res)
        out.backward(grad)
        return out.detach(), [leaf.grad, res.grad, *(p.grad for p in module.parameters())]

    want_out, want = run(lambda leaf, res: res + module(leaf))
    got_out, got = run(lambda leaf, res: cpu_matmul.linear_add(leaf, module, res))
    assert torch.equal(got_out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert type(cpu_matmul.linear_add(x, module, residual).grad_fn).__name__ == "_OneDnnLinearAddBackward"
    with torch.no_grad():
        assert torch.equal(cpu_matmul.linear_add(x, module, residual), want_out)
    assert torch.equal(residual, kept)


@needs_onednn
def test_fast_decoder_prefills_through_onednn_where_the_model_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast decoder of a model with oneDNN linears runs its prefill's GEMMs through oneDNN
    (its decode steps' 4 rows stay on torch's matmul), and with fused layers too SiLU(gate) * up
    through `swiglu_in_epilogue`; logits equal the plain model's decoder's."""
    from rlhf.engine.backends.cpu import decoder as cpu_decoder
    from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
    from rlhf.engine.backends.cpu.fused_layers import fuse_layer_ops

    config = tiny_config("llama", vocab_size=300, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=320)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    swapped = copy.deepcopy(model)
    use_onednn_linears(swapped)
    fused = copy.deepcopy(swapped)
    fuse_layer_ops(fused)
    epilogues = []

    def counted(*args):
        out = cpu_matmul.swiglu_in_epilogue(*args)
        epilogues.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decoder, "swiglu_in_epilogue", counted)
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    logits = []
    for m in (model, swapped, fused):
        decoder = CpuLlamaDecoder(m, 4, 50, cpu_kernel=False)
        assert (decoder.linear is F.linear) == (m is model)
        first = decoder.prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        step = decoder.decode(first.argmax(-1, keepdim=True), torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
                              mask.sum(-1, keepdim=True))
        logits.append(torch.stack([first, step]))
    assert epilogues == [True, False]  # the fused prefill; its last layer's MLP runs 4 rows (the last position)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-4, atol=1e-5)
