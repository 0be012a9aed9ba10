// Float32 AVX-512 operations (16 floats per register): the vector type `V` of the row kernels'
// templates on AVX-512 machines, same interface as rlhf::Avx2Vec (avx2_float.h). Each function
// carries the avx512f target itself; only code that has checked rlhf::cpu_has_avx512() may call it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define RLHF_AVX512_FN static inline __attribute__((target("avx512f,avx2,fma")))

namespace rlhf {

struct Avx512Vec {
  using T = __m512;
  static constexpr int64_t kWidth = 16;
  RLHF_AVX512_FN T zero() { return _mm512_setzero_ps(); }
  RLHF_AVX512_FN T set1(float x) { return _mm512_set1_ps(x); }
  RLHF_AVX512_FN T load(const float* p) { return _mm512_loadu_ps(p); }
  RLHF_AVX512_FN void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  // A store that bypasses the caches (p 64-byte aligned), for outputs read back only much later;
  // stream_fence() orders such stores before the caller's later ones.
  RLHF_AVX512_FN void store_stream(float* p, T x) { _mm512_stream_ps(p, x); }
  RLHF_AVX512_FN void stream_fence() { _mm_sfence(); }
  RLHF_AVX512_FN T add(T a, T b) { return _mm512_add_ps(a, b); }
  RLHF_AVX512_FN T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  RLHF_AVX512_FN T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  RLHF_AVX512_FN T div(T a, T b) { return _mm512_div_ps(a, b); }
  RLHF_AVX512_FN T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  RLHF_AVX512_FN T max(T a, T b) { return _mm512_max_ps(a, b); }
  RLHF_AVX512_FN float hmax(T a) { return _mm512_reduce_max_ps(a); }
  RLHF_AVX512_FN float hsum(T a) { return _mm512_reduce_add_ps(a); }

  // x with lanes n.. set to -inf (0 <= n <= 16).
  RLHF_AVX512_FN T keep_first(T x, int64_t n) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), static_cast<__mmask16>((1u << n) - 1u), x);
  }
  // x with lanes ..n-1 set to -inf (0 <= n <= 16).
  RLHF_AVX512_FN T keep_from(T x, int64_t n) {
    return _mm512_mask_mov_ps(x, static_cast<__mmask16>((1u << n) - 1u), _mm512_set1_ps(-__builtin_inff()));
  }
  // x with the lanes whose byte of m is 0 set to -inf (m: 16 readable bytes).
  RLHF_AVX512_FN T keep_where(T x, const uint8_t* m) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
    return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), _mm512_test_epi32_mask(bytes, bytes), x);
  }

  // 16 IEEE halves (uint16_t bits) widened to floats; floats rounded to nearest halves.
  RLHF_AVX512_FN T load_half(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  RLHF_AVX512_FN void store_half(uint16_t* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Whether any lane of x is nonzero.
  RLHF_AVX512_FN bool any_nonzero(T x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ) != 0; }

  // The register of v[i]'s lane sums (lane i: the sum of v[i]'s 16 lanes): pairs interleaved and
  // added, then 64-bit pairs, then 128-bit lanes twice (45 instructions for 16 horizontal sums).
  RLHF_AVX512_FN T hsum16(const T (&v)[16]) {
    T a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] at lanes 0 and 2, v[2i + 1] at 1 and 3
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i .. 4i + 3]
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)  // lane pairs added: v[8i .. 8i + 3] twice, v[8i + 4 .. 8i + 7] twice
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  }

  // dst[c * dst_stride + r] = src[r * src_stride + c] for a 16 x 16 tile (r, c < 16): pairs of rows
  // interleaved, then 64-bit pairs, then 128-bit lanes twice (the usual 4-stage shuffle network).
  RLHF_AVX512_FN void transpose_tile(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
    T r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 16; i += 8) {
      for (int k = 0; k < 4; ++k) {
        t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
        t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
      }
    }
    for (int k = 0; k < 8; ++k) {
      _mm512_storeu_ps(dst + k * dst_stride, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
      _mm512_storeu_ps(dst + (k + 8) * dst_stride, _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd));
    }
  }

  // exp(x) as Avx2Vec::exp (Cephes' expf, about 1 ulp); below the smallest normal result 0.
  RLHF_AVX512_FN T exp(T x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654475f), _CMP_LT_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    T n;
    const T y = exp_reduced(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), &n);
    const __m512i exponent =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(y, _mm512_castsi512_ps(exponent)));
  }

  // exp(x) for x <= 0 (a score less its row's maximum; -inf included): exp's bits with neither the
  // overflow clamp nor the exponent built in integer registers (vscalefps scales by 2^n exactly: the
  // same product as y times 2^n's bits wherever the result is not masked to 0).
  RLHF_AVX512_FN T exp_nonpositive(T x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654475f), _CMP_LT_OQ);
    T n;
    const T y = exp_reduced(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), &n);
    return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), y, n);
  }

 private:
  // exp(x) = y 2^n for x in [-88.38, 88.38]: n = floor(x log2(e) + 1/2), y = exp(x - n ln 2) by
  // Cephes' degree-5 polynomial (ln 2 in two parts).
  RLHF_AVX512_FN T exp_reduced(T x, T* n_out) {
    const T n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    T y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    *n_out = n;
    return _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
  }
};

}  // namespace rlhf

#undef RLHF_AVX512_FN

#endif  // x86-64
