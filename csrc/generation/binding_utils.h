// Helpers shared by the torch bindings of the generation kernels (host C++, torch headers).
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "generation.h"

namespace rlhf_gen {

inline DType to_kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    default: TORCH_CHECK(false, "generation kernels support float16, bfloat16 and float32, got ", type);
  }
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

inline bool is_16_byte_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace rlhf_gen
