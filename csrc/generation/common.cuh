// Device helpers shared by the generation kernels. CUDA toolkit only (no torch headers).
//
// torch.utils.cpp_extension compiles with -D__CUDA_NO_HALF_CONVERSIONS__ and friends, so every
// conversion below goes through an explicit intrinsic instead of an implicit cast.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace rlhf_gen {

constexpr float kNegInf = -__builtin_huge_valf();  // -inf, usable in host and device code
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Convert;

template <>
struct Convert<float> {
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <>
struct Convert<__half> {
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  // Two packed halves (low element first, as they lie in memory) to two floats.
  __device__ __forceinline__ static float2 pair_to_float2(uint32_t bits) {
    __half2 h;
    memcpy(&h, &bits, sizeof(h));
    return __half22float2(h);
  }
};

template <>
struct Convert<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  __device__ __forceinline__ static float2 pair_to_float2(uint32_t bits) {
    __nv_bfloat162 h;
    memcpy(&h, &bits, sizeof(h));
    return __bfloat1622float2(h);
  }
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Inclusive prefix sum over the block (blockDim.x a multiple of 32) of floats or counts.
// `warp_totals` is shared scratch of blockDim.x / 32 elements; every thread also gets the block
// total. The summation order is fixed, so the result is deterministic.
template <typename T>
__device__ __forceinline__ T block_inclusive_sum(T x, T* warp_totals, T* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  __syncthreads();  // a previous call may still be reading warp_totals
  if (lane == 31) warp_totals[warp] = x;
  __syncthreads();
  if (warp == 0) {
    T t = lane < num_warps ? warp_totals[lane] : T(0);
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, t, offset);
      if (lane >= offset) t += y;
    }
    if (lane < num_warps) warp_totals[lane] = t;
  }
  __syncthreads();
  *total = warp_totals[num_warps - 1];
  return (warp > 0 ? warp_totals[warp - 1] : T(0)) + x;
}

// Online log-sum-exp state (natural log): the set it summarises has sum(exp(x)) = s * exp(m).
// m == -inf means the empty set (or only -inf elements), with s == 0.
struct LseState {
  float m;
  float s;
};

__device__ __forceinline__ LseState lse_add(LseState a, float x) {
  if (x == kNegInf) return a;  // exp(-inf) contributes nothing; avoids (-inf) - (-inf) = NaN
  if (x > a.m) {
    // a.m may be -inf: exp(-inf) = 0 drops the (zero) old sum cleanly.
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else {
    a.s += expf(x - a.m);
  }
  return a;
}

__device__ __forceinline__ LseState lse_merge(LseState a, LseState b) {
  if (a.m == kNegInf) return b;
  if (b.m == kNegInf) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ LseState warp_lse_merge(LseState a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    LseState b{__shfl_xor_sync(0xffffffffu, a.m, offset), __shfl_xor_sync(0xffffffffu, a.s, offset)};
    a = lse_merge(a, b);
  }
  return a;
}

// Order-preserving map from float to uint32: a < b (as floats, no NaN) iff key(a) < key(b).
// -0.0 maps to the key of +0.0 because the two compare equal as floats (they are ties).
__device__ __forceinline__ uint32_t float_order_key(float x) {
  const uint32_t bits = x == 0.f ? 0u : __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace rlhf_gen
