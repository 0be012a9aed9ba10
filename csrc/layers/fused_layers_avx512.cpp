// AVX-512 fused layer kernels (16 floats per register). Compiled for AVX-512 through a target
// pragma rather than a command-line flag, so the extension as a whole still loads on older
// CPUs; fused_layers.cpp only calls in here after checking that the CPU has AVX-512F.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/avx512_float.h"
#include "fused_layers.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

namespace rlhf_layers::avx512 {
#include "fused_layers_kernels.inc"
}  // namespace rlhf_layers::avx512

namespace rlhf_layers {
const LayerKernels& avx512_layer_kernels() { return avx512::layer_kernels<rlhf::Avx512Vec>(); }
}  // namespace rlhf_layers

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86-64: never called (cpu_has_avx512() is false)

namespace rlhf_layers {
const LayerKernels& avx512_layer_kernels() { return scalar_layer_kernels(); }
}  // namespace rlhf_layers

#endif
