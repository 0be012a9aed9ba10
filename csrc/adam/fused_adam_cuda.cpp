// Torch binding of the CUDA fused Adam/AdamW op (module `fused_adam_cuda`): checks the tensor
// lists, gathers raw pointers and enqueues the kernel on the current stream. Only c10/cuda
// headers are used (not ATen/cuda), so cuBLAS/cuSPARSE headers are not needed to build it.
// Narrow includes instead of <torch/extension.h>, which alone takes about a minute to parse.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "adam_checks.h"
#include "fused_adam_cuda.h"

namespace rlhf_adam {
namespace {

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& lp_out,
               const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adam_w_mode) {
  const AdamLists lists{params, grads, exp_avgs, exp_avg_sqs, masters, lp_out, steps};
  const ParamType type = check_adam_lists("fused_adam_cuda", lists);
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cuda(), "fused_adam_cuda: tensors must be CUDA tensors");
  const c10::cuda::CUDAGuard guard(params[0].device());

  // The step counters live on the host, so the bias corrections cost no device sync.
  const AdamHyper hyper = make_adam_hyper(lr, beta1, beta2, eps, weight_decay, 1, adam_w_mode);
  std::vector<float> neg_step_sizes, bias_correction2_sqrts;
  for (const int64_t step : increment_steps(steps)) {
    const AdamHyper h = make_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode);
    neg_step_sizes.push_back(h.neg_step_size);
    bias_correction2_sqrts.push_back(h.bias_correction2_sqrt);
  }

  const size_t n = params.size();
  std::vector<void*> p(n), lp(lp_out.size());
  std::vector<const void*> g(n);
  std::vector<float*> m(n), v(n), master(masters.size());
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = params[i].data_ptr();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
    if (!masters.empty()) master[i] = masters[i].data_ptr<float>();
    if (!lp_out.empty()) lp[i] = lp_out[i].data_ptr();
    numels[i] = params[i].numel();
  }
  AdamTensorLists raw{};
  raw.params = p.data();
  raw.grads = g.data();
  raw.exp_avgs = m.data();
  raw.exp_avg_sqs = v.data();
  raw.masters = masters.empty() ? nullptr : master.data();
  raw.lp_out = lp_out.empty() ? nullptr : lp.data();
  raw.numels = numels.data();
  raw.neg_step_sizes = neg_step_sizes.data();
  raw.bias_correction2_sqrts = bias_correction2_sqrts.data();
  raw.count = static_cast<int64_t>(n);
  raw.param_type = type;

  const cudaError_t err =
      launch_fused_adam(raw, hyper, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "fused_adam_cuda: launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace rlhf_adam

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-tensor fused Adam/AdamW step for CUDA tensors";
  m.def("adam_step", &rlhf_adam::adam_step, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("lp_out"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adam_w_mode"),
        "One Adam/AdamW step over flat lists of contiguous tensors on one CUDA device (empty "
        "masters/lp_out lists mean none); increments each param's (CPU) step counter first.");
}
