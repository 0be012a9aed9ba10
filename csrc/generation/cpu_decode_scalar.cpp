// Portable CPU decode kernels: the fallback on CPUs without AVX2 (and on non-x86 machines).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../common/scalar_float.h"
#include "cpu_decode.h"

namespace rlhf_decode::scalar {

using Scalar = rlhf::ScalarVec;

#include "cpu_decode_kernels.inc"

}  // namespace rlhf_decode::scalar

namespace rlhf_decode {
const Kernels& scalar_kernels() {
  static const Kernels kernels{
      &scalar::rms_norm_rows<scalar::Scalar>,
      &scalar::silu_mul_rows<scalar::Scalar>,
      &scalar::attention_tasks<scalar::Scalar, float>,
      &scalar::attention_tasks<scalar::Scalar, uint16_t>,
      &scalar::sample_row<scalar::Scalar>,
      &scalar::panel_gemm<scalar::Scalar>,
      &scalar::panel_swiglu<scalar::Scalar>,
      &scalar::tn_gemm<scalar::Scalar>,
      &scalar::pack_transposed<scalar::Scalar>,
      &scalar::row_logprob<scalar::Scalar>,
  };
  return kernels;
}
}  // namespace rlhf_decode
