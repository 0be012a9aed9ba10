// AVX2 + FMA CPU decode kernels (8 floats per register). Compiled for AVX2 through a target
// pragma rather than a command-line flag, so the extension as a whole still loads on older
// CPUs; cpu_decode.cpp only calls in here after checking that the CPU has AVX2 and FMA.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../common/avx2_float.h"
#include "cpu_decode.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace rlhf_decode::avx2 {

struct Avx2 : rlhf::Avx2Float {

  static inline float hsum(T a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }

  // out[0..4) = the horizontal sums of a, b, c, d.
  static inline void hsum4(T a, T b, T c, T d, float* out) {
    const T ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const T abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: sum(a) sum(b) sum(c) sum(d)
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }

  // exp(x) to about 1 ulp (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n).
  // Inputs below the smallest normal result give 0 (-inf included), above ~88.7 give +inf.
  static inline T exp(T x) {
    const T underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654475f), _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    T n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    T y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
  }
};

#include "cpu_decode_kernels.inc"

}  // namespace rlhf_decode::avx2

namespace rlhf_decode {
const Kernels& avx2_kernels() {
  static const Kernels kernels{
      &avx2::rms_norm_rows<avx2::Avx2>,
      &avx2::silu_mul_rows<avx2::Avx2>,
      &avx2::attention_tasks<avx2::Avx2>,
      &avx2::sample_row<avx2::Avx2>,
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
