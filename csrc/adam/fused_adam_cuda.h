// Launcher of the CUDA multi-tensor fused Adam/AdamW kernel. Raw pointers and sizes only: this
// header and fused_adam_cuda_kernel.cu need the CUDA toolkit but no torch headers, so the kernel
// builds with nvcc alone; fused_adam_cuda.cpp is the torch binding.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "adam_common.h"

namespace rlhf_adam {

// One step of `count` tensors on one device, all with the same param dtype (grads share it).
// The step-dependent constants are per tensor (params of a group may be at different steps).
// The update runs in fp32 on masters[i] when `masters` is non-null (bf16 params), else on the
// param itself; results go to the param, the master and lp_out[i] (bf16) when given.
struct AdamTensorLists {
  void* const* params;
  const void* const* grads;
  float* const* exp_avgs;
  float* const* exp_avg_sqs;
  float* const* masters;  // nullable (the array): no master copies
  void* const* lp_out;    // nullable (the array): no bf16 copy wanted
  const int64_t* numels;
  const float* neg_step_sizes;          // per tensor: -lr / (1 - beta1^step)
  const float* bias_correction2_sqrts;  // per tensor: sqrt(1 - beta2^step)
  int64_t count;
  ParamType param_type;
};

// Enqueues the step on `stream`; `hyper` holds the group's constants (its two step-dependent
// fields are ignored). Returns the first launch error (cudaSuccess otherwise).
cudaError_t launch_fused_adam(const AdamTensorLists& lists, const AdamHyper& hyper,
                              cudaStream_t stream);

}  // namespace rlhf_adam
