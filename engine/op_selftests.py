"""Load-time self-tests of the csrc ops: each build proves itself on the device it will run on.

`engine/ops.py` runs an op's self-test the first time a build of it is loaded for a device
(the verdict is cached beside the build, so later processes read it): small random inputs of
the shapes and dtypes the op sees in training and generation, against the op's PyTorch
reference, in well under a second. A self-test returns a one-line summary when the op matches,
and raises (`OpMismatch`, or whatever the op itself raised) when it does not; the loader then
disables the op for the run and the torch path is used. Self-tests take the module to check as
an argument (they never call the loader) and draw from their own generators.

The CUDA self-tests run only where the op is loaded for a CUDA device; tests/test_op_selftests.py
runs each of them on the CPU against a module that wraps the reference (it must pass) and one
with a deliberate error (it must fail).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.engine.fast_decode import FastLlamaDecoder
from rlhf.engine.fused_adam import CPU_OP, CUDA_OP, adam_reference_step
from rlhf.engine.kernels import (
    DECODE_ATTENTION_HEAD_DIMS,
    DECODE_ATTENTION_OP,
    SAMPLING_OP,
    SELECTIVE_LOG_SOFTMAX_OP,
    decode_attention_reference,
    draw_explained_by_rounding,
    sample_tokens_reference,
)
from rlhf.engine.cpu_decode import CPU_DECODE_OP
from rlhf.engine.fused_layers import (
    FUSED_LAYERS_OP,
    attention_reference,
    rms_norm_reference,
    rope_reference,
    swiglu_reference,
)
from rlhf.engine.sampling import process_logits, sample_from_logits

SelfTest = Callable[[ModuleType, torch.device], str]
"""(the built module, the device it runs on) -> a one-line summary; raises on a mismatch."""

SAMPLING_SETTINGS = ((1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.8, 40, 0.95))
"""(temperature, top_k, top_p) of the sampler checks: plain, top-k, top-p, both."""


class OpMismatch(AssertionError):
    """A built op disagrees with its PyTorch reference."""


class _Worst:
    """The largest absolute difference seen over a self-test's comparisons."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.cases = 0

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        if got.shape != want.shape:
            raise OpMismatch(f"{what}: shape {tuple(got.shape)}, the reference gives {tuple(want.shape)}")
        both_nan = torch.isnan(got) & torch.isnan(want)
        diff = (got - want).abs().masked_fill(both_nan, 0.0)
        bad = ~(diff <= atol + rtol * want.abs())
        if bool(bad.any()):
            index = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise OpMismatch(f"{what}: {int(bad.sum())} of {bad.numel()} values differ; at {index} the op gives "
                             f"{got[index].item():.6g}, the reference {want[index].item():.6g}")
        self.cases += 1
        if diff.numel():
            self.diff = max(self.diff, float(diff.max()))

    def summary(self) -> str:
        return f"{self.cases} comparisons, max |diff| {self.diff:.2e}"


# ---------------------------------------------------------------------------------------------
# Fused Adam (CPU and CUDA: one API)
# ---------------------------------------------------------------------------------------------

_ADAM_SIZES = (1, 7, 33, 1031)  # tails of every vector width
_ADAM_CASES = (
    # param dtype, fp32 master copy, bf16 copy out, weight decay, AdamW (decoupled) or Adam
    (torch.float32, False, False, 0.01, True),
    (torch.float32, False, True, 0.1, False),
    (torch.bfloat16, True, True, 0.01, True),
    (torch.bfloat16, False, False, 0.0, True),
)


