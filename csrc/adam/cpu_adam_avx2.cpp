// AVX2 + FMA span kernel (8 floats per register). Everything in this file is compiled for AVX2
// through a target pragma rather than a command-line flag, so the extension as a whole still
// runs on older CPUs; cpu_adam.cpp only calls in here after checking the CPU supports AVX2/FMA.
#include <cmath>

#include "../common/avx2_float.h"
#include "cpu_adam.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace rlhf_adam::avx2 {

struct Avx2 : rlhf::Avx2Float {
  using Avx2Float::load;
  using Avx2Float::store;
  static inline T sqrt(T a) { return _mm256_sqrt_ps(a); }

  // bf16 -> fp32 is a 16-bit shift of each lane.
  static inline T load(const bf16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }

  // fp32 -> bf16 with round-to-nearest-even and canonical NaN, bit-equal to float_to_bf16().
  static inline void store(bf16_t* p, T x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    // Lanes hold values < 2^16, so the unsigned-saturating pack is exact.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

#define RLHF_ADAM_FN inline
#include "cpu_adam_span.inc"
#undef RLHF_ADAM_FN

}  // namespace rlhf_adam::avx2

namespace rlhf_adam {
bool adam_span_avx2(const AdamSpan& span, const AdamHyper& hyper) {
  return avx2::adam_span<avx2::Avx2>(span, hyper);
}
double sum_of_squares_avx2(const void* x, int64_t n, ParamType type) {
  return avx2::sum_of_squares_span<avx2::Avx2>(x, n, type);
}
}  // namespace rlhf_adam

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64
