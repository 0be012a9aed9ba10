"""A fast prefill/decode path for Llama-style models (Llama, Qwen2, Mistral without sliding window).

For a small model, a decode step through Hugging Face's forward is largely Python and op
dispatch: keyword plumbing, output dataclasses, the cache object, mask construction, seven
projections per layer (on the benchmark's 4-layer CPU model about 2.2 ms of overhead per step,
against 0.9 ms here). In the manner of gpt-fast, `FastLlamaDecoder` runs the same math as plain
functions over tensors it reads from the HF module (the module and its forward are untouched):

- per generate() call the weights are gathered once: q/k/v concatenated into one projection
  (with Qwen2's biases), gate/up into another, so a layer is 4 matmuls instead of 7; the two
  are stored transposed, [in, out] row-major: at a decode step's few rows MKL multiplies that
  layout ~1.4x faster than a [out, in] weight it must repack on every call;
- RoPE cos/sin come from the model's own rotary embedding module, tabulated once for every
  position of the rollout (so rope_scaling types such as linear, llama3 or yarn are honoured),
  and are applied to queries and keys together;
- keys and values go to a preallocated [batch, kv_heads, prompt + max_new_tokens, head_dim]
  buffer per layer; a step attends to the filled prefix with `scaled_dot_product_attention`
  under the padding mask. A decode step packs the query heads of each KV group into the query
  axis (GQA without repeating keys, as transformers' own `pack_gqa` does); for group sampling
  `expand` copies each prefilled prompt's rows of the cache to its samples' rows;
- the final norm and lm_head run only on the last position;
- a model whose layers run the fused layer ops (`fuse_layer_ops`, the engine's --fused-layers;
  float32 on a CPU) prefills through them as well: RMSNorm, RoPE, SwiGLU and the attention
  kernel under the prompt's boolean mask (decode steps run the fused CPU decode op).

Numerics follow the HF modules op for op (RMSNorm upcasts to float32 and casts back before the
weight, RoPE in the model dtype), so greedy tokens match the reference path; the HF forward
stays the reference (tests/test_fast_decode.py). `fast_decode_unsupported_reason(model)` says
why a model must take the reference path: another family, sliding-window layers, a rope type
that rescales with sequence length, DTensor (tensor-parallel or FSDP) parameters, modules
replaced by adapters or quantized layers, hooks on the model, or training mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from rlhf.engine import decode_groups, fused_layers
from rlhf.engine.cpu_decode import cpu_decode_unsupported_reason, load_cpu_decode_op
from rlhf.engine.cpu_matmul import is_plain_linear, uses_onednn_linears
from rlhf.engine.cpu_matmul import linear as onednn_linear
from rlhf.engine.cpu_matmul import swiglu_in_epilogue
from rlhf.engine.decode_graph import DecodeGraph, StaticDecodeInputs, cuda_graph_decode_requested
from rlhf.engine.fused_layers import rms_norm_reference as rms_norm  # LlamaRMSNorm's ops exactly
from rlhf.engine.kernels import decode_attention, decode_attention_kernel_unsupported_reason, generation_kernels_enabled
from rlhf.engine.layer_op import transposed
from rlhf.engine.sampling import KVCacheDtype
from rlhf.logging import get_logger

__all__ = ["FastLlamaDecoder", "fast_decode_unsupported_reason", "kv_cache_torch_dtype", "rms_norm", "apply_rope",
           "signed_sin"]

log = get_logger(__name__)
_logged_cache_notes: set[str] = set()  # kv_cache_torch_dtype's notes, each logged once

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
# Rope types whose frequencies depend on the sequence length seen so far (HF's dynamic_rope_update):
# a position table computed once would not reproduce them, so such models take the reference path.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


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


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    return getattr(inner, "layers", None) if inner is not None else None


def fast_decode_unsupported_reason(model: nn.Module) -> str | None:
    """Why `FastLlamaDecoder` cannot run `model` faithfully, or None when it can."""
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
    if not all(is_plain_linear(m) for m in linears):
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


def _fused_t(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights of several projections of one input side by side, transposed: [in, sum(out)]
    contiguous, and their biases concatenated. The weights' rows are concatenated, then transposed
    (engine/layer_op.py's register-tiled transpose on the CPU): the same floats as concatenating
    their transposed views, which torch copies a float at a time (SmolLM2-135M's gate and up,
    2 x [1536, 576]: 0.53 -> 0.28 ms; the tiny Llama's q, k and v: 0.087 -> 0.031 ms)."""
    weight = transposed(torch.cat([m.weight.detach() for m in linears]))
    if all(m.bias is None for m in linears):
        return weight, None
    biases = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
    return weight, torch.cat(biases)


