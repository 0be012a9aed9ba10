// AVX-512F span kernel (16 floats per register); see cpu_adam_avx2.cpp for why a target pragma.
// cpu_adam.cpp only calls in here after checking the CPU (and OS) support AVX-512F.
#include <cmath>

#include "cpu_adam.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
// GCC 12 flags the intrinsics' own `__m512 __Y = __Y;` placeholders as maybe-uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace rlhf_adam::avx512 {

struct Avx512 {
  using T = __m512;
  static constexpr int64_t kWidth = 16;
  static inline T set1(float x) { return _mm512_set1_ps(x); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
  static inline T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, T x) { _mm512_storeu_ps(p, x); }

  static inline T load(const bf16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }

  // Same rounding as Avx2::store(bf16_t*): nearest even, canonical NaN.
  static inline void store(bf16_t* p, T x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
};

#define RLHF_ADAM_FN inline
#include "cpu_adam_span.inc"
#undef RLHF_ADAM_FN

}  // namespace rlhf_adam::avx512

namespace rlhf_adam {
bool adam_span_avx512(const AdamSpan& span, const AdamHyper& hyper) {
  return avx512::adam_span<avx512::Avx512>(span, hyper);
}
double sum_of_squares_avx512(const void* x, int64_t n, ParamType type) {
  return avx512::sum_of_squares_span<avx512::Avx512>(x, n, type);
}
}  // namespace rlhf_adam

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // x86-64
