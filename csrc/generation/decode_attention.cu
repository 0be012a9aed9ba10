// Decode attention over a static KV cache, flash-decoding style (split-K over the sequence).
//
// One block handles one (sequence, KV head, query-head chunk, split): it loads each key and
// value of its split once for the QC query heads that share the KV head (grouped-query
// attention), keeps a running max and sum per query head (online softmax, base 2), and writes a
// normalised partial output plus its log-sum-exp. A second kernel merges the splits. With a
// single split the first kernel writes the final output directly.
//
// Per key tile (kTile keys): (1) each thread scores one key against the QC queries (16-byte
// loads of K, queries broadcast from shared memory); (2) one warp per query head turns the tile's
// scores into probabilities and rescales the running sums; (3) each thread accumulates two
// adjacent channels of V for a strided subset of the tile's keys. Masked keys are never read, so
// stale or uninitialised cache slots cannot leak NaN into the output.

#include <algorithm>

#include "common.cuh"
#include "generation.h"

namespace rlhf_gen {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = kThreads;  // one key per thread in the scoring phase
constexpr int kMaxSplits = 128;
// Aim for this many blocks per SM; more splits only add merge work once the device is full.
constexpr int kTargetBlocksPerSm = 2;

int q_chunk_for_group(int group) {
  for (int chunk : {8, 4, 2}) {
    if (group % chunk == 0) return chunk;
  }
  return 1;
}

template <typename T, int D, int QC>
__global__ void __launch_bounds__(kThreads)
    decode_attention_split_kernel(const DecodeAttentionParams p) {
  static_assert(D % 8 == 0, "K rows are read as 16-byte vectors");
  constexpr int kRowThreads = D / 2;  // threads covering one V row, two channels each
  static_assert(kThreads % kRowThreads == 0, "V rows must tile the block");
  constexpr int kKeyLanes = kThreads / kRowThreads;
  constexpr int kWarps = kThreads / 32;

  __shared__ float q_s[QC][D];
  __shared__ float p_s[QC][kTile];
  __shared__ bool valid_s[kTile];
  __shared__ float m_s[QC], l_s[QC], alpha_s[QC];
  __shared__ float red_s[kKeyLanes][QC][D];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  const int b = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = group / QC;
  const int kv_head = blockIdx.y / chunks;
  const int head0 = kv_head * group + (blockIdx.y % chunks) * QC;

  int limit = p.seq_len;
  if (p.lengths != nullptr) {
    limit = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(limit), p.lengths[b])));
  }
  const int start = split * p.split_len;
  const int end = min(start + p.split_len, limit);

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b;
  for (int i = tid; i < QC * D; i += kThreads) {
    const int j = i / D;
    const int d = i % D;
    q_s[j][d] = Convert<T>::to_float(q[(head0 + j) * p.q_stride_h + d]) * p.scale_log2;
  }
  if (tid < QC) {
    m_s[tid] = kNegInf;
    l_s[tid] = 0.f;
  }
  const T* k_base = static_cast<const T*>(p.k) + b * p.k_stride_b + kv_head * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_stride_b + kv_head * p.v_stride_h;
  const uint8_t* mask_row = p.mask != nullptr ? p.mask + b * p.mask_stride_b : nullptr;

  const int pair = tid % kRowThreads;  // owns channels 2 * pair and 2 * pair + 1 of V
  const int key_lane = tid / kRowThreads;
  float acc[QC][2];
