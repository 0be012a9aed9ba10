// AVX-512 CPU decode kernels: the AVX2 set with the projections' panel GEMM on 16-float registers
// (8 rows x 3 panels of one register each against AVX2's 4 rows x 1 panel of 2: one multiply-add
// instruction per 16 outputs, fewer loads per FMA). At a decode step's few rows the projections are
// about half of the step; on a Zen 4 core the whole step is ~1.1x faster with 8 x 1, on Zen 5
// three panels side by side take another 10-15% off (scripts/bench_decode_step.py,
// packed_ms_per_step_by_isa). Each output is the same multiply-add chain over k in order as on
// AVX2, so the two give the same bits. RMSNorm, SiLU * up, attention over the KV cache (memory-bound)
// and sampling stay AVX2. Compiled through a target pragma, as cpu_decode_avx2.cpp; cpu_decode.cpp
// only calls in here after checking that the CPU has AVX2 and AVX-512F.
#include <algorithm>
#include <cmath>
#include <cstring>

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
const Kernels& avx512_kernels() {
  static const Kernels kernels = [] {
    Kernels k = avx2_kernels();
    k.panel_gemm = &avx512::panel_gemm<avx512::Avx512>;
    k.panel_swiglu = &avx512::panel_swiglu<avx512::Avx512>;
    k.tn_gemm = &avx512::tn_gemm<avx512::Avx512>;
    k.pack_transposed = &avx512::pack_transposed<avx512::Avx512>;
    k.row_logprob = &avx512::row_logprob<avx512::Avx512>;
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
