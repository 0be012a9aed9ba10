"""Fused RMSNorm, RoPE, SwiGLU and attention in the decoder layers of Llama-family models (Llama, Qwen2, Mistral).

    fuse_layer_ops(model)        # before FSDP wrapping: swaps those modules' classes for fused ones

A small model's eager forward and backward spend about a third of their time in elementwise ops
(RMSNorm is five passes over the hidden states, RoPE seven over q and k plus a transposed copy,
SwiGLU two over the MLP activations; autograd repeats each in backward), and torch's CPU flash
attention runs at a fifth of the matmul rate at head_dim 32. The `rlhf_fused_layers` op
(csrc/layers/) runs each elementwise op as one pass and attention as register-tiled AVX-512/AVX2
kernels (causal: only the visible half of the scores), for float32 on the CPU. Every other case
(a GPU, bf16, no compiler, a self-test that failed) runs the PyTorch references below, which are
Hugging Face's code op for op, so a model computes the same thing either way
(tests/test_fused_layers.py).

Where the linears run oneDNN (engine/backends/cpu/matmul.py), the decoder layer's residual adds go in
place onto the output and down projections' fresh outputs with no pass of autograd's own
(`linear_add`), and a forward without autograd takes SiLU(gate) from the gate projection's
epilogue and multiplies the up projection's output into it in place (`swiglu_linears`).

The swap changes each module's class to a subclass that overrides `forward` (as FSDP2 does), so
parameters, state-dict names, deepcopies and LoRA wrapping are untouched. Attention through a KV
cache, with dropout or with another implementation than SDPA (eager, flash) goes to the model's
own attention function. Under `--compile` nothing is swapped: inductor fuses these ops itself.
"""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import increment_version

from rlhf.engine.backends.cpu.matmul import (linear_add, packed_swiglu_weights, panel_gemm_op, shared_input_grads,
                                    shared_input_linears, swiglu_linears)
from rlhf.engine.backends.cpu.layer_op import FUSED_LAYERS_OP, layer_op
from rlhf.engine.attention import masked_attention
from rlhf.engine.fast_decode import rms_norm as rms_norm_reference  # LlamaRMSNorm.forward, op for op

__all__ = [
    "FUSED_LAYERS_OP", "attention", "attention_reference", "fuse_layer_ops", "fused_attention_runs", "packed_swiglu",
    "rms_norm", "rms_norm_reference", "rope", "rope_attention", "rope_reference", "swiglu", "swiglu_reference",
    "uses_fused_layers",
]


FUSED_LAYER_FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Model types (config.model_type) whose layers `fuse_layer_ops` swaps."""
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})
ATTENTION_CLASSES = frozenset({"LlamaAttention", "Qwen2Attention", "MistralAttention"})
DECODER_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"})


# ----------------------------------------------------------------------- references (the truth)

def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up."""
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection [batch, seq, heads * head_dim] as heads [batch, heads, seq, head_dim], rotated
    as apply_rotary_pos_emb does with tables cos/sin [batch or 1, seq, head_dim]."""
    batch, seq, width = x.shape
    x = x.view(batch, seq, heads, width // heads).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """What Hugging Face's SDPA attention computes without dropout: q [B, H, T, D] over k, v
    [B, Hkv, S, D] with a boolean mask [B or 1, 1, T, S] (True = visible) or causally when there
    is none; -> [B, T, H, D]."""
    out = masked_attention(query, key, value, mask, scale, is_causal=mask is None and query.shape[2] > 1)
    return out.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------- fused autograd functions

class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, op: ModuleType) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        y, rstd = op.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.op.rms_norm_backward(grad.contiguous(), x, weight, rstd)
        return grad_x, (grad_weight if ctx.needs_input_grad[1] else None), None, None


class _FusedSwiGLU(torch.autograd.Function):
    """With `overwrite_saved` (the caller's gate and up are temporaries nothing reads after this
    backward, as in FusedMLPMixin) the backward writes the gradients over the saved gate and up:
    the stores land on lines it has just read instead of fresh buffers (~1/3 less memory traffic).
    Their version is bumped, so a second backward through the graph (retain_graph) fails loudly."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, op: ModuleType, overwrite_saved: bool) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.op = op
        ctx.overwrite_saved = overwrite_saved and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
        return op.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        in_place = ctx.overwrite_saved and grad.untyped_storage().data_ptr() not in (
            gate.untyped_storage().data_ptr(), up.untyped_storage().data_ptr())
        grad_gate, grad_up = ctx.op.swiglu_backward(grad, gate, up, in_place=in_place)
        if in_place:
            increment_version(gate)
            increment_version(up)
        return grad_gate, grad_up, None, None


