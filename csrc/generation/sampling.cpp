// Torch binding of the fused sampling kernel (sampling.cu).
#include "binding_utils.h"

namespace rlhf_gen {
namespace {

// logits [B, V] (float16 / bfloat16 / float32, contiguous rows), uniform [B] float32 in [0, 1).
// Returns the sampled token ids [B] (int64). See sample_tokens_reference for the semantics.
at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                         double top_p) {
  TORCH_CHECK(logits.is_cuda() && uniform.is_cuda(), "sample_tokens: tensors must be on CUDA");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "sample_tokens: logits must be [B, V] with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= INT32_MAX, "sample_tokens: vocabulary size out of range");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.dim() == 1 && uniform.size(0) == logits.size(0),
              "sample_tokens: uniform must be float32 of shape [B]");
  c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor u = uniform.contiguous();
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  SamplingParams p;
  p.logits = logits.data_ptr();
  p.uniform = u.data_ptr<float>();
  p.out = out.data_ptr<int64_t>();
  p.logits_stride_b = logits.stride(0);
  p.batch = static_cast<int>(logits.size(0));
  p.vocab = static_cast<int>(logits.size(1));
  p.temperature = static_cast<float>(temperature);
  p.top_k = static_cast<int>(std::min<int64_t>(std::max<int64_t>(top_k, 0), INT32_MAX));
  p.top_p = static_cast<float>(top_p);
  check_launch(launch_sample_tokens(p, to_kernel_dtype(logits.scalar_type()), c10::cuda::getCurrentCUDAStream().stream()),
               "sample_tokens");
  return out;
}

}  // namespace
}  // namespace rlhf_gen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_tokens", &rlhf_gen::sample_tokens, "Fused temperature / top-k / top-p sampling",
        pybind11::arg("logits"), pybind11::arg("uniform"), pybind11::arg("temperature"), pybind11::arg("top_k"),
        pybind11::arg("top_p"));
}
