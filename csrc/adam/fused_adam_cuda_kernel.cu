// CUDA multi-tensor fused Adam/AdamW (fp32 params; bf16 params with fp32 state and an optional
// fp32 master copy; optional bf16 copy of the result). Pure CUDA: no torch headers.
//
// Like apex's multi_tensor_apply, tensors are cut into chunks of kChunk elements and one launch
// covers up to kMaxTensors tensors / kMaxBlocks chunks, whose addresses travel in the kernel's
// parameter block (no device-side metadata, so no allocation and no host sync per step).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fused_adam_cuda.h"

namespace rlhf_adam::cuda {

constexpr int kThreads = 512;
constexpr int kIlp = 4;  // elements per thread per iteration: one 16-byte fp32 load
constexpr int64_t kChunk = 65536;
constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;

struct TensorListMeta {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  float* master[kMaxTensors];
  __nv_bfloat16* lp_out[kMaxTensors];
  int64_t numel[kMaxTensors];
  float neg_step_size[kMaxTensors];
  float bias_correction2_sqrt[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};
// Kernel parameters are limited to 4 KiB on every toolkit/driver pair we may meet.
static_assert(sizeof(TensorListMeta) + sizeof(AdamHyper) <= 4000, "kernel params too large");

struct DeviceScalar {
  using T = float;
  __device__ __forceinline__ static T set1(float x) { return x; }
  __device__ __forceinline__ static T add(T a, T b) { return a + b; }
  __device__ __forceinline__ static T sub(T a, T b) { return a - b; }
  __device__ __forceinline__ static T mul(T a, T b) { return a * b; }
  __device__ __forceinline__ static T div(T a, T b) { return a / b; }
  __device__ __forceinline__ static T fmadd(T a, T b, T c) { return fmaf(a, b, c); }
  __device__ __forceinline__ static T sqrt(T a) { return sqrtf(a); }
};

#define RLHF_ADAM_FN __device__ __forceinline__
#include "adam_update.inc"
#undef RLHF_ADAM_FN

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void from_float(__nv_bfloat16* dst, float x) {
  *dst = __float2bfloat16_rn(x);
}

// kIlp-wide vector loads/stores: 16 bytes of fp32 or 8 bytes of bf16.
__device__ __forceinline__ void load_vec(const float* src, float (&dst)[kIlp]) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}
__device__ __forceinline__ void load_vec(const __nv_bfloat16* src, float (&dst)[kIlp]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  dst[0] = __low2float(lo);
  dst[1] = __high2float(lo);
  dst[2] = __low2float(hi);
  dst[3] = __high2float(hi);
}
__device__ __forceinline__ void store_vec(float* dst, const float (&src)[kIlp]) {
  *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
}
__device__ __forceinline__ void store_vec(__nv_bfloat16* dst, const float (&src)[kIlp]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(src[0], src[1]);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(src[2], src[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const unsigned int*>(&lo);
  raw.y = *reinterpret_cast<const unsigned int*>(&hi);
  *reinterpret_cast<uint2*>(dst) = raw;
}

template <typename T>
__device__ __forceinline__ bool aligned_for_vec(const T* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (kIlp * sizeof(T)) == 0;
}

template <typename ParamT, bool kMaster, bool kLowPrecision>
__global__ void __launch_bounds__(kThreads)
    fused_adam_kernel(const TensorListMeta meta, const AdamHyper hyper) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t n = min(meta.numel[t] - begin, kChunk);

  ParamT* param = static_cast<ParamT*>(meta.param[t]) + begin;
  const ParamT* grad = static_cast<const ParamT*>(meta.grad[t]) + begin;
  float* exp_avg = meta.exp_avg[t] + begin;
  float* exp_avg_sq = meta.exp_avg_sq[t] + begin;
  float* master = kMaster ? meta.master[t] + begin : nullptr;
  __nv_bfloat16* lp_out = kLowPrecision ? meta.lp_out[t] + begin : nullptr;
  AdamHyper h = hyper;
  h.neg_step_size = meta.neg_step_size[t];
  h.bias_correction2_sqrt = meta.bias_correction2_sqrt[t];
  const AdamCoeffs<DeviceScalar> c(h);

  // FSDP shards are views at arbitrary offsets: take the vector path only when all pointers
  // allow it; chunk starts are multiples of kIlp, so the check holds for the whole chunk.
  const bool vec = aligned_for_vec(param) && aligned_for_vec(grad) && aligned_for_vec(exp_avg) &&
                   aligned_for_vec(exp_avg_sq) && aligned_for_vec(master) &&
                   aligned_for_vec(lp_out);
  int64_t i0 = 0;
  if (vec) {
    const int64_t n_vec = n - n % kIlp;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kIlp; i < n_vec;
         i += static_cast<int64_t>(blockDim.x) * kIlp) {
      float w[kIlp], g[kIlp], m[kIlp], v[kIlp];
      if constexpr (kMaster) {
        load_vec(master + i, w);
      } else {
        load_vec(param + i, w);
      }
      load_vec(grad + i, g);
      load_vec(exp_avg + i, m);
      load_vec(exp_avg_sq + i, v);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) adam_update<DeviceScalar>(w[k], g[k], m[k], v[k], c);
      store_vec(exp_avg + i, m);
      store_vec(exp_avg_sq + i, v);
      if constexpr (kMaster) store_vec(master + i, w);
      store_vec(param + i, w);
      if constexpr (kLowPrecision) store_vec(lp_out + i, w);
    }
    i0 = n_vec;
  }
  for (int64_t i = i0 + threadIdx.x; i < n; i += blockDim.x) {
    float w;
    if constexpr (kMaster) {
      w = master[i];
    } else {
      w = to_float(param[i]);
    }
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_update<DeviceScalar>(w, to_float(grad[i]), m, v, c);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kMaster) master[i] = w;
    from_float(param + i, w);
    if constexpr (kLowPrecision) lp_out[i] = __float2bfloat16_rn(w);
  }
}