def _adam_tensors(dtype: torch.dtype, masters: bool, lp: bool, device: torch.device,
                  gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(device)

    params = [randn(n) for n in _ADAM_SIZES]
    return {
        "params": [p.to(dtype) for p in params],
        "grads": [randn(n).to(dtype) for n in _ADAM_SIZES],
        "exp_avgs": [0.1 * randn(n) for n in _ADAM_SIZES],
        "exp_avg_sqs": [0.01 * randn(n).abs() for n in _ADAM_SIZES],
        "masters": [p.clone() for p in params] if masters else [],
        "lp_out": [torch.empty(n, dtype=torch.bfloat16, device=device) for n in _ADAM_SIZES] if lp else [],
        "steps": [torch.tensor(float(i)) for i in range(len(_ADAM_SIZES))],  # CPU scalars, as in FusedAdamW
    }


def fused_adam(module: ModuleType, device: torch.device) -> str:
    """Two steps of every kernel set the build has, for fp32 and bf16 params with and without
    master copies and bf16 outputs, equal to `adam_reference_step`."""
    worst = _Worst()
    isas = list(module.supported_isas()) if hasattr(module, "supported_isas") else [None]
    gen = torch.Generator().manual_seed(0)
    for isa in isas:
        for dtype, masters, lp, weight_decay, adam_w_mode in _ADAM_CASES:
            ours = _adam_tensors(dtype, masters, lp, device, gen)
            ref = {k: [t.clone() for t in ts] for k, ts in ours.items()}
            hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
            for _ in range(2):
                module.adam_step(*ours.values(), **hyper, **({"isa": isa} if isa else {}))
                adam_reference_step(*ref.values(), **hyper)
            what = f"adam_step isa={isa or 'cuda'} {dtype} masters={masters} lp_out={lp}"
            for key in ("exp_avgs", "exp_avg_sqs", "masters", "steps"):
                for got, want in zip(ours[key], ref[key]):
                    worst.close(f"{what} {key}", got, want, rtol=1e-5, atol=1e-6)
            for key in ("params", "lp_out"):
                bf16 = key == "lp_out" or dtype == torch.bfloat16  # one rounding step of bf16 apart
                for got, want in zip(ours[key], ref[key]):
                    worst.close(f"{what} {key}", got, want, rtol=1.6e-2 if bf16 else 1e-5, atol=1e-5 if bf16 else 1e-6)
    return worst.summary()


# ---------------------------------------------------------------------------------------------
# Generation kernels (CUDA)
# ---------------------------------------------------------------------------------------------


def _left_padded_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    positions = torch.arange(width, device=lengths.device)
    return positions[None, :] >= (width - lengths)[:, None]


def decode_attention(module: ModuleType, device: torch.device) -> str:
    """Every head size the op is built for, fp16 and bf16, GQA, per-row lengths and left-padding
    masks, with NaN in the stale cache slots (a kernel that reads them fails)."""
    worst = _Worst()
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, context = 3, 4, 2, 37
    lengths = torch.tensor([context, 1, 20], device=device)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in DECODE_ATTENTION_HEAD_DIMS:
            k = torch.randn(batch, kv_heads, context + 5, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(batch, kv_heads, context + 5, head_dim, generator=gen).to(device, dtype)
            k[:, :, context:] = float("nan")
            v[:, :, context:] = float("nan")
            q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
            scale = head_dim**-0.5
            mask = _left_padded_mask(lengths, context)
            for name, by_length, by_mask, used in (("lengths", lengths, None, k.shape[2]), ("mask", None, mask, context)):
                got = module.decode_attention(q, k, v, by_length, by_mask, used, float(scale))
                want = decode_attention_reference(q.float(), k.float(), v.float(), mask if by_mask is not None else lengths)
                tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
                worst.close(f"decode_attention {dtype} head_dim={head_dim} by {name}", got, want, rtol=1e-2, atol=tol)
    return worst.summary()


def sampling(module: ModuleType, device: torch.device) -> str:
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


def selective_log_softmax(module: ModuleType, device: torch.device) -> str:
    """log p(index) and logsumexp in fp32 for fp32/bf16/fp16 logits, contiguous and shifted
    (the logits[:, :-1] view every loss passes)."""
    worst = _Worst()
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch, time, vocab in ((1, 1, 1), (2, 9, 1031)):
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


# ---------------------------------------------------------------------------------------------
# Fused CPU decode step
# ---------------------------------------------------------------------------------------------


def _tiny_llama(gen: torch.Generator) -> torch.nn.Module:
    """A 2-layer GQA Llama with biases on every projection and widths off the vector width."""
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model


def cpu_decode(module: ModuleType, device: torch.device) -> str:
    """Prefill then five decode steps of every kernel set, with MKL and with packed-weight
    projections, against FastLlamaDecoder's Python step (logits and KV cache, left-padded rows),
    and the fused sampler against
    `sample_from_logits` from the same uniforms."""
    worst = _Worst()
    gen = torch.Generator().manual_seed(4)
    model = _tiny_llama(gen)
    batch, width, steps = 3, 5, 5
    ids = torch.randint(3, 97, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = torch.randint(3, 97, (batch, steps), generator=gen)
    full_mask = torch.cat([mask, torch.ones(batch, steps, dtype=mask.dtype)], dim=1)

    def run(decoder: FastLlamaDecoder) -> list[torch.Tensor]:
        logits = [decoder.prefill(ids, mask, positions)]
        for step in range(steps):
            logits.append(decoder.decode(tokens[:, step:step + 1], full_mask[:, :width + step + 1],
                                         positions[:, -1:] + step + 1))
        return logits

    reference = FastLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False)
    want = run(reference)
    scale = max(float(w.abs().max()) for w in want)
    # The float16 cache (kv_cache_dtype="fp16"): the Python step over that cache is its reference.
    want_half = run(FastLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False,
                                     kv_cache_dtype="fp16"))
    for isa in module.supported_isas():
        for packed in (False, True):
            fused = FastLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False)
            fused.use_kernel_step(module, isa, packed_gemm=packed)
            name = f"cpu decode isa={isa}{' packed' if packed else ''}"
            for step, (g, w) in enumerate(zip(run(fused), want)):
                worst.close(f"{name} step {step} logits", g, w, rtol=0.0, atol=1e-5 * scale)
            for layer in range(len(reference.keys)):
                worst.close(f"{name} layer {layer} keys", fused.keys[layer], reference.keys[layer], rtol=1e-5, atol=1e-5)
                worst.close(f"{name} layer {layer} values", fused.values[layer], reference.values[layer],
                            rtol=1e-5, atol=1e-5)
        half = FastLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False,
                                kv_cache_dtype="fp16")
        half.use_kernel_step(module, isa, packed_gemm=True)
        for step, (g, w) in enumerate(zip(run(half), want_half)):
            worst.close(f"cpu decode isa={isa} fp16 cache step {step} logits", g, w, rtol=0.0, atol=1e-4 * scale)
        logits = 3 * torch.randn(64, 101, generator=gen)
        u = torch.rand(64, generator=gen)
        for temperature in (1.0, 0.7):
            got = module.sample(logits, u, temperature, isa)
            expected = sample_from_logits(process_logits(logits, temperature), uniform=u)
            for row in torch.nonzero(got != expected).flatten().tolist():
                if not draw_explained_by_rounding(logits[row], temperature, 0, 1.0, u[row].item(), int(got[row])):
                    raise OpMismatch(f"cpu sample isa={isa} temperature={temperature} row {row}: the op drew "
                                     f"{int(got[row])}, the reference {int(expected[row])}")
    return worst.summary()


