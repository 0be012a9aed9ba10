// AVX2 + FMA CPU decode kernels (8 floats per register). Compiled for AVX2 through a target
// pragma rather than a command-line flag, so the extension as a whole still loads on older
// CPUs; cpu_decode.cpp only calls in here after checking that the CPU has AVX2 and FMA.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../common/avx2_float.h"
#include "../common/half_float.h"
#include "cpu_decode.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace rlhf_decode::avx2 {

using Avx2 = rlhf::Avx2Vec;

#include "cpu_decode_kernels.inc"

}  // namespace rlhf_decode::avx2

namespace rlhf_decode {
const Kernels& avx2_kernels() {
  static const Kernels kernels{
      &avx2::rms_norm_rows<avx2::Avx2>,
      &avx2::silu_mul_rows<avx2::Avx2>,
      &avx2::attention_tasks<avx2::Avx2, float>,
      &avx2::attention_tasks<avx2::Avx2, uint16_t>,
      &avx2::sample_row<avx2::Avx2>,
      &avx2::panel_gemm<avx2::Avx2>,
      &avx2::panel_swiglu<avx2::Avx2>,
      &avx2::tn_gemm<avx2::Avx2>,
      &avx2::pack_transposed<avx2::Avx2>,
      &avx2::row_logprob<avx2::Avx2>,
  };
  return kernels;
}
}  // namespace rlhf_decode

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: cpu_decode.cpp never selects AVX2 here

namespace rlhf_decode {
const Kernels& avx2_kernels() { return scalar_kernels(); }
}  // namespace rlhf_decode

#endif
