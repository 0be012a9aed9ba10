"""The CUDA backend: the generation kernels' wiring and graph-replayed decode steps.

Behind `Backend`'s interface (engine/backends/base.py), tuned by the `cuda:` config section (`CudaConfig`):

    kernels.py       decode attention, sampling and selective log-softmax through csrc/generation's ops
    decoder.py       `CudaLlamaDecoder`: the fast decoder's steps through them, replayed as CUDA graphs
    decode_graph.py  the static buffers, and the decode graphs captured once per padded batch size
    selftests.py     the load-time self-tests of its ops
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf.engine.backends.base import Backend, Sampler
from rlhf.engine.backends.tuning import CudaConfig
from rlhf.engine.backends.cuda.decode_graph import cuda_graph_decode_requested
from rlhf.engine.backends.cuda.decoder import CudaLlamaDecoder
from rlhf.engine.backends.cuda.kernels import (DECODE_ATTENTION_OP, SAMPLING_OP, SELECTIVE_LOG_SOFTMAX_OP,
                                               fused_selective_log_softmax_forward, sample_tokens)
from rlhf.engine.backends.cuda.selftests import (decode_attention_self_test, sampling_self_test,
                                                 selective_log_softmax_self_test)
from rlhf.engine.ops import register_self_test
from rlhf.engine.sampling import KVCacheDtype, SamplingParams
from rlhf.logging import get_logger

log = get_logger(__name__)

register_self_test(DECODE_ATTENTION_OP.name, decode_attention_self_test)
register_self_test(SAMPLING_OP.name, sampling_self_test)
register_self_test(SELECTIVE_LOG_SOFTMAX_OP.name, selective_log_softmax_self_test)

_logged_cache_notes: set[str] = set()


class CudaBackend(Backend):
    """The GPU's fast paths, as `config` (the `cuda:` section) chooses them."""

    name = "cuda"
    device_type = "cuda"
    copies_fused_weights = False  # CudaLlamaDecoder reads a rollout skeleton's fused storage in place

    def __init__(self, config: CudaConfig | None = None) -> None:
        self.config = config or CudaConfig()

    def fast_decoder(self, model: nn.Module, batch: int, max_len: int,
                     kv_cache_dtype: KVCacheDtype = "model") -> CudaLlamaDecoder:
        self.kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
        graphs = self.config.cuda_graph_decode or cuda_graph_decode_requested()
        return CudaLlamaDecoder(model, batch, max_len, cuda_graph=graphs)

    def kv_cache_dtype(self, choice: KVCacheDtype, model_dtype: torch.dtype, model_type: str | None = None) -> torch.dtype:
        """The model's dtype: a float16 cache is the CPU decoder's (noted once where it was asked for)."""
        if choice == "fp16" and model_dtype not in _logged_cache_notes:
            _logged_cache_notes.add(model_dtype)
            log.info("fast decoder: kv_cache_dtype fp16 applies to float32 models on the CPU; this one is %s on cuda, "
                     "so its KV cache stays in the model's dtype", model_dtype)
        return model_dtype

    def sampler(self, logits: torch.Tensor, params: SamplingParams) -> tuple[str, Sampler] | None:
        """The fused CUDA sampling kernel (temperature, top-k, top-p) for CUDA logits; it falls back to
        the reference itself where its op cannot be built."""
        if not logits.is_cuda:
            return None

        def draw(logits: torch.Tensor, uniform: torch.Tensor, temperature: float) -> torch.Tensor:
            return sample_tokens(logits, temperature, params.top_k, params.top_p, uniform=uniform)

        return "cuda_kernel", draw

    def selective_log_softmax(self, logits: torch.Tensor,
                              index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return fused_selective_log_softmax_forward(logits, index)


__all__ = ["CudaBackend"]
