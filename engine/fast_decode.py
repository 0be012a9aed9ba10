"""A fast prefill/decode path for Llama-style models (Llama, Qwen2, Mistral without sliding window).

For a small model, a decode step through Hugging Face's forward is largely Python and op
dispatch: keyword plumbing, output dataclasses, the cache object, mask construction, seven
projections per layer (on the benchmark's 4-layer CPU model about 2.2 ms of overhead per step,
against 0.9 ms here). In the manner of gpt-fast, `FastLlamaDecoder` runs the same math as plain
functions over tensors it reads from the HF module (the module and its forward are untouched):

- per generate() call the weights are gathered once: q/k/v as one projection (with Qwen2's
  biases), gate/up as another, so a layer is 4 matmuls instead of 7. A rollout skeleton keeps
  each group's rows side by side in one storage (`share_fused_storage`), read in place; other
  models' are concatenated. The two are used transposed, [in, out]: on the CPU as a row-major
  copy (at a decode step's few rows a GEMM multiplies that layout ~1.4x faster than a [out, in]
  weight it must repack on every call), on CUDA as a view (cuBLAS reads either layout);
- RoPE cos/sin come from the model's own rotary embedding module, tabulated once for every
  position of the rollout (so rope_scaling types such as linear, llama3 or yarn are honoured),
  and are applied to queries and keys together;
- keys and values go to a preallocated [batch, kv_heads, prompt + max_new_tokens, head_dim]
  buffer per layer; a step attends to the filled prefix with `scaled_dot_product_attention`
  under the padding mask. A decode step packs the query heads of each KV group into the query
  axis (GQA without repeating keys, as transformers' own `pack_gqa` does); for group sampling
  `expand` copies each prefilled prompt's rows of the cache to its samples' rows;
- the final norm and lm_head run only on the last position.

This class is the torch path of every device. A backend's decoder subclasses it (the CPU one's
fused decode step and row groups, engine/backends/cpu/decoder.py; the CUDA one's decode-attention
kernel and graph-replayed steps, engine/backends/cuda/decoder.py) and must match it.

Numerics follow the HF modules op for op (RMSNorm upcasts to float32 and casts back before the
weight, RoPE in the model dtype), so greedy tokens match the reference path; the HF forward
stays the reference (tests/test_fast_decode.py). `fast_decode_unsupported_reason(model)` says
why a model must take the reference path: another family, sliding-window layers, a rope type
that rescales with sequence length, DTensor (tensor-parallel or FSDP) parameters, modules
replaced by adapters or quantized layers, hooks on the model, or training mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from rlhf.engine.attention import masked_attention
from rlhf.engine.decode_attention import decode_attention_reference
from rlhf.engine.decode_loop import DecodeLoop

__all__ = ["FastLlamaDecoder", "computes_as_linear", "copied_projection_bytes", "fast_decode_unsupported_reason",
           "support_checked_once",
           "fused_projection_groups", "rms_norm", "apply_rope", "share_fused_storage", "signed_sin", "view_transpose"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
# Rope types whose frequencies depend on the sequence length seen so far (HF's dynamic_rope_update):
# a position table computed once would not reproduce them, so such models take the reference path.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Transpose = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: normalise in float32, scale by the weight in the input's dtype."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def plain_transpose(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] -> x.t().contiguous()."""
    return x.t().contiguous()


def view_transpose(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] -> x.t(), a view: for GEMMs that read a transposed operand at full speed (cuBLAS)."""
    return x.t()


# -- pure math ----------------------------------------------------------------------------------


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm() for float32 inputs, where torch's own op computes the very same ops in C++."""
    return F.rms_norm(x, weight.shape, weight, eps)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., head_dim] with its first half negated, the form `apply_rope` takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., head_dim] in HF's rotate-half convention (cos/sin broadcast).

    HF's `x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1) equals, bit for bit,
    `x * cos + roll(x, half) * signed_sin(sin)`: one op instead of three for the rotation.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


# -- support check ------------------------------------------------------------------------------


def computes_as_linear(module: nn.Module) -> bool:
    """An nn.Linear as torch defines it, or a backend's subclass of it that computes the same
    (`computes_as_plain_linear = True`: another library's matmul); not a LoRA, quantized or other layer."""
    return type(module) is nn.Linear or (isinstance(module, nn.Linear)
                                         and getattr(type(module), "computes_as_plain_linear", False))


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    return getattr(inner, "layers", None) if inner is not None else None


