// Fused selective log-softmax forward: log p(index) = x[index] - logsumexp(x) per row of
// logits [B, T, V], in one pass over the vocabulary with fp32 online log-sum-exp. Nothing of
// size V is written: the backward pass (torch, chunked) recomputes probabilities from the saved
// log-sum-exp. Rows may be strided (e.g. logits[:, :-1] of a [B, T + 1, V] tensor) so the
// common shifted view needs no copy.

#include "common.cuh"
#include "generation.h"

namespace rlhf_gen {
namespace {

constexpr int kMaxThreads = 256;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) selective_log_softmax_kernel(const SelectiveLogSoftmaxParams p) {
  __shared__ float warp_m[kMaxThreads / 32];
  __shared__ float warp_s[kMaxThreads / 32];
  const int64_t r = blockIdx.x;
  const int64_t b = r / p.time;
  const int64_t t = r % p.time;
  const T* row = static_cast<const T*>(p.logits) + b * p.logits_stride_b + t * p.logits_stride_t;
  const int vocab = p.vocab;

  LseState state{kNegInf, 0.f};
  if constexpr (VEC > 1) {
    // 16-byte loads; the host only picks this path when the row start and V are aligned.
    const uint4* vec_row = reinterpret_cast<const uint4*>(row);
    const int num_vec = vocab / VEC;
    for (int i = threadIdx.x; i < num_vec; i += blockDim.x) {
      const uint4 packed = __ldg(vec_row + i);
      T elems[VEC];
      memcpy(elems, &packed, sizeof(packed));
#pragma unroll
      for (int e = 0; e < VEC; ++e) state = lse_add(state, Convert<T>::to_float(elems[e]));
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) state = lse_add(state, Convert<T>::to_float(row[i]));
  }

  state = warp_lse_merge(state);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    warp_m[warp] = state.m;
    warp_s[warp] = state.s;
  }
  __syncthreads();
  if (warp != 0) return;
  const int num_warps = blockDim.x >> 5;
  state = lane < num_warps ? LseState{warp_m[lane], warp_s[lane]} : LseState{kNegInf, 0.f};
  state = warp_lse_merge(state);
  if (lane != 0) return;

  // A row of -inf only has logsumexp -inf, as torch.logsumexp says.
  const float lse = state.m == kNegInf ? kNegInf : state.m + logf(state.s);
  const int64_t idx = p.index[b * p.index_stride_b + t * p.index_stride_t];
  const float picked = (idx >= 0 && idx < vocab) ? Convert<T>::to_float(row[idx]) : __int_as_float(0x7fc00000);
  p.logp[r] = picked - lse;
  p.lse[r] = lse;
}

template <typename T>
cudaError_t launch_typed(const SelectiveLogSoftmaxParams& p, cudaStream_t stream) {
  constexpr int vec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(p.logits) % 16 == 0 && p.vocab % vec == 0 &&
                       p.logits_stride_b % vec == 0 && p.logits_stride_t % vec == 0;
  // Small vocabularies get fewer threads: idle warps would only add reduction work.
  const int work = aligned ? p.vocab / vec : p.vocab;
  int threads = 32;
  while (threads < kMaxThreads && threads < work) threads *= 2;
  const dim3 grid(static_cast<unsigned int>(p.batch * p.time));
  if (aligned) {
    selective_log_softmax_kernel<T, vec><<<grid, threads, 0, stream>>>(p);
  } else {
    selective_log_softmax_kernel<T, 1><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_selective_log_softmax(const SelectiveLogSoftmaxParams& p, DType dtype,
                                         cudaStream_t stream) {
  if (p.vocab <= 0 || p.time < 0 || p.batch < 0) return cudaErrorInvalidValue;
  if (p.batch * p.time > 0x7fffffffLL) return cudaErrorInvalidValue;  // gridDim.x limit
  if (p.batch * p.time == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rlhf_gen
