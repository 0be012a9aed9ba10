// C entry points of the emulated generation kernels, called through ctypes by
// tests/test_generation_kernels.py. They mirror what the torch bindings (../*.cpp) do with
// tensors: fill the launch parameters, plan and allocate the split-K workspace, launch.
// "Device" pointers are plain host pointers here.
#include <string>
#include <vector>

#include "../generation.h"
#include "cuda_emulator.h"

using namespace rlhf_gen;

extern "C" {

const char* emu_last_message() { return emu::last_message.c_str(); }

void emu_set_sm_count(int count) { emu::sm_count = count; }

// strides: q_b, q_h, k_b, k_h, k_s, v_b, v_h, v_s, out_b, out_h, mask_b
// dims: batch, heads, kv_heads, head_dim, seq_len. Writes the number of splits used.
int emu_decode_attention(int dtype, const void* q, const void* k, const void* v, void* out, const int64_t* lengths,
                         const uint8_t* mask, const int64_t* strides, const int* dims, float scale, int* num_splits) {
  DecodeAttentionParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lengths = lengths;
  p.mask = mask;
  p.q_stride_b = strides[0];
  p.q_stride_h = strides[1];
  p.k_stride_b = strides[2];
  p.k_stride_h = strides[3];
  p.k_stride_s = strides[4];
  p.v_stride_b = strides[5];
  p.v_stride_h = strides[6];
  p.v_stride_s = strides[7];
  p.out_stride_b = strides[8];
  p.out_stride_h = strides[9];
  p.mask_stride_b = strides[10];
  p.batch = dims[0];
  p.num_heads = dims[1];
  p.num_kv_heads = dims[2];
  p.head_dim = dims[3];
  p.seq_len = dims[4];
  p.scale_log2 = scale * 1.4426950408889634f;
  cudaError_t err = decode_attention_plan(p, 0);
  if (err != cudaSuccess) return err;
  std::vector<float> ws_out, ws_lse;
  if (p.num_splits > 1) {
    ws_out.assign(static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * p.head_dim, -1.f);
    ws_lse.assign(static_cast<size_t>(p.batch) * p.num_heads * p.num_splits, -1.f);
    p.ws_out = ws_out.data();
    p.ws_lse = ws_lse.data();
  }
  *num_splits = p.num_splits;
  err = launch_decode_attention(p, static_cast<DType>(dtype), nullptr);
  return err;
}

int emu_sample_tokens(int dtype, const void* logits, int64_t stride_b, int batch, int vocab, const float* uniform,
                      int64_t* out, float temperature, int top_k, float top_p) {
  SamplingParams p;
  p.logits = logits;
  p.logits_stride_b = stride_b;
  p.batch = batch;
  p.vocab = vocab;
  p.uniform = uniform;
  p.out = out;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  return launch_sample_tokens(p, static_cast<DType>(dtype), nullptr);
}

// strides: logits_b, logits_t, index_b, index_t
int emu_selective_log_softmax(int dtype, const void* logits, const int64_t* index, float* logp, float* lse,
                              const int64_t* strides, int64_t batch, int64_t time, int vocab) {
  SelectiveLogSoftmaxParams p;
  p.logits = logits;
  p.index = index;
  p.logp = logp;
  p.lse = lse;
  p.logits_stride_b = strides[0];
  p.logits_stride_t = strides[1];
  p.index_stride_b = strides[2];
  p.index_stride_t = strides[3];
  p.batch = batch;
  p.time = time;
  p.vocab = vocab;
  return launch_selective_log_softmax(p, static_cast<DType>(dtype), nullptr);
}

}  // extern "C"