class _PackedSwiGLULinears(torch.autograd.Function):
    """silu(x @ gate_weight^T) * (x @ up_weight^T) with autograd: the forward through the packed
    SwiGLU GEMM (rlhf_cpu_decode.panel_swiglu_products: each tile of the two products computed
    together, stored for the backward and combined before the activation is stored, so no pass of
    its own reads them back), the backward as `_FusedSwiGLU`'s (the gradients written over the
    saved products) and then the two linears' as `_OneDnnSharedInputLinears`' (shared_input_grads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                packed: ModuleType, op: ModuleType) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        panels = packed.pack_swiglu_panels(gate_weight.t(), up_weight.t())
        hidden, gate, up = packed.panel_swiglu_products(rows, panels, gate_weight.shape[0])
        ctx.save_for_backward(rows, gate_weight, up_weight, gate, up)
        ctx.op = op
        return hidden.view(*x.shape[:-1], gate_weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, gate_weight, up_weight, gate, up = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_gate, grad_up = ctx.op.swiglu_backward(grad_rows, gate, up, in_place=True)
        increment_version(gate)
        increment_version(up)
        grad_x, (grad_gate_weight, grad_up_weight) = shared_input_grads(
            rows, (gate_weight, up_weight), (grad_gate, grad_up), ctx.needs_input_grad[0],
            [ctx.needs_input_grad[1], ctx.needs_input_grad[2]])
        if grad_x is not None:
            grad_x = grad_x.view(*grad.shape[:-1], rows.shape[1])
        return grad_x, grad_gate_weight, grad_up_weight, None, None


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                op: ModuleType) -> torch.Tensor:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.op = op
        return op.rope_forward(x.contiguous(), cos, sin, heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return ctx.op.rope_backward(grad.contiguous(), cos, sin), None, None, None, None


class _FusedAttention(torch.autograd.Function):
    """The attention kernels; with RoPE tables (cos, sin) the query and key are the projections'
    token-major rows [B, T, heads, D] before RoPE, which the kernels apply (and transpose in the
    backward) themselves."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scale: float, op: ModuleType, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> torch.Tensor:
        # The kernels read values through their strides: a value projection seen as [B, Hkv, S, D]
        # (a transposed view) needs no copy, and its gradient comes back in the same layout.
        query, key = query.contiguous(), key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        spans = None if mask is None else _mask_spans(mask, op)
        tables = {} if cos is None or sin is None else {"cos": cos.contiguous(), "sin": sin.contiguous()}
        out, stats = op.attention_forward(query, key, value, mask, scale, spans=spans, **tables)
        ctx.save_for_backward(query, key, value, out, stats, *tables.values())
        ctx.mask, ctx.spans, ctx.scale, ctx.op = mask, spans, scale, op
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, stats, *tables = ctx.saved_tensors
        rope = dict(zip(("cos", "sin"), tables))
        grads = ctx.op.attention_backward(grad.contiguous(), query, key, value, ctx.mask, out, stats, ctx.scale,
                                          spans=ctx.spans, **rope)
        return *grads, None, None, None, None, None


_last_spans: tuple[weakref.ref[torch.Tensor], int, torch.Tensor] | None = None


def _mask_spans(mask: torch.Tensor, op: ModuleType) -> torch.Tensor:
    """The kernels' row spans of `mask` (`op.mask_spans`), found once for the layers of a forward
    that pass the same unchanged mask tensor (a packed forward's [N, N] mask: N^2 bytes to scan)."""
    global _last_spans
    if _last_spans is not None and _last_spans[0]() is mask and _last_spans[1] == mask._version:
        return _last_spans[2]
    spans = op.mask_spans(mask)
    _last_spans = (weakref.ref(mask), mask._version, spans)
    return spans


def fused_attention_applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The kernels take this call (query [B, H, T, D], key [B, Hkv, S, D]): causal self-attention (no
    mask, as many keys as queries) or a boolean mask [B or 1, 1, T, S]; anything else is left to the
    model's attention function."""
    return _attention_shapes_apply(query.shape[0], query.shape[2], key.shape[2], mask)


def _attention_shapes_apply(batch: int, seq: int, keys: int, mask: torch.Tensor | None) -> bool:
    if mask is None:
        return keys == seq
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, batch)
            and tuple(mask.shape[2:]) == (seq, keys))


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """attention_reference, fused where it can be. A query that sees no key gets zeros (and no
    gradient) from the kernels; such rows only occur at padding, whose outputs nothing reads."""
    op = layer_op(query, key, value) if fused_attention_applies(query, key, mask) else None
    if op is None:
        return attention_reference(query, key, value, mask, scale)
    return _FusedAttention.apply(query, key, value, None if mask is None else mask.contiguous(), scale, op)


