// The portable vector type of the CPU row kernels' templates: one float per "register", for
// CPUs without AVX2 (and non-x86 machines). Same interface as rlhf::Avx2Vec (avx2_float.h).
#pragma once

#include <cmath>
#include <cstdint>
#include "half_float.h"

namespace rlhf {

struct ScalarVec {
  using T = float;
  static constexpr int64_t kWidth = 1;
  static inline T zero() { return 0.0f; }
  static inline T set1(float x) { return x; }
  static inline T load(const float* p) { return *p; }
  static inline void store(float* p, T x) { *p = x; }
  static inline void store_stream(float* p, T x) { *p = x; }  // Avx2Vec's: a plain store here
  static inline void stream_fence() {}
  static inline T add(T a, T b) { return a + b; }
  static inline T sub(T a, T b) { return a - b; }
  static inline T mul(T a, T b) { return a * b; }
  static inline T div(T a, T b) { return a / b; }
  static inline T fmadd(T a, T b, T c) { return std::fma(a, b, c); }
  static inline T load_half(const uint16_t* p) { return half_to_float(*p); }
  static inline void store_half(uint16_t* p, T x) { *p = float_to_half(x); }
  static inline T max(T a, T b) { return a > b ? a : b; }
  static inline float hmax(T a) { return a; }
  static inline float hsum(T a) { return a; }
  static inline void hsum4(T a, T b, T c, T d, float* out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  static inline T exp(T a) { return std::exp(a); }
  static inline T exp_nonpositive(T a) { return std::exp(a); }
  static inline T keep_first(T x, int64_t n) { return n > 0 ? x : -INFINITY; }
  static inline T keep_from(T x, int64_t n) { return n > 0 ? -INFINITY : x; }
  static inline T keep_where(T x, const uint8_t* m) { return *m != 0 ? x : -INFINITY; }
  static inline void transpose_tile(const float* src, int64_t, float* dst, int64_t) { *dst = *src; }
};

}  // namespace rlhf