#pragma unroll
  for (int j = 0; j < QC; ++j) acc[j][0] = acc[j][1] = 0.f;
  __syncthreads();

  for (int t0 = start; t0 < end; t0 += kTile) {
    // (1) scores of key t0 + tid, already in log2 units (q was scaled by scale * log2(e)).
    const int s = t0 + tid;
    const bool valid = s < end && (mask_row == nullptr || mask_row[s] != 0);
    float score[QC];
#pragma unroll
    for (int j = 0; j < QC; ++j) score[j] = 0.f;
    if (valid) {
      const uint4* k_row = reinterpret_cast<const uint4*>(k_base + s * p.k_stride_s);
#pragma unroll 4
      for (int c = 0; c < D / 8; ++c) {
        const uint4 packed = __ldg(k_row + c);
        const float2 k01 = Convert<T>::pair_to_float2(packed.x);
        const float2 k23 = Convert<T>::pair_to_float2(packed.y);
        const float2 k45 = Convert<T>::pair_to_float2(packed.z);
        const float2 k67 = Convert<T>::pair_to_float2(packed.w);
#pragma unroll
        for (int j = 0; j < QC; ++j) {
          const float* qv = &q_s[j][c * 8];
          score[j] += qv[0] * k01.x + qv[1] * k01.y + qv[2] * k23.x + qv[3] * k23.y +
                      qv[4] * k45.x + qv[5] * k45.y + qv[6] * k67.x + qv[7] * k67.y;
        }
      }
    }
    valid_s[tid] = valid;
#pragma unroll
    for (int j = 0; j < QC; ++j) p_s[j][tid] = valid ? score[j] : kNegInf;
    __syncthreads();

    // (2) online softmax update, one warp per query head.
    for (int j = warp; j < QC; j += kWarps) {
      float tile_max = kNegInf;
      for (int i = lane; i < kTile; i += 32) tile_max = fmaxf(tile_max, p_s[j][i]);
      tile_max = warp_max(tile_max);
      const float m_old = m_s[j];
      const float m_new = fmaxf(m_old, tile_max);
      float tile_sum = 0.f;
      for (int i = lane; i < kTile; i += 32) {
        // m_new == -inf means nothing valid yet: every probability is 0 (not exp2(nan)).
        const float e = m_new == kNegInf ? 0.f : exp2f(p_s[j][i] - m_new);
        p_s[j][i] = e;
        tile_sum += e;
      }
      tile_sum = warp_sum(tile_sum);
      __syncwarp();  // every lane has read m_s[j] before lane 0 rewrites it (shuffles order no memory)
      if (lane == 0) {
        const float alpha = m_new == kNegInf ? 1.f : exp2f(m_old - m_new);
        alpha_s[j] = alpha;
        l_s[j] = l_s[j] * alpha + tile_sum;
        m_s[j] = m_new;
      }
    }
    __syncthreads();

    // (3) acc = acc * alpha + sum_i p_i * v_i over this thread's keys of the tile.
#pragma unroll
    for (int j = 0; j < QC; ++j) {
      acc[j][0] *= alpha_s[j];
      acc[j][1] *= alpha_s[j];
    }
    const int tile_keys = min(kTile, end - t0);
    for (int i = key_lane; i < tile_keys; i += kKeyLanes) {
      if (!valid_s[i]) continue;
      const uint32_t bits =
          __ldg(reinterpret_cast<const unsigned int*>(v_base + (t0 + i) * p.v_stride_s + 2 * pair));
      const float2 vf = Convert<T>::pair_to_float2(bits);
#pragma unroll
      for (int j = 0; j < QC; ++j) {
        const float w = p_s[j][i];
        acc[j][0] += w * vf.x;
        acc[j][1] += w * vf.y;
      }
    }
    __syncthreads();  // p_s, valid_s and alpha_s are rewritten by the next tile
  }

  if constexpr (kKeyLanes > 1) {
#pragma unroll
    for (int j = 0; j < QC; ++j) {
      red_s[key_lane][j][2 * pair] = acc[j][0];
      red_s[key_lane][j][2 * pair + 1] = acc[j][1];
    }
    __syncthreads();
    if (key_lane == 0) {
      for (int other = 1; other < kKeyLanes; ++other) {
#pragma unroll
        for (int j = 0; j < QC; ++j) {
          acc[j][0] += red_s[other][j][2 * pair];
          acc[j][1] += red_s[other][j][2 * pair + 1];
        }
      }
    }
  }
  if (key_lane != 0) return;

