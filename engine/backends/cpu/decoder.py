"""The CPU backend's decoder: the fused float32 decode step, packed weights, fused prefill, row groups.

`CpuLlamaDecoder` is `FastLlamaDecoder` (engine/fast_decode.py, the torch path it must match) with
what makes a decode step fast on a CPU:

- decode steps run the fused CPU op (engine/backends/cpu/decode_op.py) where it can run the model:
  `cpu_kernel` "auto" uses it when it is supported and builds, True insists (ValueError naming
  the reason otherwise), False keeps the Python step (the reference). `kernel_isa` says which
  kernels the op uses ("avx512", "avx2", "scalar"; None: the Python step). `packed_gemm`: the op's
  projections run over weights packed once per rollout (16-column panels) instead of MKL, which
  repacks each weight on every step; "auto" where the model's linears left MKL for oneDNN
  (--cpu-matmul: auto on AMD CPUs, where MKL runs AVX2 kernels and repacking is ~40% of its decode
  time). `packed_gemm` (the attribute) says whether the step runs them.
- a model whose layers run the fused layer ops (engine/backends/cpu/fused_layers.py, float32)
  prefills through them as well: RMSNorm, RoPE, SwiGLU and the attention kernel under the prompt's
  boolean mask; its linears, where they run oneDNN, run the prefill's projections through it.
- `kv_cache_dtype` "fp16" or "auto" (a float32 model) keeps the cache in float16: every write
  rounds, the fused step's kernels widen what they read, and the Python step attends over the
  cache widened back, so both compute the same rounded-cache model.
- the rows decode in groups, each group to its end, where the packed weights and one group's KV
  cache fit the last-level cache and all rows' do not (engine/backends/cpu/row_groups.py): the same
  draws in the same order, so the same tokens.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.engine.backends.base import generation_kernels_enabled
from rlhf.engine.backends.cpu import fused_layers, row_groups
from rlhf.engine.backends.cpu.decode_op import cpu_decode_unsupported_reason, load_cpu_decode_op
from rlhf.engine.backends.cpu.layer_op import transposed
from rlhf.engine.backends.cpu.matmul import linear as onednn_linear
from rlhf.engine.backends.cpu.matmul import swiglu_in_epilogue, uses_onednn_linears
from rlhf.engine.fast_decode import SUPPORTED_MODEL_TYPES, FastLlamaDecoder, _LayerWeights
from rlhf.engine.decode_loop import DecodeLoop
from rlhf.engine.sampling import KVCacheDtype
from rlhf.logging import get_logger

__all__ = ["CpuLlamaDecoder", "kv_cache_halved", "kv_cache_torch_dtype"]

log = get_logger(__name__)
_logged_cache_notes: set[str] = set()  # kv_cache_torch_dtype's notes, each logged once


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


class CpuLlamaDecoder(FastLlamaDecoder):
    """FastLlamaDecoder with the CPU's fast paths (see the module docstring); `rows_per_group`: the
    rows each decode group runs (None: chosen from the last-level cache where the packed GEMM runs)."""

    def __init__(
        self, model: nn.Module, batch: int, max_len: int, *,
        cpu_kernel: bool | Literal["auto"] = "auto", kernel_isa: str = "auto",
        packed_gemm: bool | Literal["auto"] = "auto", kv_cache_dtype: KVCacheDtype = "model",
        rows_per_group: int | None = None, attention_kernel: bool = False,
    ) -> None:
        param = next(model.parameters())
        # A model whose linears run oneDNN (--cpu-matmul) runs its prefill's through it too (a decode
        # step's few rows stay on torch's matmul: engine/backends/cpu/matmul.py).
        onednn = uses_onednn_linears(model)
        super().__init__(model, batch, max_len, linear=onednn_linear if onednn else F.linear, transpose=transposed,
                         cache_dtype=kv_cache_torch_dtype(kv_cache_dtype, param.dtype, param.device),
                         attention_kernel=attention_kernel)
        dtype, device = self.embed.dtype, self.embed.device
        # A model whose layers run the fused layer ops (--cpu-fused-layers) prefills through them too.
        self.fused_prefill = fused_layers.uses_fused_layers(model) and dtype == torch.float32 and device.type == "cpu"
        # The fused step's projections over weights packed once per rollout, not MKL (which repacks
        # them every step): "auto" where the model's linears left MKL for oneDNN.
        self.wants_packed_gemm = packed_gemm is True or (packed_gemm == "auto" and onednn)
        self._packed: list[torch.Tensor] | None = None  # packed on first use, shared by rebuilt steps
        self.requested_rows_per_group = rows_per_group
        self._kernel_step = self._build_kernel_step(cpu_kernel, kernel_isa) if cpu_kernel is not False else None
        self.kernel_isa: str | None = None if self._kernel_step is None else self._kernel_step.isa
        self.packed_gemm = self._kernel_step is not None and self._kernel_step.packed

    def expand(self, index: torch.Tensor) -> None:
        """FastLlamaDecoder.expand; the fused step holds the cache and the batch size, so it is rebuilt
        over the new buffers (it shares the weights: that costs no copy)."""
        kernel_isa, self._kernel_step = self.kernel_isa, None  # drop its references to the old cache
        super().expand(index)
        if kernel_isa is not None:
            self._kernel_step = self._build_kernel_step(True, kernel_isa)

    def rows_per_group(self, batch: int) -> int:
        """Rows of this decoder's `batch` each group of a grouped decode runs (engine/backends/cpu/row_groups.py):
        `requested_rows_per_group` where given; else, where the fused CPU step runs its packed GEMM, decode_groups'
        choice for this machine's last-level cache (the packed weights plus the rows' caches at the
        rollout's mean length); else every row (one group). The packed GEMM computes a row the same
        way whatever rows share its step, so its groups give the same bits; MKL's kernels change with
        the row count, so their groups would change the last bits of the logits."""
        requested = self.requested_rows_per_group
        if requested is not None:  # the config checked it is >= 1
            return min(requested, batch)
        if not self.packed_gemm:
            return batch
        weights = sum(t.numel() * t.element_size() for t in self._packed or [])
        position_bytes = 2 * len(self.keys) * self.num_kv_heads * self.head_dim * self.keys[0].element_size()
        mean_len = (self.length + self.max_len) / 2
        return row_groups.rows_per_group(batch, weights, int(position_bytes * mean_len),
                                            row_groups.last_level_cache_bytes())

    def row_group(self, start: int, stop: int) -> CpuLlamaDecoder:
        """A decoder over rows [start, stop) of this one's KV cache (views: nothing is copied) at its
        length, sharing its weights, RoPE tables and packed panels; its steps and `expand` touch
        only those rows. Grouped decoding (generation.py) runs each group to its end in turn."""
        group = copy.copy(self)
        group.keys = [k[start:stop] for k in self.keys]
        group.values = [v[start:stop] for v in self.values]
        if self.kernel_isa is not None:
            group._kernel_step = group._build_kernel_step(True, self.kernel_isa)
        return group

    def run(self, loop: DecodeLoop) -> int:
        """The decode loop over every row together, or in groups of `rows_per_group` rows each decoded
        to its end (row_groups.decode_in_groups: the same draws, so the same tokens)."""
        batch = loop.batch
        rows = self.rows_per_group(batch)
        if rows >= batch:
            return loop.run_all(self)
        return row_groups.decode_in_groups(self, loop, rows)

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
                raise ValueError(f"CpuLlamaDecoder(cpu_kernel=True): {reason}")
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

    def _prefills_fused(self, steps: int, mask: torch.Tensor) -> bool:
        """A prefill through the fused layer ops where the model runs them (a boolean [B, 1, T, T] mask)."""
        return self.fused_prefill and self.length == 0 and steps > 1 and mask.dtype == torch.bool and mask.dim() == 4

    def _mlp(self, w: _LayerWeights, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if not (fused and self.act is F.silu):
            return super()._mlp(w, x)
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

    def _prefill_attention(
        self, w: _LayerWeights, x: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor, batch: int, steps: int, last_only: bool,
    ) -> torch.Tensor:
        """_attention of a prefill through the fused layer ops (engine/backends/cpu/fused_layers.py): RoPE (cos,
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

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1] at `position_ids` [B, 1]; `attention_mask` [B, cached + 1]."""
        if self._kernel_step is None:
            return super().decode(tokens, attention_mask, position_ids)
        logits = self._kernel_step.step(tokens, position_ids, attention_mask, self.length)
        self.length += 1
        return logits