template <typename ParamT, bool kMaster, bool kLowPrecision>
cudaError_t launch_typed(const AdamTensorLists& l, const AdamHyper& hyper, cudaStream_t stream) {
  TensorListMeta meta;
  int slot = 0;    // next free tensor slot in meta
  int blocks = 0;  // chunks queued in meta
  cudaError_t status = cudaSuccess;
  auto flush = [&]() {
    if (blocks == 0) return;
    fused_adam_kernel<ParamT, kMaster, kLowPrecision><<<blocks, kThreads, 0, stream>>>(meta, hyper);
    if (status == cudaSuccess) status = cudaGetLastError();
    blocks = 0;
  };
  for (int64_t t = 0; t < l.count; ++t) {
    const int64_t numel = l.numels[t];
    if (numel == 0) continue;
    meta.param[slot] = l.params[t];
    meta.grad[slot] = l.grads[t];
    meta.exp_avg[slot] = l.exp_avgs[t];
    meta.exp_avg_sq[slot] = l.exp_avg_sqs[t];
    meta.master[slot] = kMaster ? l.masters[t] : nullptr;
    meta.lp_out[slot] = kLowPrecision ? static_cast<__nv_bfloat16*>(l.lp_out[t]) : nullptr;
    meta.numel[slot] = numel;
    meta.neg_step_size[slot] = l.neg_step_sizes[t];
    meta.bias_correction2_sqrt[slot] = l.bias_correction2_sqrts[t];
    const int64_t chunks = (numel + kChunk - 1) / kChunk;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      meta.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      meta.block_to_chunk[blocks] = static_cast<int>(chunk);
      ++blocks;
      if (blocks == kMaxBlocks) {
        flush();
        if (chunk + 1 < chunks) {
          // The tensor goes on in the next launch: it becomes that launch's slot 0.
          meta.param[0] = meta.param[slot];
          meta.grad[0] = meta.grad[slot];
          meta.exp_avg[0] = meta.exp_avg[slot];
          meta.exp_avg_sq[0] = meta.exp_avg_sq[slot];
          meta.master[0] = meta.master[slot];
          meta.lp_out[0] = meta.lp_out[slot];
          meta.numel[0] = meta.numel[slot];
          meta.neg_step_size[0] = meta.neg_step_size[slot];
          meta.bias_correction2_sqrt[0] = meta.bias_correction2_sqrt[slot];
          slot = 0;
        } else {
          slot = -1;  // tensor finished exactly at the flush: the next one starts at slot 0
        }
      }
    }
    ++slot;
    if (slot == kMaxTensors) {
      flush();
      slot = 0;
    }
  }
  flush();
  return status;
}

}  // namespace rlhf_adam::cuda

namespace rlhf_adam {

cudaError_t launch_fused_adam(const AdamTensorLists& lists, const AdamHyper& hyper,
                              cudaStream_t stream) {
  using cuda::launch_typed;
  using bf16 = __nv_bfloat16;
  const bool master = lists.masters != nullptr;
  const bool low_precision = lists.lp_out != nullptr;
  if (lists.param_type == ParamType::kBFloat16) {
    if (master && low_precision) return launch_typed<bf16, true, true>(lists, hyper, stream);
    if (master) return launch_typed<bf16, true, false>(lists, hyper, stream);
    if (low_precision) return launch_typed<bf16, false, true>(lists, hyper, stream);
    return launch_typed<bf16, false, false>(lists, hyper, stream);
  }
  if (master) return cudaErrorInvalidValue;  // fp32 params need no master copy
  if (low_precision) return launch_typed<float, false, true>(lists, hyper, stream);
  return launch_typed<float, false, false>(lists, hyper, stream);
}

}  // namespace rlhf_adam
