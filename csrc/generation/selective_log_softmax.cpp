// Torch binding of the fused selective log-softmax forward (selective_log_softmax.cu).
#include <vector>

#include "binding_utils.h"

namespace rlhf_gen {
namespace {

// logits [B, T, V] (last dim contiguous, any B/T strides), index [B, T] integer.
// Returns {logp [B, T], lse [B, T]}, both float32.
std::vector<at::Tensor> selective_log_softmax_forward(const at::Tensor& logits, const at::Tensor& index) {
  TORCH_CHECK(logits.is_cuda() && index.is_cuda(), "selective_log_softmax: tensors must be on CUDA");
  TORCH_CHECK(logits.dim() == 3 && logits.stride(2) == 1,
              "selective_log_softmax: logits must be [B, T, V] with a contiguous last dimension");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == logits.size(0) && index.size(1) == logits.size(1),
              "selective_log_softmax: index must be [B, T] matching logits");
  TORCH_CHECK(logits.size(2) > 0 && logits.size(2) <= INT32_MAX, "selective_log_softmax: vocabulary size out of range");
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor idx = index.to(at::kLong);
  at::Tensor logp = at::empty({logits.size(0), logits.size(1)}, logits.options().dtype(at::kFloat));
  at::Tensor lse = at::empty_like(logp);
  SelectiveLogSoftmaxParams p;
  p.logits = logits.data_ptr();
  p.index = idx.data_ptr<int64_t>();
  p.logp = logp.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.logits_stride_b = logits.stride(0);
  p.logits_stride_t = logits.stride(1);
  p.index_stride_b = idx.stride(0);
  p.index_stride_t = idx.stride(1);
  p.batch = logits.size(0);
  p.time = logits.size(1);
  p.vocab = static_cast<int>(logits.size(2));
  check_launch(launch_selective_log_softmax(p, to_kernel_dtype(logits.scalar_type()),
                                            c10::cuda::getCurrentCUDAStream().stream()),
               "selective_log_softmax");
  return {logp, lse};
}

}  // namespace
}  // namespace rlhf_gen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("selective_log_softmax_forward", &rlhf_gen::selective_log_softmax_forward,
        "log_softmax(logits).gather(-1, index) and logsumexp(logits), fp32", pybind11::arg("logits"),
        pybind11::arg("index"));
}