def _rope_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, mask: torch.Tensor | None) -> ModuleType | None:
    """The built op where the kernels take this self-attention call with RoPE inside (float32 on the
    CPU, RoPE tables [B or 1, T, D] that need no gradient, a mask the kernels take), else None."""
    batch, seq = query.shape[:2]
    head_dim = value.shape[-1]
    shapes = (query.dim() == 3 and key.dim() == 3 and value.dim() == 4 and tuple(value.shape[:3]) == (
        batch, key.shape[-1] // head_dim, seq) and key.shape[:2] == query.shape[:2] and cos.dim() == 3
        and cos.shape == sin.shape and cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (seq, head_dim))
    if not (shapes and not (cos.requires_grad or sin.requires_grad) and _attention_shapes_apply(batch, seq, seq, mask)):
        return None
    return layer_op(query, key, value, cos, sin)


def _fused_rope_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, mask: torch.Tensor | None, scale: float, op: ModuleType) -> torch.Tensor:
    head_dim = value.shape[-1]
    batch, seq = query.shape[:2]
    return _FusedAttention.apply(query.view(batch, seq, -1, head_dim), key.view(batch, seq, -1, head_dim), value,
                                 None if mask is None else mask.contiguous(), scale, op, cos, sin)


def rope_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """attention(rope(query), rope(key), value) of a self-attention layer, with RoPE applied inside
    the attention kernels (forward and backward) where they take the call (float32 on the CPU with
    the op built, RoPE tables [B or 1, T, D] that need no gradient, a mask the kernels take): no
    separate pass over the queries and keys. query [B, T, H * D] and key [B, T, Hkv * D] are the
    projections' outputs, value [B, Hkv, T, D] (a transposed view is read in place) -> [B, T, H, D]."""
    op = _rope_attention_op(query, key, value, cos, sin, mask)
    if op is None:
        head_dim = value.shape[-1]
        heads, kv_heads = query.shape[-1] // head_dim, key.shape[-1] // head_dim
        return attention(rope(query, cos, sin, heads), rope(key, cos, sin, kv_heads), value, mask, scale)
    return _fused_rope_attention(query, key, value, cos, sin, mask, scale, op)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference, fused where it can be."""
    op = layer_op(x, weight)
    return rms_norm_reference(x, weight, eps) if op is None else _FusedRMSNorm.apply(x, weight, eps, op)


def swiglu(gate: torch.Tensor, up: torch.Tensor, overwrite_saved: bool = False) -> torch.Tensor:
    """swiglu_reference, fused where it can be. `overwrite_saved`: gate and up are the caller's
    temporaries, which the backward may overwrite with their gradients (see _FusedSwiGLU)."""
    op = layer_op(gate, up) if gate.shape == up.shape else None
    return swiglu_reference(gate, up) if op is None else _FusedSwiGLU.apply(gate, up, op, overwrite_saved)


def packed_swiglu(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor | None:
    """silu(gate(x)) * up(x) through `_PackedSwiGLULinears` where autograd records and the packed
    SwiGLU GEMM takes the two linears (cpu_matmul.packed_swiglu_weights); None otherwise."""
    weights = packed_swiglu_weights(x, gate, up)
    if weights is None or not torch.is_grad_enabled() or not any(t.requires_grad for t in (x, *weights)):
        return None
    op = layer_op(x, *weights)
    return None if op is None else _PackedSwiGLULinears.apply(x, *weights, panel_gemm_op(), op)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """rope_reference, fused where it can be (tables that need gradients take the reference)."""
    fusable = x.dim() == 3 and cos.dim() == 3 and not (cos.requires_grad or sin.requires_grad)
    op = layer_op(x, cos, sin) if fusable else None
    return rope_reference(x, cos, sin, heads) if op is None else _FusedRoPE.apply(x, cos, sin, heads, op)


# ----------------------------------------------------------------------- the modules

class FusedRMSNormMixin(nn.Module):
    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class FusedMLPMixin(nn.Module):
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus `residual` where given (FusedDecoderLayerMixin: cpu_matmul.linear_add
        adds it onto the down projection's output)."""
        hidden = swiglu_linears(x, self.gate_proj, self.up_proj)  # inference-only: SiLU in a GEMM's epilogue
        if hidden is None:
            hidden = packed_swiglu(x, self.gate_proj, self.up_proj)  # with autograd: the packed SwiGLU GEMM
        if hidden is None:
            hidden = swiglu(*shared_input_linears(x, (self.gate_proj, self.up_proj)), overwrite_saved=True)
        return self.down_proj(hidden) if residual is None else linear_add(hidden, self.down_proj, residual)


