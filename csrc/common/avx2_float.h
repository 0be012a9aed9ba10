// Float32 AVX2 + FMA operations shared by the CPU kernels' vector types (8 floats per register).
// Each function carries the avx2/fma target itself, so this header may be included anywhere;
// only code that has checked rlhf::cpu_has_avx2() may call it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define RLHF_AVX2_FN static inline __attribute__((target("avx2,fma")))

namespace rlhf {

struct Avx2Float {
  using T = __m256;
  static constexpr int64_t kWidth = 8;
  RLHF_AVX2_FN T zero() { return _mm256_setzero_ps(); }
  RLHF_AVX2_FN T set1(float x) { return _mm256_set1_ps(x); }
  RLHF_AVX2_FN T load(const float* p) { return _mm256_loadu_ps(p); }
  RLHF_AVX2_FN void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  RLHF_AVX2_FN T add(T a, T b) { return _mm256_add_ps(a, b); }
  RLHF_AVX2_FN T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  RLHF_AVX2_FN T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  RLHF_AVX2_FN T div(T a, T b) { return _mm256_div_ps(a, b); }
  RLHF_AVX2_FN T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace rlhf

#undef RLHF_AVX2_FN

#endif  // x86-64
