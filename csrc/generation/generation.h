// Host-side interface of the generation kernels.
//
// The kernels (*.cu) depend only on the CUDA toolkit: they take raw device pointers, element
// strides and a stream, so they compile with plain nvcc and without any torch header. The torch
// bindings (*.cpp) validate tensors, allocate outputs and workspaces, and call these launchers
// on the current torch stream. Strides are in elements; the last dimension is always contiguous.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace rlhf_gen {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// ---------------------------------------------------------------------------------------------
// Decode attention: one query token per sequence against a static KV cache (flash-decoding).
// q [B, H, D]; k, v [B, Hkv, S, D] (any strides for B, Hkv and S); out [B, H, D].
// Query head h reads KV head h / (H / Hkv), as Hugging Face's repeat_kv does.
// Key s of sequence b is attended iff s < seq_len, s < lengths[b] (when lengths is set) and
// mask[b, s] != 0 (when mask is set). A sequence with no attended key gets a zero output.
// ---------------------------------------------------------------------------------------------
struct DecodeAttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  // fp32 workspaces for the split-K partial results, only used when num_splits > 1:
  // ws_out [B, H, num_splits, D] (normalised partial outputs), ws_lse [B, H, num_splits]
  // (log2-domain log-sum-exp of each split's scaled scores).
  float* ws_out = nullptr;
  float* ws_lse = nullptr;
  const int64_t* lengths = nullptr;  // [B] or null
  const uint8_t* mask = nullptr;     // [B, >= seq_len] (row stride mask_stride_b) or null
  int64_t q_stride_b = 0, q_stride_h = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_s = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_s = 0;
  int64_t out_stride_b = 0, out_stride_h = 0;
  int64_t mask_stride_b = 0;
  int batch = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int seq_len = 0;     // keys scanned: positions [0, seq_len)
  int split_len = 0;   // keys per split, a multiple of the key tile
  int num_splits = 1;  // ceil(seq_len / split_len)
  float scale_log2 = 0.f;  // softmax scale * log2(e): the kernels work with exp2
};

// True when decode_attention supports this head dimension (32, 64, 128 or 256).
bool decode_attention_supports_head_dim(int head_dim);

// Chooses split_len and num_splits for a launch so that the grid fills the device; writes both
// into params (batch, num_heads, num_kv_heads and seq_len must be set).
cudaError_t decode_attention_plan(DecodeAttentionParams& params, int device);

cudaError_t launch_decode_attention(const DecodeAttentionParams& params, DType dtype,
                                    cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Sampling: temperature, then top-k, then top-p (Hugging Face warper order), then inverse-CDF
// sampling in vocabulary order with one uniform number per row. Temperature <= 0 is greedy.
// top_k <= 0 or >= vocab disables top-k; top_p >= 1 disables top-p. Ties at the top-k threshold
// are kept; a tie group at the top-p boundary keeps its highest ids (HF's warper with a stable
// sort). See engine/sampling.py::process_logits for the exact semantics.
// ---------------------------------------------------------------------------------------------
struct SamplingParams {
  const void* logits = nullptr;  // [B, V], row stride logits_stride_b
  const float* uniform = nullptr;  // [B] uniform numbers in [0, 1)
  int64_t* out = nullptr;          // [B] sampled token ids
  int64_t logits_stride_b = 0;
  int batch = 0, vocab = 0;
  float temperature = 1.f;
  int top_k = 0;
  float top_p = 1.f;
};

cudaError_t launch_sample_tokens(const SamplingParams& params, DType dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Selective log-softmax forward: logp[b, t] = logits[b, t, index[b, t]] - logsumexp(logits[b, t]),
// fp32 accumulation, one pass over the vocabulary (online log-sum-exp). Also writes lse[b, t]
// for the backward pass. An index outside [0, vocab) gives NaN.
// ---------------------------------------------------------------------------------------------
struct SelectiveLogSoftmaxParams {
  const void* logits = nullptr;    // [B, T, V] with strides (logits_stride_b, logits_stride_t, 1)
  const int64_t* index = nullptr;  // [B, T] with strides (index_stride_b, index_stride_t)
  float* logp = nullptr;           // [B, T] contiguous
  float* lse = nullptr;            // [B, T] contiguous
  int64_t logits_stride_b = 0, logits_stride_t = 0;
  int64_t index_stride_b = 0, index_stride_t = 0;
  int64_t batch = 0, time = 0;
  int vocab = 0;
};

cudaError_t launch_selective_log_softmax(const SelectiveLogSoftmaxParams& params, DType dtype,
                                         cudaStream_t stream);

}  // namespace rlhf_gen
