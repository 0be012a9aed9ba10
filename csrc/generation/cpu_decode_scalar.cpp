// Portable CPU decode kernels: the fallback on CPUs without AVX2 (and on non-x86 machines).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_decode.h"

namespace rlhf_decode::scalar {

struct Scalar {
  using T = float;
  static constexpr int64_t kWidth = 1;
  static inline T zero() { return 0.0f; }
  static inline T set1(float x) { return x; }
  static inline T load(const float* p) { return *p; }
  static inline void store(float* p, T x) { *p = x; }
  static inline T add(T a, T b) { return a + b; }
  static inline T sub(T a, T b) { return a - b; }
  static inline T mul(T a, T b) { return a * b; }
  static inline T div(T a, T b) { return a / b; }
  static inline T fmadd(T a, T b, T c) { return std::fma(a, b, c); }
  static inline float hsum(T a) { return a; }
  static inline void hsum4(T a, T b, T c, T d, float* out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  static inline T exp(T a) { return std::exp(a); }
};

#include "cpu_decode_kernels.inc"

}  // namespace rlhf_decode::scalar

namespace rlhf_decode {
const Kernels& scalar_kernels() {
  static const Kernels kernels{
      &scalar::rms_norm_rows<scalar::Scalar>,
      &scalar::silu_mul_rows<scalar::Scalar>,
      &scalar::attention_tasks<scalar::Scalar>,
      &scalar::sample_row<scalar::Scalar>,
  };
  return kernels;
}
}  // namespace rlhf_decode
