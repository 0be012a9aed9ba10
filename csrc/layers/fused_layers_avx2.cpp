// AVX2 + FMA fused layer kernels (8 floats per register). Compiled for AVX2 through a target
// pragma rather than a command-line flag, so the extension as a whole still loads on older
// CPUs; fused_layers.cpp only calls in here after checking that the CPU has AVX2 and FMA.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/avx2_float.h"
#include "fused_layers.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace rlhf_layers::avx2 {
#include "fused_layers_kernels.inc"
}  // namespace rlhf_layers::avx2

namespace rlhf_layers {
const LayerKernels& avx2_layer_kernels() { return avx2::layer_kernels<rlhf::Avx2Vec>(); }
}  // namespace rlhf_layers

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: never called (cpu_has_avx2() is false)

namespace rlhf_layers {
const LayerKernels& avx2_layer_kernels() { return scalar_layer_kernels(); }
}  // namespace rlhf_layers

#endif