class FusedAttentionMixin(nn.Module):
    """Llama-family attention with RoPE fused, and SDPA attention (no dropout, no KV cache, causal or
    a boolean mask) through the fused attention kernels; anything else goes to the model's own
    attention function."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    head_dim: int
    scaling: float
    attention_dropout: float
    config: Any
    layer_idx: int

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                residual: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the attention output, plus `residual` where given: FusedDecoderLayerMixin's residual
        stream, added onto the output projection's output by cpu_matmul.linear_add; the weights or None)."""
        # The KV cache: the fourth argument, `cache` since transformers 5.2x (`past_key_values` before).
        for name in ("cache", "past_key_values", "past_key_value"):
            if past_key_values is None:
                past_key_values = kwargs.pop(name, None)
        if position_embeddings is None:
            output, weights = super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                              **kwargs)
            return (output if residual is None else residual + output), weights
        input_shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        query, key, value = shared_input_linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        value = value.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        dropout = 0.0 if not self.training else self.attention_dropout
        causal = kwargs.get("is_causal")  # as HF's SDPA decides it: the call's, else the module's
        causal = getattr(self, "is_causal", True) if causal is None else causal
        sdpa = (self.config._attn_implementation == "sdpa" and dropout == 0.0 and not kwargs.get("output_attentions")
                and (causal or attention_mask is not None))
        fusable = sdpa and past_key_values is None
        op = _rope_attention_op(query, key, value, cos, sin, attention_mask) if fusable else None
        if op is not None:  # RoPE inside the attention kernels: the projections' rows go in as they are
            output = _fused_rope_attention(query, key, value, cos, sin, attention_mask, self.scaling, op)
            return self._project(output.reshape(*input_shape, -1), residual), None
        query = rope(query, cos, sin, query.shape[-1] // self.head_dim)
        key = rope(key, cos, sin, key.shape[-1] // self.head_dim)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if sdpa and fused_attention_applies(query, key, attention_mask):
            output, weights = attention(query, key, value, attention_mask, self.scaling), None
        else:
            family = sys.modules[type(self).__mro__[2].__module__]
            interface = family.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, family.eager_attention_forward)
            output, weights = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                        **self._family_attention_kwargs(), **kwargs)
        return self._project(output.reshape(*input_shape, -1).contiguous(), residual), weights

    def _project(self, output: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(output) if residual is None else linear_add(output, self.o_proj, residual)

    def _family_attention_kwargs(self) -> dict[str, Any]:
        """What the family's forward passes besides Llama's (Qwen2 / Mistral: the sliding window)."""
        name = type(self).__mro__[2].__name__
        if name == "Qwen2Attention":
            return {"sliding_window": self.sliding_window}
        if name == "MistralAttention":
            return {"sliding_window": getattr(self.config, "sliding_window", None)}
        return {}


class FusedDecoderLayerMixin(nn.Module):
    """A Llama-family decoder layer whose two residual adds go onto the output and down projections'
    outputs (cpu_matmul.linear_add: in place on the product's fresh output where those are OneDnnLinear
    modules, else the add as Hugging Face writes it). Layers whose attention or MLP were not swapped
    run their own forward."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or not (isinstance(self.self_attn, FusedAttentionMixin) and isinstance(self.mlp, FusedMLPMixin)):
            return super().forward(hidden_states, *args, **kwargs)
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states), residual=hidden_states, **kwargs)
        return self.mlp(self.post_attention_layernorm(hidden_states), residual=hidden_states)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, mixin: type) -> type:
    """`cls` with the mixin's forward (MRO: fused class, mixin, cls); one per class."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _FUSED_CLASSES[cls]


def _mixin_for(module: nn.Module) -> type | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None
    if cls.__name__ in RMS_NORM_CLASSES:
        return FusedRMSNormMixin
    activation = getattr(getattr(module, "config", None), "hidden_act", None)
    if cls.__name__ in MLP_CLASSES and activation in ("silu", "swish"):
        return FusedMLPMixin
    if cls.__name__ in ATTENTION_CLASSES:
        return FusedAttentionMixin
    if cls.__name__ in DECODER_LAYER_CLASSES:
        return FusedDecoderLayerMixin
    return None


def fuse_layer_ops(model: nn.Module) -> int:
    """Swap the RMSNorm, MLP and attention modules of Llama-family layers in `model` for their
    fused subclasses, in place; returns how many were swapped (0 for other families)."""
    swapped = 0
    for module in model.modules():
        mixin = _mixin_for(module)
        if mixin is not None:
            module.__class__ = _fused_class(type(module), mixin)
            swapped += 1
    return swapped


def fused_attention_runs(model: nn.Module) -> bool:
    """`model`'s attention runs the fused kernels (when a call's mask and shapes let it): its
    layers are swapped (`fuse_layer_ops`) and its weights are float32 on the CPU with the op built."""
    param = next(model.parameters(), None)
    return uses_fused_layers(model) and param is not None and layer_op(param) is not None


def uses_fused_layers(model: nn.Module) -> bool:
    """Whether `fuse_layer_ops` swapped any of `model`'s modules (the engine's --fused-layers)."""
    fused = tuple(_FUSED_CLASSES.values())
    return bool(fused) and any(isinstance(module, fused) for module in model.modules())
