// Float32 AVX2 + FMA operations shared by the CPU kernels' vector types (8 floats per register).
// Each function carries the avx2/fma target itself, so this header may be included anywhere;
// only code that has checked rlhf::cpu_has_avx2() may call it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define RLHF_AVX2_FN static inline __attribute__((target("avx2,fma")))
#define RLHF_AVX2_F16C_FN static inline __attribute__((target("avx2,fma,f16c")))

namespace rlhf {

struct Avx2Float {
  using T = __m256;
  static constexpr int64_t kWidth = 8;
  RLHF_AVX2_FN T zero() { return _mm256_setzero_ps(); }
  RLHF_AVX2_FN T set1(float x) { return _mm256_set1_ps(x); }
  RLHF_AVX2_FN T load(const float* p) { return _mm256_loadu_ps(p); }
  RLHF_AVX2_FN void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  // A store that bypasses the caches (p 32-byte aligned), for outputs read back only much later;
  // stream_fence() orders such stores before the caller's later ones.
  RLHF_AVX2_FN void store_stream(float* p, T x) { _mm256_stream_ps(p, x); }
  RLHF_AVX2_FN void stream_fence() { _mm_sfence(); }
  RLHF_AVX2_FN T add(T a, T b) { return _mm256_add_ps(a, b); }
  RLHF_AVX2_FN T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  RLHF_AVX2_FN T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  RLHF_AVX2_FN T div(T a, T b) { return _mm256_div_ps(a, b); }
  RLHF_AVX2_FN T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  // IEEE half <-> float (F16C: every AVX2 CPU has it; cpu_has_avx2() checks), round to nearest even.
  RLHF_AVX2_F16C_FN T load_half(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  RLHF_AVX2_F16C_FN void store_half(uint16_t* p, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

// Avx2Float plus the reductions and exp the row kernels (CPU decode step, fused layer ops) use:
// the vector type `V` of their templates on AVX2 machines (Scalar in scalar_float.h elsewhere).
struct Avx2Vec : Avx2Float {
  RLHF_AVX2_FN T max(T a, T b) { return _mm256_max_ps(a, b); }
  RLHF_AVX2_FN float hmax(T a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }

  RLHF_AVX2_FN float hsum(T a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }

  // x with lanes n.. set to -inf (0 <= n <= 8).
  RLHF_AVX2_FN T keep_first(T x, int64_t n) {
    const __m256i kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, _mm256_castsi256_ps(kept));
  }
  // x with lanes ..n-1 set to -inf (0 <= n <= 8).
  RLHF_AVX2_FN T keep_from(T x, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i hidden = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
    return _mm256_blendv_ps(x, _mm256_set1_ps(-__builtin_inff()), _mm256_castsi256_ps(hidden));
  }
  // x with the lanes whose byte of m is 0 set to -inf (m: 8 readable bytes).
  RLHF_AVX2_FN T keep_where(T x, const uint8_t* m) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    const __m256i hidden = _mm256_cmpeq_epi32(bytes, _mm256_setzero_si256());
    return _mm256_blendv_ps(x, _mm256_set1_ps(-__builtin_inff()), _mm256_castsi256_ps(hidden));
  }

  // dst[c * dst_stride + r] = src[r * src_stride + c] for an 8 x 8 tile (r, c < 8).
  RLHF_AVX2_FN void transpose_tile(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
    T r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(dst + k * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
      _mm256_storeu_ps(dst + (k + 4) * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
    }
  }

  // out[0..4) = the horizontal sums of a, b, c, d.
  RLHF_AVX2_FN void hsum4(T a, T b, T c, T d, float* out) {
    const T ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const T abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: sum(a) sum(b) sum(c) sum(d)
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }

  // exp(x) to about 1 ulp (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n).
  // Inputs below the smallest normal result give 0 (-inf included), above ~88.7 give +inf.
  RLHF_AVX2_FN T exp(T x) {
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
  // exp(x) for x <= 0 (a score less its row's maximum): exp itself on AVX2.
  RLHF_AVX2_FN T exp_nonpositive(T x) { return exp(x); }
};

}  // namespace rlhf

#undef RLHF_AVX2_FN

#endif  // x86-64
