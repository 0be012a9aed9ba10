// AVX-512 CPU decode kernels: the AVX2 set with the projections' panel GEMM on 16-float registers
// (8 rows x 3 panels of one register each against AVX2's 4 rows x 1 panel of 2: one multiply-add
// instruction per 16 outputs, fewer loads per FMA). At a decode step's few rows the projections are
// about half of the step; on a Zen 4 core the whole step is ~1.1x faster with 8 x 1, on Zen 5
// three panels side by side take another 10-15% off (scripts/bench_decode_step.py,
// packed_ms_per_step_by_isa). Each projection output is the same multiply-add chain over k in
// order as on AVX2, so the two give the same bits. Attention over the KV cache runs
// attention_tasks_wide where head_dim is a multiple of 16 up to 128 (1.76x AVX2's per key with the
// cache in L2, a decode step of the tiny Llama at batch 8 10% faster; at batch 32 the step reads
// the cache from DRAM and the two are even); RMSNorm, SiLU * up and sampling stay AVX2. Compiled
// through a target pragma, as cpu_decode_avx2.cpp; cpu_decode.cpp only calls in here after
// checking that the CPU has AVX2 and AVX-512F.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../common/avx512_float.h"
#include "../common/half_float.h"
#include "cpu_decode.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif

namespace rlhf_decode::avx512 {

using Avx512 = rlhf::Avx512Vec;

#include "cpu_decode_kernels.inc"

}  // namespace rlhf_decode::avx512

namespace rlhf_decode {
namespace {
// The wide attention where head_dim is a multiple of 16, else AVX2's.
template <class C>
void attention_avx512(const AttentionArgs& a, int64_t begin, int64_t end, float* scratch) {
  using avx512::Avx512;
  switch (a.head_dim) {
    case 16: return avx512::attention_tasks_wide<Avx512, C, 1>(a, begin, end, scratch);
    case 32: return avx512::attention_tasks_wide<Avx512, C, 2>(a, begin, end, scratch);
    case 48: return avx512::attention_tasks_wide<Avx512, C, 3>(a, begin, end, scratch);
    case 64: return avx512::attention_tasks_wide<Avx512, C, 4>(a, begin, end, scratch);
    case 80: return avx512::attention_tasks_wide<Avx512, C, 5>(a, begin, end, scratch);
    case 96: return avx512::attention_tasks_wide<Avx512, C, 6>(a, begin, end, scratch);
    case 128: return avx512::attention_tasks_wide<Avx512, C, 8>(a, begin, end, scratch);
    default: break;
  }
  const Kernels& narrow = avx2_kernels();
  (std::is_same_v<C, float> ? narrow.attention : narrow.attention_half)(a, begin, end, scratch);
}
}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels kernels = [] {
    Kernels k = avx2_kernels();
    k.panel_gemm = &avx512::panel_gemm<avx512::Avx512>;
    k.panel_swiglu = &avx512::panel_swiglu<avx512::Avx512>;
    k.tn_gemm = &avx512::tn_gemm<avx512::Avx512>;
    k.pack_transposed = &avx512::pack_transposed<avx512::Avx512>;
    k.row_logprob = &avx512::row_logprob<avx512::Avx512>;
    k.attention = &attention_avx512<float>;
    k.attention_half = &attention_avx512<uint16_t>;
    return k;
  }();
  return kernels;
}
}  // namespace rlhf_decode

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: cpu_decode.cpp never selects AVX-512 here

namespace rlhf_decode {
const Kernels& avx512_kernels() { return scalar_kernels(); }
}  // namespace rlhf_decode

#endif