_checked_models: dict[tuple[int, bool], str | None] | None = None


@contextlib.contextmanager
def support_checked_once() -> Iterator[None]:
    """Inside the block, `fast_decode_unsupported_reason` checks each model once (one rollout asks
    three times: the runner's choice, the decoder, the size of its weight copies); the block must
    not change the models it generates with."""
    global _checked_models
    outer = _checked_models
    _checked_models = {} if outer is None else outer
    try:
        yield
    finally:
        _checked_models = outer


def fast_decode_unsupported_reason(model: nn.Module) -> str | None:
    """Why `FastLlamaDecoder` cannot run `model` faithfully, or None when it can (remembered inside
    `support_checked_once`)."""
    if _checked_models is None:
        return _unsupported_reason(model)
    key = (id(model), model.training)
    if key not in _checked_models:
        _checked_models[key] = _unsupported_reason(model)
    return _checked_models[key]


def _unsupported_reason(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    text_config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} include windowed attention"
    rope_type = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if any(kind in str(rope_type) for kind in _LENGTH_DEPENDENT_ROPE):
        return f"rope type {rope_type!r} rescales with sequence length"
    if model.training:
        return "the model is in training mode (dropout)"
    if getattr(model, "is_quantized", False):
        return "the model is quantized"
    layers = _decoder_layers(model)
    inner = getattr(model, "model", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return "the model does not have the model.layers / rotary_emb / embed_tokens layout"
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return f"{type(module).__name__} has forward hooks that the fast path would skip"
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return "parameters are DTensors (tensor-parallel or FSDP-sharded)"
    linears = [model.get_output_embeddings()]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if not all(computes_as_linear(m) for m in linears):
        return "projections are not plain nn.Linear (adapters or quantized layers)"
    return None


# -- weights ------------------------------------------------------------------------------------


@dataclass
class _LayerWeights:
    """One decoder layer's tensors, q/k/v and gate/up fused."""

    input_norm: torch.Tensor
    input_eps: float
    wqkv_t: torch.Tensor
    """[hidden, (heads + 2 kv_heads) head_dim], contiguous (x @ wqkv_t)."""
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    w_gate_up_t: torch.Tensor
    """[hidden, 2 ffn], contiguous: gate's columns, then up's."""
    b_gate_up: torch.Tensor | None
    w_gate: torch.Tensor
    """The model's own gate and up weights, [ffn, hidden] (no copy): a prefill's gate and up
    products, each into its own tensor, read them whole (a column slice of w_gate_up_t would
    send oneDNN to its slow strided path and MKL to a slower one)."""
    w_up: torch.Tensor
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def _adjacent_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The weights [out_i, in] as one [sum(out_i), in] view when they are consecutive rows of one
    storage (a rollout skeleton's, `share_fused_storage`), else None."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if (not w.is_contiguous() or w.dtype != first.dtype or w.shape[1:] != first.shape[1:]
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.storage_offset() != offset):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def _fused_t(transpose: Transpose, *linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights of several projections of one input side by side, transposed: [in, sum(out)], and
    their biases concatenated. Rows already side by side in one storage (`share_fused_storage`) are
    read in place; others are concatenated. Then `transpose` (a backend's: a contiguous copy on the
    CPU, a view on CUDA, whose GEMMs read either layout) gives the [in, out] layout."""
    weights = [m.weight.detach() for m in linears]
    joined = _adjacent_rows(weights)
    weight = transpose(joined if joined is not None else torch.cat(weights))
    if all(m.bias is None for m in linears):
        return weight, None
    biases = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
    joined_bias = _adjacent_rows([b[:, None] for b in biases]) if all(m.bias is not None for m in linears) else None
    return weight, joined_bias[:, 0] if joined_bias is not None else torch.cat(biases)


def fused_projection_groups(layer: nn.Module) -> tuple[tuple[nn.Linear, ...], tuple[nn.Linear, ...]]:
    """A Llama-family decoder layer's projections the fast decoder runs as one: q/k/v, and gate/up."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


@torch.no_grad()
def share_fused_storage(model: nn.Module) -> int:
    """Give each decoder layer's q/k/v weights (and biases) one storage, rows side by side, and its
    gate/up weights another, in place (values kept; parameter names and modules unchanged), so the
    fast decoder reads them fused without a copy (`_fused_t`). A rollout skeleton does this once
    (engine/rollout.py). -> the layers changed (0 for a model the fast decoder does not run)."""
    if fast_decode_unsupported_reason(model) is not None:
        return 0
    layers = _decoder_layers(model)
    for layer in layers:
        for group in fused_projection_groups(layer):
            for name in ("weight", "bias"):
                tensors = [getattr(m, name) for m in group]
                if any(t is None for t in tensors):
                    continue
                joined = torch.cat([t.detach() for t in tensors])
                start = 0
                for m, t in zip(group, tensors):
                    setattr(m, name, nn.Parameter(joined[start : start + t.shape[0]], requires_grad=t.requires_grad))
                    start += t.shape[0]
    return len(layers)


def copied_projection_bytes(model: nn.Module, transpose_copies: bool) -> int:
    """Bytes the fast decoder allocates for `model`'s fused q/k/v and gate/up weights: none where
    they share a storage and `transpose_copies` is False (a view), else one copy of each."""
    if fast_decode_unsupported_reason(model) is not None:
        return 0
    total = 0
    for layer in _decoder_layers(model):
        for group in fused_projection_groups(layer):
            weights = [m.weight for m in group]
            if transpose_copies or _adjacent_rows(weights) is None:
                total += sum(w.numel() * w.element_size() for w in weights)
    return total


def _linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight_t [in, out] (+ bias): F.linear with the weight stored transposed."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _layer_weights(layer: nn.Module, transpose: Transpose) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = fused_projection_groups(layer)
    wqkv_t, bqkv = _fused_t(transpose, *qkv)
    w_gate_up_t, b_gate_up = _fused_t(transpose, *gate_up)
    return _LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        input_eps=float(layer.input_layernorm.variance_epsilon),
        wqkv_t=wqkv_t, bqkv=bqkv,
        wo=attn.o_proj.weight.detach(), bo=_bias(attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        post_eps=float(layer.post_attention_layernorm.variance_epsilon),
        w_gate_up_t=w_gate_up_t, b_gate_up=b_gate_up,
        w_gate=mlp.gate_proj.weight.detach(), w_up=mlp.up_proj.weight.detach(),
        w_down=mlp.down_proj.weight.detach(), b_down=_bias(mlp.down_proj),
    )


def _activation(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """F.silu for the usual `hidden_act="silu"`, else the model's own activation module."""
    if getattr(model.config.get_text_config(decoder=True), "hidden_act", None) == "silu":
        return F.silu
    return _decoder_layers(model)[0].mlp.act_fn


# -- the decoder --------------------------------------------------------------------------------


class FastLlamaDecoder:
    """Prefill and decode steps of one rollout of `batch` sequences up to `max_len` tokens.

    Built per generate() call: it gathers the weights (q/k/v and gate/up fused), tabulates
    RoPE for positions [0, max_len) and allocates the KV cache. `prefill` then `decode` mirror
    `generation.prefill` / `generation.decode_step` and return [batch, vocab] logits.

    `linear` (F.linear's signature) and `transpose` run the projections and the weights' one-off
    transposes (a backend passes its own); `cache_dtype` is the KV cache's (default: the model's;
    a narrower one rounds every write and is widened back as it is read, so every step computes the
    same rounded-cache model). With `attention_kernel` a decode step attends through
    `self.decode_attention` (`decode_attention_reference` here; a backend's kernel in a subclass)
    over the whole [B, Hkv, S, D] cache under the padding mask, instead of SDPA over the filled
    prefix: the same attention, read in place. `uses_attention_kernel` says which.
    """

    decode_attention: Callable[..., torch.Tensor] = staticmethod(decode_attention_reference)

    def __init__(
        self, model: nn.Module, batch: int, max_len: int, *, linear: Linear = F.linear,
        transpose: Transpose = plain_transpose, cache_dtype: torch.dtype | None = None,
        attention_kernel: bool = False,
    ) -> None:
        reason = fast_decode_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot run this model: {reason}")
        config = model.config.get_text_config(decoder=True)
        inner = model.model
        layers = _decoder_layers(model)
        attn = layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.act = _activation(model)
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [_layer_weights(layer, transpose) for layer in layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        lm_head = model.get_output_embeddings()
        self.lm_head, self.lm_head_bias = lm_head.weight.detach(), _bias(lm_head)
        self.linear = linear

        dtype, device = self.embed.dtype, self.embed.device
        # torch's fused-in-C++ rms_norm runs LlamaRMSNorm's exact float32 ops; in lower
        # precision HF rounds to the model dtype before the weight, which only rms_norm() copies.
        self.rms_norm = _rms_norm_fp32 if dtype == torch.float32 else rms_norm
        # The model's own rotary module, asked once for every position the rollout can reach.
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = inner.rotary_emb(torch.empty(0, dtype=dtype, device=device), positions)
        self.cos, self.sin, self.sin_signed = cos[0], sin[0], signed_sin(sin[0])  # [max_len, head_dim]

        # Left uninitialised: a step reads only the prefix that earlier steps have written.
        shape = (batch, self.num_kv_heads, max_len, self.head_dim)
        self.cache_dtype = cache_dtype or dtype
        self.keys = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in self.layers]
        self.length = 0  # tokens written so far (a host int: no step reads a device value)
        self.max_len = max_len
        self.uses_attention_kernel = attention_kernel

    def expand(self, index: torch.Tensor) -> None:
        """Rows `index` of the cache become its rows (group sampling: each prompt prefilled once,
        its keys and values copied to each of its samples' rows; `index` in repeat_interleave order).

        Only the filled prefix is copied, layer by layer, so the old cache of the unique prompts
        is released as the new one fills. Dropping finished rows (`index` increasing) moves the kept
        rows' filled prefixes to the front of the cache in place: no fresh buffers to fault in.
        """
        dropping = index.numel() <= self.keys[0].shape[0] and bool((index[1:] > index[:-1]).all())
        # Rows before the first dropped one stay where they are.
        moved = index != torch.arange(index.numel(), device=index.device)
        first_moved = int(moved.int().argmax()) if bool(moved.any()) else index.numel()
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                filled = old.narrow(2, 0, self.length)
                if dropping:
                    filled[first_moved : index.numel()] = filled.index_select(0, index[first_moved:])
                    cache[i] = old[: index.numel()]
                else:
                    new = old.new_empty((index.numel(), *old.shape[1:]))
                    new.narrow(2, 0, self.length).copy_(filled.index_select(0, index))
                    cache[i] = new

    def run(self, loop: DecodeLoop) -> int:
        """The decode loop over every row together (generation.py); -> the steps it ran."""
        return loop.run_all(self)

    def _attention(
        self, w: _LayerWeights, x: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor, batch: int, steps: int, last_only: bool,
    ) -> torch.Tensor:
        """x [B*T, hidden] -> attention output [B*T, hidden] ([B, hidden] when `last_only`).

        Writes this step's keys and values at [self.length, self.length + T) of the cache.
        A 2-D `mask` is the boolean key mask [B, cached + 1] of a decode step for the kernel.
        """
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk, new_keys, new_values = self._rotated_qkv(w, x, rope, batch, steps)
        keys, values = self.keys[layer], self.values[layer]
        end = self.length + steps
        keys.narrow(2, self.length, steps).copy_(new_keys)
        values.narrow(2, self.length, steps).copy_(new_values)
        k, v = self._cached(keys.narrow(2, 0, end)), self._cached(values.narrow(2, 0, end))
        groups = heads // kv_heads
        if mask.dim() == 2:
            # The kernel reads the cache buffer in place, only at the positions the mask allows.
            q = qk[:, -1].narrow(1, 0, heads)  # [B, H, D]: head h reads KV head h // groups
            out = self.decode_attention(q, keys, values, mask, scale=self.scaling).reshape(batch, heads * head_dim)
        elif steps == 1 or last_only:
            # One query per sequence: the `groups` query heads sharing a KV head become that
            # head's query rows (transformers' pack_gqa), so each cached key is read once.
            q = qk[:, -1].narrow(1, 0, heads).reshape(batch, kv_heads, groups, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.narrow(2, -1, 1), scale=self.scaling)
            out = out.reshape(batch, heads * head_dim)  # CUDA's kernels may return it strided
        else:
            q = qk.narrow(2, 0, heads).transpose(1, 2)
            out = masked_attention(q, k, v, mask, self.scaling)
            out = out.transpose(1, 2).reshape(batch * steps, heads * head_dim)
        return self.linear(out, w.wo, w.bo)

    def _rotated_qkv(
        self, w: _LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: int, steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's fused q/k/v projection of x [B*T, hidden] with RoPE applied: (queries and
        keys [B, T, H + Hkv, D], this step's keys and values [B, Hkv, T, D] in the cache's layout)."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._linear_t(self.rms_norm(x, w.input_norm, w.input_eps), w.wqkv_t, w.bqkv)
        qkv = qkv.view(batch, steps, heads + 2 * kv_heads, head_dim)
        qk = apply_rope(qkv.narrow(2, 0, heads + kv_heads), *rope)  # queries and keys together
        new_values = qkv.narrow(2, heads + kv_heads, kv_heads).transpose(1, 2)
        return qk, qk.narrow(2, heads, kv_heads).transpose(1, 2), new_values

    def _cached(self, t: torch.Tensor) -> torch.Tensor:
        """Cached keys or values in the model's dtype (a 16-bit cache of a float32 model widened)."""
        return t if t.dtype == self.embed.dtype else t.to(self.embed.dtype)

    def _linear_t(self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight_t (+ bias) as `_linear_t`, through oneDNN where this decoder's linears take it."""
        return _linear_t(x, weight_t, bias) if self.linear is F.linear else self.linear(x, weight_t.t(), bias)

    def _mlp(self, w: _LayerWeights, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The layer's MLP of x [rows, hidden] (`fused`: a backend's prefill layer ops, in a subclass)."""
        h = self.rms_norm(x, w.post_norm, w.post_eps)
        gate, up = self._linear_t(h, w.w_gate_up_t, w.b_gate_up).chunk(2, dim=-1)
        return self.linear(self.act(gate) * up, w.w_down, w.b_down)

    def _check_room(self, steps: int) -> None:
        """RuntimeError unless the cache has room for `steps` more positions."""
        if self.length + steps > self.max_len:
            raise RuntimeError(f"KV cache overflow: writing up to position {self.length + steps} of {self.max_len}")

    def _forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions [B, T] after the cached ones -> [B, V] logits of the last.

        `mask` [B, 1, T, cached + T] is boolean (True = visible) or additive, or for one token
        per sequence through `kernels.decode_attention` the key mask [B, cached + 1]. The last layer
        runs its attention output, MLP and the final norm only for the last position (prefill
        skips ~20% of its matmuls): nothing else reaches the logits.
        """
        batch, steps = tokens.shape
        self._check_room(steps)
        fused = self._prefills_fused(steps, mask)
        if fused:
            rope = (self.cos[position_ids], self.sin[position_ids])
        else:
            rope = (self.cos[position_ids].unsqueeze(2), self.sin_signed[position_ids].unsqueeze(2))
        x = F.embedding(tokens.reshape(-1), self.embed)  # [B*T, hidden]
        last_layer = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            last_only = i == last_layer and steps > 1
            attention = self._prefill_attention if fused else self._attention
            attn = attention(w, x, i, rope, mask, batch, steps, last_only)
            if last_only:
                x = x.view(batch, steps, -1)[:, -1]
            x = x + attn
            x = x + self._mlp(w, x, fused)
        self.length += steps
        return self.linear(self.rms_norm(x, self.norm, self.norm_eps), self.lm_head, self.lm_head_bias)

    def _prefills_fused(self, steps: int, mask: torch.Tensor) -> bool:
        """Whether this forward runs a backend's fused prefill layer ops (`_prefill_attention`, `_mlp`
        with fused=True): never here."""
        return False

    def _prefill_attention(self, w: _LayerWeights, x: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
                           mask: torch.Tensor, batch: int, steps: int, last_only: bool) -> torch.Tensor:
        """`_attention` of a fused prefill (a backend's subclass defines it where `_prefills_fused` can be True)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused prefill")

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Boolean visibility -> the additive mask SDPA adds to the scores (0 or -inf)."""
        zero = torch.zeros((), dtype=self.embed.dtype, device=visible.device)
        return zero.masked_fill(~visible, float("-inf"))

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Run the left-padded prompt [B, P], filling the cache; -> [B, V] logits of the last position."""
        prompt_len = input_ids.shape[1]
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=input_ids.device).tril()
        visible = causal & attention_mask.bool()[:, None, :]
        # A pad query sees no real key before it; letting it see itself keeps its (unused) output
        # finite, so no NaN reaches the cached keys/values that real tokens skip over.
        visible |= torch.eye(prompt_len, dtype=torch.bool, device=input_ids.device)
        # Boolean: a [B, 1, P, P] float mask would hold 4x the memory for long prompts.
        return self._forward(input_ids, position_ids, visible[:, None])

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1] at `position_ids` [B, 1]; `attention_mask` [B, cached + 1]."""
        if self.uses_attention_kernel:
            return self._forward(tokens, position_ids, attention_mask.bool())
        # Additive, made once per step: SDPA would otherwise convert a boolean mask in every layer.
        return self._forward(tokens, position_ids, self._additive(attention_mask.bool()[:, None, None, :]))
