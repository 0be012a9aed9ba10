// Portable CPU span kernel: the fallback on CPUs without AVX2 (and on non-x86 machines).
// Compiled with the baseline flags only; the compiler may still auto-vectorise it.
#include <cmath>

#include "cpu_adam.h"

namespace rlhf_adam::scalar {

#define RLHF_ADAM_FN inline
#include "cpu_adam_span.inc"
#undef RLHF_ADAM_FN

}  // namespace rlhf_adam::scalar

namespace rlhf_adam {
bool adam_span_scalar(const AdamSpan& span, const AdamHyper& hyper) {
  return scalar::adam_span<scalar::Scalar>(span, hyper);
}
double sum_of_squares_scalar(const void* x, int64_t n, ParamType type) {
  return scalar::sum_of_squares_span<scalar::Scalar>(x, n, type);
}
}  // namespace rlhf_adam
