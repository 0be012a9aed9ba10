// Fused temperature / top-k / top-p sampling, one block per row, no host synchronisation.
//
// Semantics (engine/sampling.py::process_logits and sample_from_logits are the definition):
//   x = logits / temperature (fp32); temperature <= 0 means greedy (first index of the max).
//   top-k keeps x >= the k-th largest x (ties kept).
//   top-p orders the top-k survivors from most to least likely, tied tokens by descending id,
//   and keeps a token while the mass before it is < top_p * Z, with masses e^(x - max) and Z
//   their sum (Hugging Face's TopPLogitsWarper with a stable sort); the first is always kept.
//   So a tie group at the top-p boundary may be cut: its highest ids are kept.
//   The token is the first index (vocabulary order) whose inclusive cumulative kept mass exceeds
//   u * Z_kept, u being the row's uniform number; if rounding leaves none, the last kept token
//   with positive mass.
//
// Thresholds are found without sorting: a radix select over order-preserving 32-bit keys of x,
// 8 bits per pass from the most significant digit. Top-k histograms counts, top-p histograms
// masses (and, in its last pass, the size of the boundary's tie group), so each needs 4 passes
// over the row. The row stays in L2 between passes. The draw is a tiled block scan that stops at
// the first tile containing the crossing; when the tie group is cut it also counts tied tokens
// in id order, to drop the first ones.

#include <climits>

#include "common.cuh"
#include "generation.h"

