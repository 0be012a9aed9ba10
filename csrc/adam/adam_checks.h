// Argument checks shared by the torch bindings of the CPU and CUDA fused Adam ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "adam_common.h"

namespace rlhf_adam {

// The tensor lists of one adam_step call: one entry per parameter; `masters` and `lp_out` are
// either empty (not wanted) or one entry per parameter. `steps` are the params' step counters
// (float32 scalars on the CPU, as torch AdamW keeps them); the op increments them.
struct AdamLists {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& grads;
  const std::vector<at::Tensor>& exp_avgs;
  const std::vector<at::Tensor>& exp_avg_sqs;
  const std::vector<at::Tensor>& masters;
  const std::vector<at::Tensor>& lp_out;
  const std::vector<at::Tensor>& steps;
};

inline void check_list(const char* op, const std::vector<at::Tensor>& list, size_t n,
                       const char* what, const at::Device& device,
                       std::optional<at::ScalarType> dtype, bool may_be_empty) {
  if (may_be_empty && list.empty()) return;
  TORCH_CHECK(list.size() == n, op, ": ", what, " has ", list.size(), " tensors, expected ", n);
  for (const auto& t : list) {
    TORCH_CHECK(t.device() == device, op, ": ", what, " must all be on ", device, ", got ",
                t.device());
    TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
    if (dtype) {
      TORCH_CHECK(t.scalar_type() == *dtype, op, ": ", what, " must be ", c10::toString(*dtype),
                  ", got ", t.scalar_type());
    }
  }
}

// Checks devices, dtypes, contiguity and sizes; returns the (single) dtype of params and grads.
inline ParamType check_adam_lists(const char* op, const AdamLists& l) {
  const size_t n = l.params.size();
  const at::Device cpu(at::kCPU);
  check_list(op, l.steps, n, "steps (CPU float32 scalars)", cpu, at::kFloat, false);
  for (const auto& s : l.steps) {
    TORCH_CHECK(s.numel() == 1, op, ": each step must be a one-element tensor");
  }
  if (n == 0) return ParamType::kFloat32;
  const at::Device device = l.params[0].device();
  const at::ScalarType dtype = l.params[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": params must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(l.masters.empty() || dtype == at::kBFloat16, op,
              ": fp32 master copies are only for bfloat16 params");
  check_list(op, l.params, n, "params", device, dtype, false);
  check_list(op, l.grads, n, "grads (same dtype as params)", device, dtype, false);
  check_list(op, l.exp_avgs, n, "exp_avgs", device, at::kFloat, false);
  check_list(op, l.exp_avg_sqs, n, "exp_avg_sqs", device, at::kFloat, false);
  check_list(op, l.masters, n, "masters", device, at::kFloat, true);
  check_list(op, l.lp_out, n, "lp_out", device, at::kBFloat16, true);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = l.params[i].numel();
    for (const auto* list : {&l.grads, &l.exp_avgs, &l.exp_avg_sqs, &l.masters, &l.lp_out}) {
      TORCH_CHECK(list->empty() || (*list)[i].numel() == numel, op, ": tensor ", i,
                  " has mismatched sizes across the lists");
    }
  }
  return dtype == at::kBFloat16 ? ParamType::kBFloat16 : ParamType::kFloat32;
}

// Increments every step counter (after all checks passed) and returns the new values.
inline std::vector<int64_t> increment_steps(const std::vector<at::Tensor>& steps) {
  std::vector<int64_t> values;
  values.reserve(steps.size());
  for (const auto& s : steps) {
    float* counter = s.data_ptr<float>();
    *counter += 1.0f;
    values.push_back(static_cast<int64_t>(*counter));
  }
  return values;
}

}  // namespace rlhf_adam