#pragma unroll
  for (int j = 0; j < QC; ++j) {
    const int h = head0 + j;
    const float l = l_s[j];
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    const float o0 = acc[j][0] * inv_l;
    const float o1 = acc[j][1] * inv_l;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
      out[2 * pair] = Convert<T>::from_float(o0);
      out[2 * pair + 1] = Convert<T>::from_float(o1);
    } else {
      const int64_t slot = (static_cast<int64_t>(b) * p.num_heads + h) * p.num_splits + split;
      p.ws_out[slot * D + 2 * pair] = o0;
      p.ws_out[slot * D + 2 * pair + 1] = o1;
      if (pair == 0) p.ws_lse[slot] = l > 0.f ? m_s[j] + log2f(l) : kNegInf;
    }
  }
}

// Merges the splits of one (sequence, head): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max).
template <typename T>
__global__ void decode_attention_combine_kernel(const DecodeAttentionParams p) {
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int d = threadIdx.x;
  if (d >= p.head_dim) return;
  const int64_t bh = static_cast<int64_t>(b) * p.num_heads + h;
  const float* lse = p.ws_lse + bh * p.num_splits;
  float m = kNegInf;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, lse[s]);
  float acc = 0.f;
  float weight_sum = 0.f;
  if (m != kNegInf) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(lse[s] - m);
      weight_sum += w;
      acc += w * p.ws_out[(bh * p.num_splits + s) * p.head_dim + d];
    }
  }
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
  out[d] = Convert<T>::from_float(weight_sum > 0.f ? acc / weight_sum : 0.f);
}

template <typename T, int D>
cudaError_t launch_for_head_dim(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int chunk = q_chunk_for_group(group);
  const dim3 grid(p.num_splits, p.num_kv_heads * (group / chunk), p.batch);
  switch (chunk) {
    case 8: decode_attention_split_kernel<T, D, 8><<<grid, kThreads, 0, stream>>>(p); break;
    case 4: decode_attention_split_kernel<T, D, 4><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: decode_attention_split_kernel<T, D, 2><<<grid, kThreads, 0, stream>>>(p); break;
    default: decode_attention_split_kernel<T, D, 1><<<grid, kThreads, 0, stream>>>(p); break;
  }
  if (p.num_splits > 1) {
    decode_attention_combine_kernel<T><<<dim3(p.num_heads, p.batch), D, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_dtype(const DecodeAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return launch_for_head_dim<T, 32>(p, stream);
    case 64: return launch_for_head_dim<T, 64>(p, stream);
    case 128: return launch_for_head_dim<T, 128>(p, stream);
    case 256: return launch_for_head_dim<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

bool decode_attention_supports_head_dim(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

cudaError_t decode_attention_plan(DecodeAttentionParams& p, int device) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  int sm_count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int group = p.num_heads / p.num_kv_heads;
  const long long base_blocks =
      static_cast<long long>(p.batch) * p.num_kv_heads * (group / q_chunk_for_group(group));
  const int tiles = std::max(1, ceil_div(p.seq_len, kTile));
  const long long wanted = (static_cast<long long>(kTargetBlocksPerSm) * sm_count + base_blocks - 1) /
                           std::max(1LL, base_blocks);
  const int splits = static_cast<int>(std::clamp<long long>(wanted, 1, std::min(tiles, kMaxSplits)));
  p.split_len = ceil_div(tiles, splits) * kTile;
  p.num_splits = std::max(1, ceil_div(p.seq_len, p.split_len));
  return cudaSuccess;
}

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, DType dtype, cudaStream_t stream) {
  if (!decode_attention_supports_head_dim(p.head_dim) || p.num_kv_heads <= 0 ||
      p.num_heads % p.num_kv_heads != 0 || p.split_len % kTile != 0 || p.num_splits < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.num_heads == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat16: return launch_for_dtype<__half>(p, stream);
    case DType::kBFloat16: return launch_for_dtype<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rlhf_gen