namespace rlhf_gen {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;

struct SampleShared {
  float scan_totals[kWarps];
  int scan_counts[kWarps];
  unsigned int count_hist[kBins];
  float mass_hist[kBins];
  float reduce[kWarps];
  int reduce_index[kWarps];
  uint32_t prefix;
  unsigned int remaining;
  float above;
  int drop_ties;
  float kept_tie_mass;
  int found;
  int last_positive;
};

__device__ __forceinline__ float block_max(float x, SampleShared& sh) {
  x = warp_max(x);
  __syncthreads();  // a previous reduction may still be reading sh.reduce
  if ((threadIdx.x & 31) == 0) sh.reduce[threadIdx.x >> 5] = x;
  __syncthreads();
  return warp_max((threadIdx.x & 31) < kWarps ? sh.reduce[threadIdx.x & 31] : kNegInf);
}

__device__ __forceinline__ float block_sum(float x, SampleShared& sh) {
  x = warp_sum(x);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.reduce[threadIdx.x >> 5] = x;
  __syncthreads();
  return warp_sum((threadIdx.x & 31) < kWarps ? sh.reduce[threadIdx.x & 31] : 0.f);
}

// (value, index) pair that wins the argmax: larger value, then smaller index.
__device__ __forceinline__ bool argmax_better(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

template <typename T>
__device__ int block_argmax(const T* row, int vocab, SampleShared& sh) {
  float best_v = kNegInf;
  int best_i = INT_MAX;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = Convert<T>::to_float(row[i]);
    if (argmax_better(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (argmax_better(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    sh.reduce[threadIdx.x >> 5] = best_v;
    sh.reduce_index[threadIdx.x >> 5] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (argmax_better(sh.reduce[w], sh.reduce_index[w], best_v, best_i)) {
        best_v = sh.reduce[w];
        best_i = sh.reduce_index[w];
      }
    }
  }
  // torch.argmax returns 0 for a row without any value above -inf.
  return best_i == INT_MAX ? 0 : best_i;
}

template <typename T>
struct ScaledRow {
  const T* row;
  float temperature;
  // Division (not multiplication by 1/T) so that x matches the reference's logits / T bit for bit.
  __device__ __forceinline__ float operator()(int i) const {
    return Convert<T>::to_float(row[i]) / temperature;
  }
};

// Key of the k-th largest x: keep x with float_order_key(x) >= result. Requires 0 < k < vocab.
template <typename T>
__device__ uint32_t top_k_threshold(const ScaledRow<T>& x, int vocab, int k, SampleShared& sh) {
  const int lane = threadIdx.x & 31;
  uint32_t prefix = 0;
  uint32_t prefix_mask = 0;
  unsigned int remaining = static_cast<unsigned int>(k);  // rank of the target among the matches
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) sh.count_hist[i] = 0;
    __syncthreads();
    // Uniform trip count so that all 32 lanes take part in __match_any_sync.
    for (int base = 0; base < vocab; base += kThreads) {
      const int i = base + threadIdx.x;
      unsigned int digit = kBins;  // sentinel: no contribution
      if (i < vocab) {
        const uint32_t key = float_order_key(x(i));
        if ((key & prefix_mask) == prefix) digit = (key >> shift) & 0xffu;
      }
      // Lanes with the same digit add their count once: the top digits of logits are few, so
      // per-lane atomics would serialise on one or two bins.
      const unsigned int peers = __match_any_sync(0xffffffffu, digit);
      if (digit < kBins && lane == __ffs(peers) - 1) atomicAdd(&sh.count_hist[digit], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned int above = 0;
      int chosen = 0;
      for (int d = kBins - 1; d >= 0; --d) {
        const unsigned int c = sh.count_hist[d];
        if (above + c >= remaining) {
          chosen = d;
          break;
        }
        above += c;
      }
      sh.remaining = remaining - above;
      sh.prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
    }
    __syncthreads();
    remaining = sh.remaining;
    prefix = sh.prefix;
    prefix_mask |= 0xffu << shift;
  }
  return prefix;
}

// The float whose float_order_key is `key` (+0.0 for the key that -0.0 and +0.0 share).
__device__ __forceinline__ float float_from_order_key(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Where top-p cuts: keep x with key > `key`; of the `drop_ties + kept` tokens with key == `key`,
// drop the first `drop_ties` in id order and keep the rest, whose total mass is kept_tie_mass.
struct TopPBoundary {
  uint32_t key;
  int drop_ties;
  float kept_tie_mass;
};

// How many of a tie group of `ties` tokens of mass `m` each top-p keeps: with `above` the mass
// of all larger tokens, the j-th tied token (descending id order) has above + j * m before it
// and is kept while that is < target. At least one is kept (the row's maximum always is, and
// only the maximum's group can start at or above the target).
__device__ __forceinline__ unsigned int kept_ties(unsigned int ties, float m, float above, float target) {
  unsigned int lo = 0, hi = ties;  // binary search for the first j that is not kept
  while (lo < hi) {
    const unsigned int mid = lo + (hi - lo) / 2;
    if (above + static_cast<float>(mid) * m < target) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo > 0 ? lo : 1;
}

// The top-p boundary among x with key >= floor_key. mass(x) = e^(x - max).
template <typename T>
__device__ TopPBoundary top_p_threshold(const ScaledRow<T>& x, int vocab, float row_max, uint32_t floor_key,
                                        float top_p, SampleShared& sh) {
  float z = 0.f;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = x(i);
    if (float_order_key(v) >= floor_key) z += expf(v - row_max);
  }
  const float target = top_p * block_sum(z, sh);

  uint32_t prefix = 0;
  uint32_t prefix_mask = 0;
  float above = 0.f;  // mass of the candidates whose key is above the current prefix range
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      sh.mass_hist[i] = 0.f;
      sh.count_hist[i] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float v = x(i);
      const uint32_t key = float_order_key(v);
      if (key >= floor_key && (key & prefix_mask) == prefix) {
        atomicAdd(&sh.mass_hist[(key >> shift) & 0xffu], expf(v - row_max));
        // In the last pass a bin is one value: its count is the size of that tie group.
        if (shift == 0) atomicAdd(&sh.count_hist[key & 0xffu], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // The kept boundary is the bin where the mass above stays < target but reaches it with
      // the bin included. Empty bins cannot hold it; with target <= 0 the highest non-empty bin
      // wins, which keeps the maximum. If rounding never reaches the target, keep the whole
      // lowest non-empty bin (its smaller elements have too little mass to ever be drawn).
      float cum = above;
      int chosen = -1;
      int lowest = 0;
      float above_lowest = above;
      for (int d = kBins - 1; d >= 0; --d) {
        const float h = sh.mass_hist[d];
        if (h <= 0.f) continue;
        if (cum + h >= target) {
          chosen = d;
          break;
        }
        lowest = d;
        above_lowest = cum;
        cum += h;
      }
      if (chosen < 0) {
        chosen = lowest;
        cum = above_lowest;
      }
      sh.above = cum;
      sh.prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
    }
    __syncthreads();
    above = sh.above;
    prefix = sh.prefix;
    prefix_mask |= 0xffu << shift;
  }
  if (threadIdx.x == 0) {
    const unsigned int ties = sh.count_hist[prefix & 0xffu];
    const float m = expf(float_from_order_key(prefix) - row_max);
    const unsigned int kept = ties == 0 ? 0u : kept_ties(ties, m, above, target);  // 0: a row of no mass
    sh.drop_ties = static_cast<int>(ties - kept);
    sh.kept_tie_mass = static_cast<float>(kept) * m;
  }
  __syncthreads();
  return {prefix, sh.drop_ties, sh.kept_tie_mass};
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_tokens_kernel(const SamplingParams p) {
  __shared__ SampleShared sh;
  const int row_index = blockIdx.x;
  const T* row = static_cast<const T*>(p.logits) + row_index * p.logits_stride_b;
  const int vocab = p.vocab;

  if (!(p.temperature > 0.f)) {
    const int best = block_argmax(row, vocab, sh);
    if (threadIdx.x == 0) p.out[row_index] = best;
    return;
  }
  const ScaledRow<T> x{row, p.temperature};

  float local_max = kNegInf;
  for (int i = threadIdx.x; i < vocab; i += kThreads) local_max = fmaxf(local_max, x(i));
  const float row_max = block_max(local_max, sh);

  // Keep x with key > keep_key, and those with key == keep_key but the first drop_ties of them
  // in id order (top-p's cut through a tie group); keep_key 0 keeps everything.
  uint32_t keep_key = 0;
  int drop_ties = 0;
  float kept_tie_mass = 0.f;
  if (p.top_k > 0 && p.top_k < vocab) keep_key = top_k_threshold(x, vocab, p.top_k, sh);
  if (p.top_p < 1.f) {
    const TopPBoundary cut = top_p_threshold(x, vocab, row_max, keep_key, p.top_p, sh);
    keep_key = cut.key;  // >= the top-k key: top-p only looks at the top-k survivors
    drop_ties = cut.drop_ties;
    kept_tie_mass = cut.kept_tie_mass;
  }

  // Kept mass; a cut tie group is added as a whole (its tokens all have the same mass).
  float z = 0.f;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = x(i);
    const uint32_t key = float_order_key(v);
    if (key > keep_key || (key == keep_key && drop_ties == 0)) z += expf(v - row_max);
  }
  const float target = p.uniform[row_index] * (block_sum(z, sh) + (drop_ties > 0 ? kept_tie_mass : 0.f));

  if (threadIdx.x == 0) {
    sh.found = INT_MAX;
    sh.last_positive = -1;
  }
  __syncthreads();
  float carry = 0.f;
  int ties_before = 0;  // tokens of the cut tie group in earlier tiles
  for (int base = 0; base < vocab; base += kThreads) {
    const int i = base + threadIdx.x;
    const float v = i < vocab ? x(i) : kNegInf;
    const uint32_t key = i < vocab ? float_order_key(v) : 0u;
    bool kept = i < vocab && (key > keep_key || (key == keep_key && drop_ties == 0));
    if (drop_ties > 0) {  // the same for the whole block: every thread joins the scan
      const int tie = i < vocab && key == keep_key ? 1 : 0;
      int tile_ties;
      const int rank = ties_before + block_inclusive_sum(tie, sh.scan_counts, &tile_ties) - tie;
      kept = kept || (tie && rank >= drop_ties);
      ties_before += tile_ties;
    }
    const float mass = kept ? expf(v - row_max) : 0.f;
    float tile_total;
    const float inclusive = block_inclusive_sum(mass, sh.scan_totals, &tile_total);
    if (mass > 0.f) {
      if (carry + inclusive > target) atomicMin(&sh.found, i);
      atomicMax(&sh.last_positive, i);
    }
    __syncthreads();
    // The next tile's atomics come after the barriers inside block_inclusive_sum, so every
    // thread has read `found` by then.
    const bool done = sh.found != INT_MAX;
    carry += tile_total;
    if (done) break;
  }
  if (threadIdx.x == 0) {
    const int token = sh.found != INT_MAX ? sh.found : max(sh.last_positive, 0);
    p.out[row_index] = token;
  }
}

}  // namespace

cudaError_t launch_sample_tokens(const SamplingParams& p, DType dtype, cudaStream_t stream) {
  if (p.vocab <= 0) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  const dim3 grid(p.batch);
  switch (dtype) {
    case DType::kFloat16: sample_tokens_kernel<__half><<<grid, kThreads, 0, stream>>>(p); break;
    case DType::kBFloat16: sample_tokens_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p); break;
    case DType::kFloat32: sample_tokens_kernel<float><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace rlhf_gen
