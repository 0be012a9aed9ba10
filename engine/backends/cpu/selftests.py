"""Load-time self-tests of the CPU backend's ops (engine/op_selftests.py says what a self-test is).

`rlhf_cpu_decode` (the fused decode step and sampler) is checked against `CpuLlamaDecoder`'s Python
step (the torch path), `rlhf_fused_layers` against the PyTorch references in fused_layers.py, on
every kernel set the build has. The backend package registers them with their ops
(engine/backends/cpu/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.engine.backends.cpu.decoder import CpuLlamaDecoder
from rlhf.engine.backends.cpu.fused_layers import attention_reference, rms_norm_reference, rope_reference, swiglu_reference
from rlhf.engine.op_selftests import OpMismatch, Worst
from rlhf.engine.sampling import draw_explained_by_rounding, process_logits, sample_from_logits


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


def cpu_decode_self_test(module: ModuleType, device: torch.device) -> str:
    """Prefill then five decode steps of every kernel set, with MKL and with packed-weight
    projections, against FastLlamaDecoder's Python step (logits and KV cache, left-padded rows),
    and the fused sampler against
    `sample_from_logits` from the same uniforms."""
    worst = Worst()
    gen = torch.Generator().manual_seed(4)
    model = _tiny_llama(gen)
    batch, width, steps = 3, 5, 5
    ids = torch.randint(3, 97, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = torch.randint(3, 97, (batch, steps), generator=gen)
    full_mask = torch.cat([mask, torch.ones(batch, steps, dtype=mask.dtype)], dim=1)

    def run(decoder: CpuLlamaDecoder) -> list[torch.Tensor]:
        logits = [decoder.prefill(ids, mask, positions)]
        for step in range(steps):
            logits.append(decoder.decode(tokens[:, step:step + 1], full_mask[:, :width + step + 1],
                                         positions[:, -1:] + step + 1))
        return logits

    reference = CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False)
    want = run(reference)
    scale = max(float(w.abs().max()) for w in want)
    # The float16 cache (kv_cache_dtype="fp16"): the Python step over that cache is its reference.
    want_half = run(CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False,
                                     kv_cache_dtype="fp16"))
    for isa in module.supported_isas():
        for packed in (False, True):
            fused = CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False)
            fused.use_kernel_step(module, isa, packed_gemm=packed)
            name = f"cpu decode isa={isa}{' packed' if packed else ''}"
            for step, (g, w) in enumerate(zip(run(fused), want)):
                worst.close(f"{name} step {step} logits", g, w, rtol=0.0, atol=1e-5 * scale)
            for layer in range(len(reference.keys)):
                worst.close(f"{name} layer {layer} keys", fused.keys[layer], reference.keys[layer], rtol=1e-5, atol=1e-5)
                worst.close(f"{name} layer {layer} values", fused.values[layer], reference.values[layer],
                            rtol=1e-5, atol=1e-5)
        half = CpuLlamaDecoder(model, batch, width + steps, cpu_kernel=False, attention_kernel=False,
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


def fused_layers_self_test(module: ModuleType, device: torch.device) -> str:
    """Every kernel set: RMSNorm (widths off the vector width), SwiGLU, and RoPE of GQA q/k heads
    with one table for the batch and one per row, forward and backward, against the references'
    values and autograd gradients; attention; the transpose (exactly)."""
    gen = torch.Generator().manual_seed(0)
    worst = Worst()

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


def _fused_attention(module: ModuleType, isa: str, rand: Callable[..., torch.Tensor], worst: Worst) -> None:
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


__all__ = ["cpu_decode_self_test", "fused_layers_self_test"]
