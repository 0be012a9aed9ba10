"""The CUDA backend's decoder: decode steps through the flash-decoding kernel, replayed as CUDA graphs.

`CudaLlamaDecoder` is `FastLlamaDecoder` (engine/fast_decode.py, the torch path it must match) with:

- the fused q/k/v and gate/up weights read in place: a rollout skeleton keeps each group's rows side
  by side in one storage (`share_fused_storage`), and cuBLAS multiplies the transposed view as fast
  as a copy, so a rollout allocates no weight copy (`CudaBackend.copies_fused_weights` is False);
- decode steps that attend through `kernels.decode_attention` (the CUDA flash-decoding op over the
  decoder's [B, Hkv, S, D] cache and the padding mask) where `attention_kernel` says so: "auto" where
  that op runs (a CUDA fp16/bf16 model with a head size it is built for), True always (on the CPU
  that is the op's PyTorch reference, which is how the CPU tests check the wiring), False never (SDPA,
  the reference). `generation_kernels(False)` turns "auto" off.
- `cuda_graph`: decode steps read static buffers and replay as CUDA graphs captured at padded batch
  sizes (engine/backends/cuda/decode_graph.py), each captured once and reused as rows finish. Without
  the attention op a graph step attends with SDPA over the whole cache in the model's dtype (the
  cache is zeroed first, so its unwritten slots are finite), never upcasting the cache. True on the
  CPU runs that static step eagerly, as the tests do.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.engine.backends.cuda.decode_graph import DecodeGraphs, StaticDecodeInputs, StaticStep
from rlhf.engine.backends.cuda.kernels import decode_attention, decode_attention_kernel_unsupported_reason
from rlhf.engine.fast_decode import FastLlamaDecoder, _LayerWeights, view_transpose

__all__ = ["CudaLlamaDecoder"]


class CudaLlamaDecoder(FastLlamaDecoder):
    """FastLlamaDecoder with the CUDA backend's weights in place, decode attention and graph-replayed steps."""

    decode_attention = staticmethod(decode_attention)

    def __init__(self, model: nn.Module, batch: int, max_len: int, attention_kernel: bool | Literal["auto"] = "auto",
                 cuda_graph: bool = False) -> None:
        super().__init__(model, batch, max_len, transpose=view_transpose)
        self._attention_kernel = attention_kernel
        self.uses_attention_kernel = self._wants_attention_kernel(batch)
        # Steps over static buffers, captured as CUDA graphs; on the CPU the static step runs eagerly.
        self.wants_cuda_graph = cuda_graph
        self.graphs: DecodeGraphs | None = None
        self._new_cache_buffers()

    def _wants_attention_kernel(self, batch: int) -> bool:
        """Whether decode steps over `batch` rows go through `kernels.decode_attention`."""
        choice = self._attention_kernel
        if self.cache_dtype != self.embed.dtype:  # the kernel reads a cache of the model's dtype
            return False
        return choice is True or (
            choice == "auto" and decode_attention_kernel_unsupported_reason(
                self.embed.device, self.embed.dtype, self.head_dim, batch) is None
        )

    def _new_cache_buffers(self) -> None:
        """The cache buffers as allocated (graphs read their first rows); the unwritten tail zeroed
        for a graph step's SDPA, which reads the whole buffer."""
        self._key_buffers, self._value_buffers = list(self.keys), list(self.values)
        self.graphs = None
        if self.wants_cuda_graph:
            for buffer in (*self._key_buffers, *self._value_buffers):
                buffer.narrow(2, self.length, self.max_len - self.length).zero_()

    def expand(self, index: torch.Tensor) -> None:
        """FastLlamaDecoder.expand. Dropping finished rows keeps the cache buffers (the kept rows move to
        their front) and the graphs; any other expansion allocates new buffers, captured again."""
        buffers = [k.untyped_storage().data_ptr() for k in self.keys]
        super().expand(index)
        self.uses_attention_kernel = self._wants_attention_kernel(index.numel())
        if [k.untyped_storage().data_ptr() for k in self.keys] != buffers:
            self._new_cache_buffers()

    def _static_step(self, size: int) -> StaticStep:
        """The decode step over the first `size` rows of the cache buffers (a graph of that batch size)."""
        keys, values = [k[:size] for k in self._key_buffers], [v[:size] for v in self._value_buffers]
        return lambda inputs: self._static_decode(inputs, keys, values)

    def _static_decode(self, inputs: StaticDecodeInputs, keys: list[torch.Tensor],
                       values: list[torch.Tensor]) -> torch.Tensor:
        """One decode step reading only `inputs`' fixed buffers and the cache buffers (no host value),
        as a CUDA graph replays it: the cache slot comes from a device scalar, attention runs over the
        whole cache under the [B, max_len] key mask. -> [B, V] logits."""
        batch = inputs.tokens.shape[0]
        rope = (self.cos[inputs.positions].unsqueeze(2), self.sin_signed[inputs.positions].unsqueeze(2))
        x = F.embedding(inputs.tokens.reshape(-1), self.embed)
        for i, w in enumerate(self.layers):
            x = x + self._slot_attention(w, x, keys[i], values[i], rope, inputs, batch)
            x = x + self._mlp(w, x)
        return self.linear(self.rms_norm(x, self.norm, self.norm_eps), self.lm_head, self.lm_head_bias)

    def _slot_attention(
        self, w: _LayerWeights, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor], inputs: StaticDecodeInputs, batch: int,
    ) -> torch.Tensor:
        """_attention of one decode step whose keys and values go to cache slot `inputs.slot`."""
        heads, head_dim = self.num_heads, self.head_dim
        qk, new_keys, new_values = self._rotated_qkv(w, x, rope, batch, 1)
        keys.index_copy_(2, inputs.slot, new_keys)
        values.index_copy_(2, inputs.slot, new_values)
        q = qk[:, -1].narrow(1, 0, heads)
        if self.uses_attention_kernel:
            out = self.decode_attention(q, keys, values, inputs.key_mask, scale=self.scaling)
        else:
            out = self._whole_cache_sdpa(q, keys, values, inputs.key_mask)
        return self.linear(out.reshape(batch, heads * head_dim), w.wo, w.bo)

    def _whole_cache_sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          key_mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] over the whole cache [B, Hkv, S, D] under key_mask [B, S], by SDPA in the
        cache's dtype: each KV group's query heads as that head's query rows (no repeated keys)."""
        batch, kv_heads = q.shape[0], self.num_kv_heads
        grouped = q.reshape(batch, kv_heads, self.num_heads // kv_heads, self.head_dim)
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask[:, None, None, :],
                                              scale=self.scaling)

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1] at `position_ids` [B, 1]; `attention_mask` [B, cached + 1]."""
        if not self.wants_cuda_graph:
            return super().decode(tokens, attention_mask, position_ids)
        self._check_room(1)
        if self.graphs is None:
            self.graphs = DecodeGraphs(self._static_step, self._key_buffers[0].shape[0], self.max_len, tokens.device)
        logits = self.graphs.step(tokens, attention_mask, position_ids, self.length)
        self.length += 1
        return logits
