// Portable fused layer kernels: the fallback on CPUs without AVX2 (and on non-x86 machines).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/scalar_float.h"
#include "fused_layers.h"

namespace rlhf_layers::scalar {
#include "fused_layers_kernels.inc"
}  // namespace rlhf_layers::scalar

namespace rlhf_layers {
const LayerKernels& scalar_layer_kernels() { return scalar::layer_kernels<rlhf::ScalarVec>(); }
}  // namespace rlhf_layers