# ---------------------------------------------------------------------------------------------
# Fused layer ops (CPU): RMSNorm, RoPE, SwiGLU forward and backward
# ---------------------------------------------------------------------------------------------

def _grads(out: torch.Tensor, grad: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, grad)


def _tracked(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies that autograd tracks (self-tests run under no_grad; the references' gradients need it)."""
    return tuple(t.clone().requires_grad_() for t in tensors)


def fused_layers(module: ModuleType, device: torch.device) -> str:
    """Every kernel set: RMSNorm (widths off the vector width), SwiGLU, and RoPE of GQA q/k heads
    with one table for the batch and one per row, forward and backward, against the references'
    values and autograd gradients; attention; the transpose (exactly)."""
    gen = torch.Generator().manual_seed(0)
    worst = _Worst()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    for isa in module.supported_isas():
        for rows, dim in ((5, 37), (67, 264)):
            x, w, g = rand(rows, dim), 1.0 + 0.1 * rand(dim), rand(rows, dim)
            y, rstd = module.rms_norm_forward(x, w, 1e-6, isa)
            xr, wr = _tracked(x, w)
            with torch.enable_grad():
                want = rms_norm_reference(xr, wr, 1e-6)
            worst.close(f"rms_norm isa={isa} {rows}x{dim}", y, want, 1e-5, 1e-5)
            gx, gw = module.rms_norm_backward(g, x, w, rstd, isa)
            want_gx, want_gw = _grads(want, g, (xr, wr))
            worst.close(f"rms_norm grad x isa={isa}", gx, want_gx, 1e-4, 1e-5)
            worst.close(f"rms_norm grad weight isa={isa}", gw, want_gw, 1e-4, 1e-4)
        gate, up, g = 4 * rand(3, 45), rand(3, 45), rand(3, 45)
        gr, ur = _tracked(gate, up)
        with torch.enable_grad():
            want = swiglu_reference(gr, ur)
        worst.close(f"swiglu isa={isa}", module.swiglu_forward(gate, up, isa), want, 1e-5, 1e-6)
        for got, expected, name in zip(module.swiglu_backward(g, gate, up, isa), _grads(want, g, (gr, ur)),
                                       ("gate", "up")):
            worst.close(f"swiglu grad {name} isa={isa}", got, expected, 1e-5, 1e-6)
        batch, seq, head_dim = 3, 11, 24
        for heads, table_batch in ((4, 1), (2, batch)):
            x, g = rand(batch, seq, heads * head_dim), rand(batch, heads, seq, head_dim)
            angles = rand(table_batch, seq, head_dim)
            cos, sin = angles.cos(), angles.sin()
            (xr,) = _tracked(x)
            with torch.enable_grad():
                want = rope_reference(xr, cos, sin, heads)
            worst.close(f"rope isa={isa} heads={heads}", module.rope_forward(x, cos, sin, heads, isa), want, 1e-5, 1e-6)
            worst.close(f"rope grad isa={isa} heads={heads}", module.rope_backward(g, cos, sin, isa),
                        _grads(want, g, (xr,))[0], 1e-5, 1e-6)
        _fused_attention(module, isa, rand, worst)
        for rows, cols in ((37, 21), (48, 32)):  # edges, and whole tiles of every kernel set
            x = rand(rows, cols)
            worst.close(f"transpose isa={isa} {rows}x{cols}", module.transpose(x, isa), x.t().contiguous(), 0.0, 0.0)
    return worst.summary()


def _fused_attention(module: ModuleType, isa: str, rand: Callable[..., torch.Tensor], worst: _Worst) -> None:
    """Causal GQA attention and a left-padding mask (every query sees itself), forward and backward;
    the masked case reads its values as a projection's [B, S, Hkv, D] seen transposed (strided)."""
    batch, seq, head_dim = 2, 19, 24
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[0, :5] = False
    padded = (torch.ones(seq, seq, dtype=torch.bool).tril() & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)
    for heads, kv_heads, mask in ((4, 2, None), (3, 3, padded[:, None].contiguous())):
        q = rand(batch, heads, seq, head_dim)
        k = rand(batch, kv_heads, seq, head_dim)
        # The masked case's values are a projection's [B, S, Hkv, D] seen transposed (strided).
        v = (rand(batch, kv_heads, seq, head_dim) if mask is None
             else rand(batch, seq, kv_heads, head_dim).transpose(1, 2))
        g = rand(batch, seq, heads, head_dim)
        out, stats = module.attention_forward(q, k, v, mask, head_dim**-0.5, isa)
        tracked = _tracked(q, k, v)
        with torch.enable_grad():
            want = attention_reference(*tracked, mask, head_dim**-0.5)
        worst.close(f"attention isa={isa} heads={heads}/{kv_heads} mask={mask is not None}", out, want, 1e-5, 1e-5)
        got = module.attention_backward(g, q, k, v, mask, out, stats, head_dim**-0.5, isa)
        for name, a, b in zip("qkv", got, _grads(want, g, tracked)):
            worst.close(f"attention grad {name} isa={isa} heads={heads}/{kv_heads}", a, b, 1e-4, 1e-5)


SELF_TESTS: dict[str, SelfTest] = {
    CPU_OP: fused_adam,
    CUDA_OP: fused_adam,
    DECODE_ATTENTION_OP.name: decode_attention,
    SAMPLING_OP.name: sampling,
    SELECTIVE_LOG_SOFTMAX_OP.name: selective_log_softmax,
    CPU_DECODE_OP.name: cpu_decode,
    FUSED_LAYERS_OP.name: fused_layers,
}
"""The self-test of every csrc op, by op name (tests check that no registered op lacks one)."""
