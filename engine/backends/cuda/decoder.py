"""The CUDA backend's decoder: decode steps through the flash-decoding kernel, replayed as CUDA graphs.

`CudaLlamaDecoder` is `FastLlamaDecoder` (engine/fast_decode.py, the torch path it must match) with:

- decode steps that attend through `kernels.decode_attention` (the CUDA flash-decoding op over the
  decoder's [B, Hkv, S, D] cache and the padding mask) where `attention_kernel` says so: "auto" where
  that op runs (a CUDA fp16/bf16 model with a head size it is built for), True always (on the CPU
  that is the op's PyTorch reference, which is how the CPU tests check the wiring), False never (SDPA,
  the reference). `generation_kernels(False)` turns "auto" off.
- `cuda_graph`: decode steps read static buffers and replay as one CUDA graph per batch size
  (engine/backends/cuda/decode_graph.py; "auto" = on CUDA with --cuda-graph-decode while the graphs are
  opt-in; True on the CPU runs that static step eagerly, as the tests do).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.engine.backends.cuda.decode_graph import DecodeGraph, StaticDecodeInputs
from rlhf.engine.backends.cuda.kernels import decode_attention, decode_attention_kernel_unsupported_reason
from rlhf.engine.fast_decode import FastLlamaDecoder, _LayerWeights

__all__ = ["CudaLlamaDecoder"]


class CudaLlamaDecoder(FastLlamaDecoder):
    """FastLlamaDecoder with the CUDA backend's decode attention and graph-replayed steps."""

    decode_attention = staticmethod(decode_attention)

    def __init__(self, model: nn.Module, batch: int, max_len: int, attention_kernel: bool | Literal["auto"] = "auto",
                 cuda_graph: bool = False) -> None:
        super().__init__(model, batch, max_len)
        self._attention_kernel = attention_kernel
        self.uses_attention_kernel = self._wants_attention_kernel(batch)
        # Steps over static buffers, captured as a CUDA graph; on the CPU the static step runs eagerly.
        self.wants_cuda_graph = cuda_graph
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
        """FastLlamaDecoder.expand; a new batch size over new cache buffers is captured again on the next step."""
        self._graph = None
        super().expand(index)
        self.uses_attention_kernel = self._wants_attention_kernel(index.numel())

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
        out = self.decode_attention(q, keys, values, inputs.key_mask, scale=self.scaling)
        return self.linear(out.reshape(batch, heads * head_dim), w.wo, w.bo)

    def decode(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1] at `position_ids` [B, 1]; `attention_mask` [B, cached + 1]."""
        if not self.wants_cuda_graph:
            return super().decode(tokens, attention_mask, position_ids)
        self._check_room(1)
        if self._graph is None:
            self._graph = DecodeGraph(self._static_decode, tokens.shape[0], self.max_len, tokens.device)
        logits = self._graph.step(tokens, attention_mask, position_ids, self.length)
        self.length += 1
        return logits