def _linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight_t [in, out] (+ bias): F.linear with the weight stored transposed."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _layer_weights(layer: nn.Module) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    wqkv_t, bqkv = _fused_t(attn.q_proj, attn.k_proj, attn.v_proj)
    w_gate_up_t, b_gate_up = _fused_t(mlp.gate_proj, mlp.up_proj)
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


def kv_cache_halved(choice: KVCacheDtype, model_dtype: torch.dtype, device: torch.device,
                    model_type: str | None = None) -> bool:
    """Whether the fast decoder keeps a float16 cache for SamplingParams.kv_cache_dtype `choice`
    ("auto" or "fp16": a float32 model on the CPU); with `model_type` (a config's), also whether
    the fast decoder runs that family at all (the Hugging Face forward keeps the model's dtype)."""
    family = model_type is None or model_type in SUPPORTED_MODEL_TYPES
    return choice != "model" and model_dtype == torch.float32 and device.type == "cpu" and family


def kv_cache_torch_dtype(choice: KVCacheDtype, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The fast decoder's cache dtype for SamplingParams.kv_cache_dtype: "fp16" halves a float32
    model's cache on the CPU (the fused step's kernels widen it as they read); elsewhere (a 16-bit
    model, a GPU) the cache stays in the model's dtype, which is logged once. "model": the model's
    dtype; "auto": fp16 where it applies (as llama.cpp keeps its cache), silently the model's
    dtype elsewhere."""
    if kv_cache_halved(choice, model_dtype, device):
        return torch.float16
    if choice != "fp16":
        return model_dtype
    reason = f"kv_cache_dtype fp16 applies to float32 models on the CPU; this one is {model_dtype} on {device.type}"
    if reason not in _logged_cache_notes:
        _logged_cache_notes.add(reason)
        log.info("fast decoder: %s, so its KV cache stays in the model's dtype", reason)
    return model_dtype


class FastLlamaDecoder:
    """Prefill and decode steps of one rollout of `batch` sequences up to `max_len` tokens.

    Built per generate() call: it gathers the weights (q/k/v and gate/up fused), tabulates
    RoPE for positions [0, max_len) and allocates the KV cache. `prefill` then `decode` mirror
    `generation.prefill` / `generation.decode_step` and return [batch, vocab] logits.

    Decode steps run the fused CPU op (engine/cpu_decode.py) where it can run this model:
    `cpu_kernel` "auto" uses it when it is supported and builds, True insists (ValueError
    naming the reason otherwise), False keeps the Python step (the reference). `kernel_isa`
    says which kernels the op uses ("avx512", "avx2", "scalar"; None: the Python step). `packed_gemm`:
    the op's projections run over weights packed once per rollout (16-column panels) instead of
    MKL, which repacks each weight on every step; "auto" where the model's linears left MKL for
    oneDNN (--cpu-matmul: auto on AMD CPUs, where MKL runs AVX2 kernels and repacking is ~40% of
    its decode time). `packed_gemm` (the attribute) says whether the step runs them.

    The Python decode step attends through `kernels.decode_attention` (the CUDA flash-decoding
    op over this decoder's [B, Hkv, S, D] cache and the padding mask) where `attention_kernel`
    says so: "auto" where that op runs (a CUDA fp16/bf16 model with a head size it is built for),
    True always (on the CPU that is the op's PyTorch reference, which is how the CPU tests check
    the wiring), False never (SDPA, the reference). `uses_attention_kernel` says which.
    `kernels.generation_kernels(False)` turns both "auto" kernels off.

    `cuda_graph`: decode steps read static buffers and replay as one CUDA graph per batch size
    (engine/decode_graph.py; "auto" = on CUDA with RLHF_CUDA_GRAPH_DECODE=1 while the graphs are
    opt-in; True on the CPU runs that static step eagerly, as the tests do).

    `kv_cache_dtype` "fp16" or "auto" (kv_cache_torch_dtype: a float32 model on the CPU) keeps the
    cache in float16: every write rounds, the fused step's kernels widen what they read, and the
    Python step attends over the cache widened back, so both compute the same rounded-cache model.
    `cache_dtype` says which dtype the cache holds.
    """

    def __init__(
        self, model: nn.Module, batch: int, max_len: int,
        cpu_kernel: bool | Literal["auto"] = "auto", kernel_isa: str = "auto",
        attention_kernel: bool | Literal["auto"] = "auto", packed_gemm: bool | Literal["auto"] = "auto",
        cuda_graph: bool | Literal["auto"] = "auto", kv_cache_dtype: KVCacheDtype = "model",
    ) -> None:
        reason = fast_decode_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastLlamaDecoder cannot run this model: {reason}")
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
        self.layers = [_layer_weights(layer) for layer in layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        lm_head = model.get_output_embeddings()
        self.lm_head, self.lm_head_bias = lm_head.weight.detach(), _bias(lm_head)

        dtype, device = self.embed.dtype, self.embed.device
        # torch's fused-in-C++ rms_norm runs LlamaRMSNorm's exact float32 ops; in lower
        # precision HF rounds to the model dtype before the weight, which only rms_norm() copies.
        self.rms_norm = _rms_norm_fp32 if dtype == torch.float32 else rms_norm
        # The model's own rotary module, asked once for every position the rollout can reach.
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = inner.rotary_emb(torch.empty(0, dtype=dtype, device=device), positions)
        self.cos, self.sin, self.sin_signed = cos[0], sin[0], signed_sin(sin[0])  # [max_len, head_dim]
        # A model whose layers run the fused layer ops (--fused-layers) prefills through them too.
        self.fused_prefill = fused_layers.uses_fused_layers(model) and dtype == torch.float32 and device.type == "cpu"
        # A model whose linears run oneDNN (--cpu-matmul) runs its prefill's through it too (a decode
        # step's few rows stay on torch's matmul: engine/cpu_matmul.py).
        onednn = uses_onednn_linears(model)
        self.linear = onednn_linear if onednn else F.linear
        # The fused step's projections over weights packed once per rollout, not MKL (which repacks
        # them every step): "auto" where the model's linears left MKL for oneDNN (engine/cpu_matmul.py).
        self.wants_packed_gemm = packed_gemm is True or (packed_gemm == "auto" and onednn)
        self._packed: list[torch.Tensor] | None = None  # packed on first use, shared by rebuilt steps

        # Left uninitialised: a step reads only the prefix that earlier steps have written.
        shape = (batch, self.num_kv_heads, max_len, self.head_dim)
        self.cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype, device)
        self.keys = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in self.layers]
        self.length = 0  # tokens written so far (a host int: no step reads a device value)
        self.max_len = max_len
        self._kernel_step = self._build_kernel_step(cpu_kernel, kernel_isa) if cpu_kernel is not False else None
        self.kernel_isa: str | None = None if self._kernel_step is None else self._kernel_step.isa
        self.packed_gemm = self._kernel_step is not None and self._kernel_step.packed
        self._attention_kernel = attention_kernel
        self.uses_attention_kernel = self._wants_attention_kernel(batch)
        # Steps over static buffers, captured as a CUDA graph (engine/decode_graph.py); opt-in
        # until validated on a GPU. On the CPU (cuda_graph=True) the static step runs eagerly.
        self.wants_cuda_graph = self._kernel_step is None and (
            cuda_graph is True or (cuda_graph == "auto" and device.type == "cuda" and cuda_graph_decode_requested()))
        self._graph: DecodeGraph | None = None

    def _wants_attention_kernel(self, batch: int) -> bool:
        """Whether decode steps over `batch` rows go through `kernels.decode_attention`."""
        choice = self._attention_kernel
        if self.cache_dtype != self.embed.dtype:  # the kernel reads a cache of the model's dtype
            return False
        return choice is True or (
            choice == "auto" and decode_attention_kernel_unsupported_reason(
                self.embed.device, self.embed.dtype, self.head_dim, batch) is None
        )

    def expand(self, index: torch.Tensor) -> None:
        """Rows `index` of the cache become its rows (group sampling: each prompt prefilled once,
        its keys and values copied to each of its samples' rows; `index` in repeat_interleave order).

        Only the filled prefix is copied, layer by layer, so the old cache of the unique prompts
        is released as the new one fills. Dropping finished rows (`index` increasing) moves the kept
        rows' filled prefixes to the front of the cache in place: no fresh buffers to fault in.
        The fused CPU step holds the cache and the batch size: it is rebuilt over the new buffers
        (it shares the weights, so that costs no copy).
        """
        kernel_isa, self._kernel_step = self.kernel_isa, None  # drop its references to the old cache
        self._graph = None  # a new batch size over new cache buffers: captured again on the next step
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
        if kernel_isa is not None:
            self._kernel_step = self._build_kernel_step(True, kernel_isa)
        self.uses_attention_kernel = self._wants_attention_kernel(index.numel())

    def rows_per_group(self, batch: int, requested: int | None = None) -> int:
        """Rows of this decoder's `batch` each group of a grouped decode runs (engine/decode_groups.py):
        `requested` where given; else, where the fused CPU step runs its packed GEMM, decode_groups'
        choice for this machine's last-level cache (the packed weights plus the rows' caches at the
        rollout's mean length); else every row (one group). The packed GEMM computes a row the same
        way whatever rows share its step, so its groups give the same bits; MKL's kernels change with
        the row count, so their groups would change the last bits of the logits."""
        if requested is not None:  # SamplingParams checked it is >= 1
            return min(requested, batch)
        if not self.packed_gemm:
            return batch
        weights = sum(t.numel() * t.element_size() for t in self._packed or [])
        position_bytes = 2 * len(self.keys) * self.num_kv_heads * self.head_dim * self.keys[0].element_size()
        mean_len = (self.length + self.max_len) / 2
        return decode_groups.rows_per_group(batch, weights, int(position_bytes * mean_len),
                                            decode_groups.last_level_cache_bytes())

    def row_group(self, start: int, stop: int) -> FastLlamaDecoder:
        """A decoder over rows [start, stop) of this one's KV cache (views: nothing is copied) at its
        length, sharing its weights, RoPE tables and packed panels; its steps and `expand` touch
        only those rows. Grouped decoding (generation.py) runs each group to its end in turn."""
        group = copy.copy(self)
        group.keys = [k[start:stop] for k in self.keys]
        group.values = [v[start:stop] for v in self.values]
        group._graph = None
        if self.kernel_isa is not None:
            group._kernel_step = group._build_kernel_step(True, self.kernel_isa)
        group.uses_attention_kernel = self._wants_attention_kernel(stop - start)
        return group

    def _build_kernel_step(self, cpu_kernel: bool | Literal["auto"], isa: str) -> Any:
        """The fused CPU decode step over this decoder's weights, tables and cache, or None."""
        reason = cpu_decode_unsupported_reason(self.embed.device, self.embed.dtype, self.act)
        if reason is None and cpu_kernel == "auto" and not generation_kernels_enabled():
            reason = "generation kernels are turned off (generation_kernels(False))"
        module = load_cpu_decode_op() if reason is None else None
        if reason is None and module is None:
            reason = "the rlhf_cpu_decode op could not be built (see the warning above)"
        if reason is not None:
            if cpu_kernel is True:
                raise ValueError(f"FastLlamaDecoder(cpu_kernel=True): {reason}")
            return None
        return self.kernel_step_from(module, isa)

    def use_kernel_step(self, module: ModuleType, isa: str, packed_gemm: bool = False) -> None:
        """Decode steps from now on run `module`'s fused step (an `rlhf_cpu_decode` build) with
        kernels `isa` (and packed weights with `packed_gemm`): how the op's load-time self-test
        (engine/op_selftests.py) runs the build it checks before the loader hands that build to anyone."""
        self.wants_packed_gemm = packed_gemm
        self._kernel_step = self.kernel_step_from(module, isa)
        self.kernel_isa, self.packed_gemm = self._kernel_step.isa, self._kernel_step.packed

    def kernel_step_from(self, module: ModuleType, isa: str) -> Any:
        """`module`'s fused decode step over this decoder's weights, RoPE tables and KV cache."""
        none = self.embed.new_empty(0)  # the op's "no bias"
        tensors, eps = [], []
        for w in self.layers:
            tensors += [w.input_norm, w.wqkv_t, w.bqkv, w.wo, w.bo, w.post_norm, w.w_gate_up_t, w.b_gate_up, w.w_down,
                        w.b_down]
            eps += [w.input_eps, w.post_eps]
        return module.LlamaDecodeStep(
            self.embed.contiguous(), [none if t is None else t.contiguous() for t in tensors], eps,
            self.norm.contiguous(), self.norm_eps, self.lm_head.contiguous(),
            none if self.lm_head_bias is None else self.lm_head_bias.contiguous(),
            self.cos.contiguous(), self.sin_signed.contiguous(), self.keys, self.values,
            self.num_heads, self.num_kv_heads, self.scaling, isa,
            self._packed_weights(module) if self.wants_packed_gemm else [],
        )

    def _packed_weights(self, module: ModuleType) -> list[torch.Tensor]:
        """Every projection's [in, out] weight packed for the fused step (per layer q/k/v, o, gate,
        up, down, then the LM head): packed once, shared by the steps `expand` rebuilds."""
        if self._packed is None:
            weights = []
            for w in self.layers:
                ffn = w.w_gate_up_t.shape[1] // 2
                weights += [w.wqkv_t, w.wo.t(), w.w_gate_up_t[:, :ffn], w.w_gate_up_t[:, ffn:], w.w_down.t()]
            self._packed = [module.pack_panels(t) for t in [*weights, self.lm_head.t()]]
        return self._packed

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
            out = decode_attention(q, keys, values, mask, scale=self.scaling).reshape(batch, heads * head_dim)
        elif steps == 1 or last_only:
            # One query per sequence: the `groups` query heads sharing a KV head become that
            # head's query rows (transformers' pack_gqa), so each cached key is read once.
            q = qk[:, -1].narrow(1, 0, heads).reshape(batch, kv_heads, groups, head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.narrow(2, -1, 1), scale=self.scaling)
            out = out.reshape(batch, heads * head_dim)  # CUDA's kernels may return it strided
        else:
            q = qk.narrow(2, 0, heads).transpose(1, 2)
            # CPU SDPA shares KV heads itself (faster than repeating them); CUDA's kernels fall
            # back to the math one for GQA under a mask, so there the heads are repeated.
            gqa = groups > 1 and q.device.type == "cpu"
            if groups > 1 and not gqa:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
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

    def _fused_attention(
        self, w: _LayerWeights, x: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor, batch: int, steps: int, last_only: bool,
    ) -> torch.Tensor:
        """_attention of a prefill through the fused layer ops (engine/fused_layers.py): RoPE (cos,
        sin [B, T, D]) writes the heads' layout, the attention kernel takes the boolean mask."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        h = fused_layers.rms_norm(x, w.input_norm, w.input_eps)
        qkv = self._linear_t(h, w.wqkv_t, w.bqkv).view(batch, steps, -1)
        cos, sin = rope
        q = fused_layers.rope(qkv.narrow(2, 0, heads * head_dim), cos, sin, heads)
        k = fused_layers.rope(qkv.narrow(2, heads * head_dim, kv_heads * head_dim), cos, sin, kv_heads)
        v = qkv.narrow(2, (heads + kv_heads) * head_dim, kv_heads * head_dim).view(batch, steps, kv_heads, head_dim)
        v = v.transpose(1, 2)  # the kernels read it through its strides
        self.keys[layer].narrow(2, self.length, steps).copy_(k)
        self.values[layer].narrow(2, self.length, steps).copy_(v)
        if self.cache_dtype != k.dtype:  # attend over the keys and values as the cache holds them
            k = self._cached(self.keys[layer].narrow(2, self.length, steps))
            v = self._cached(self.values[layer].narrow(2, self.length, steps))
        out = fused_layers.attention(q, k, v, mask, self.scaling)  # [B, T, H, D]
        out = out[:, -1] if last_only else out
        return self.linear(out.reshape(-1, heads * head_dim), w.wo, w.bo)

    def _cached(self, t: torch.Tensor) -> torch.Tensor:
        """Cached keys or values in the model's dtype (a 16-bit cache of a float32 model widened)."""
        return t if t.dtype == self.embed.dtype else t.to(self.embed.dtype)

    def _linear_t(self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight_t (+ bias) as `_linear_t`, through oneDNN where this decoder's linears take it."""
        return _linear_t(x, weight_t, bias) if self.linear is F.linear else self.linear(x, weight_t.t(), bias)

    def _mlp(self, w: _LayerWeights, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and self.act is F.silu:
            h = fused_layers.rms_norm(x, w.post_norm, w.post_eps)
            ffn = w.w_down.shape[1]
            bias = (None, None) if w.b_gate_up is None else (w.b_gate_up[:ffn], w.b_gate_up[ffn:])
            # Where the linears run oneDNN, SiLU(gate) in the gate product's epilogue, times up in place;
            # else the two products into their own tensors, which the fused SwiGLU reads whole.
            hidden = None
            if self.linear is onednn_linear:
                hidden = swiglu_in_epilogue(h, w.w_gate, bias[0], w.w_up, bias[1])
            if hidden is None:
                hidden = fused_layers.swiglu(self.linear(h, w.w_gate, bias[0]), self.linear(h, w.w_up, bias[1]))
            return self.linear(hidden, w.w_down, w.b_down)
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
        # Prefill through the fused layer ops where the model runs them (a boolean [B, 1, T, T] mask).
        fused = self.fused_prefill and self.length == 0 and steps > 1 and mask.dtype == torch.bool and mask.dim() == 4
        if fused:
            rope = (self.cos[position_ids], self.sin[position_ids])
        else:
            rope = (self.cos[position_ids].unsqueeze(2), self.sin_signed[position_ids].unsqueeze(2))
        x = F.embedding(tokens.reshape(-1), self.embed)  # [B*T, hidden]
        last_layer = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            last_only = i == last_layer and steps > 1
            attention = self._fused_attention if fused else self._attention
            attn = attention(w, x, i, rope, mask, batch, steps, last_only)
            if last_only:
                x = x.view(batch, steps, -1)[:, -1]
            x = x + attn
            x = x + self._mlp(w, x, fused)
        self.length += steps
        return self.linear(self.rms_norm(x, self.norm, self.norm_eps), self.lm_head, self.lm_head_bias)

    def _static_decode(self, inputs: StaticDecodeInputs) -> torch.Tensor:
        """One decode step reading only `inputs`' fixed buffers (no host value), as a CUDA graph
        replays it: the cache slot comes from a device scalar, attention runs over the whole cache
        under the [B, max_len] key mask. -> [B, V] logits."""
        batch = inputs.tokens.shape[0]
        rope = (self.cos[inputs.positions].unsqueeze(2), self.sin_signed[inputs.positions].unsqueeze(2))
        x = F.embedding(inputs.tokens.reshape(-1), self.embed)
        for i, w in enumerate(self.layers):
            x = x + self._slot_attention(w, x, i, rope, inputs, batch)
            x = x + self._mlp(w, x)
        return self.linear(self.rms_norm(x, self.norm, self.norm_eps), self.lm_head, self.lm_head_bias)

    def _slot_attention(
        self, w: _LayerWeights, x: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StaticDecodeInputs, batch: int,
    ) -> torch.Tensor:
        """_attention of one decode step whose keys and values go to cache slot `inputs.slot`."""
        heads, head_dim = self.num_heads, self.head_dim
        qk, new_keys, new_values = self._rotated_qkv(w, x, rope, batch, 1)
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, inputs.slot, new_keys)
        values.index_copy_(2, inputs.slot, new_values)
        q = qk[:, -1].narrow(1, 0, heads)
        out = decode_attention(q, keys, values, inputs.key_mask, scale=self.scaling)
        return self.linear(out.reshape(batch, heads * head_dim), w.wo, w.bo)

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
        if self._kernel_step is not None:
            logits = self._kernel_step.step(tokens, position_ids, attention_mask, self.length)
            self.length += 1
            return logits
        if self.wants_cuda_graph:
            self._check_room(1)
            if self._graph is None:
                self._graph = DecodeGraph(self._static_decode, tokens.shape[0], self.max_len, tokens.device)
            logits = self._graph.step(tokens, attention_mask, position_ids, self.length)
            self.length += 1
            return logits
        if self.uses_attention_kernel:
            return self._forward(tokens, position_ids, attention_mask.bool())
        # Additive, made once per step: SDPA would otherwise convert a boolean mask in every layer.
        return self._forward(tokens, position_ids, self._additive(attention_mask.bool()[:, None, None, :]))
