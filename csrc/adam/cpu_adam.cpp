// Torch binding of the CPU fused Adam/AdamW op (module `fused_adam_cpu`).
//
// adam_step() takes flat lists of contiguous CPU tensors (one parameter group's params with
// their state and step counters), cuts them into fixed-size chunks and runs the chunks on
// torch's intra-op OpenMP threads with the widest kernel this CPU supports (AVX-512F, AVX2+FMA,
// else portable scalar code). One pass reads p, g, m, v and writes p, m, v (+ master, + a bf16
// copy of the updated parameters when asked for: what ZeRO-Offload hands back to the GPU).
//
// Narrow includes instead of <torch/extension.h>: they cut the JIT build from ~65 s to ~13 s.
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../common/cpu_features.h"
#include "adam_checks.h"
#include "cpu_adam.h"

namespace rlhf_adam {
namespace {

// 64K floats = 256 KiB per stream: big enough to amortise the dispatch, small enough that a few
// hundred chunks spread evenly over threads when tensors have very different sizes.
constexpr int64_t kChunk = 1 << 16;

using rlhf::cpu_has_avx2;
using rlhf::cpu_has_avx512;

// The kernels this machine can run, widest last.
std::vector<std::string> supported_isas() {
  std::vector<std::string> isas{"scalar"};
  if (cpu_has_avx2()) isas.emplace_back("avx2");
  if (cpu_has_avx512()) isas.emplace_back("avx512");
  return isas;
}

std::string best_isa() { return supported_isas().back(); }

// The kernels one call runs: the span update and the sum of squares of one instruction set.
struct IsaKernels {
  AdamSpanFn adam_span;
  SumOfSquaresFn sum_of_squares;
};

IsaKernels resolve_isa(const std::string& requested) {
  const std::string isa = requested == "auto" ? best_isa() : requested;
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "fused_adam_cpu: this CPU has no AVX-512F");
    return {&adam_span_avx512, &sum_of_squares_avx512};
  }
  if (isa == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "fused_adam_cpu: this CPU has no AVX2/FMA");
    return {&adam_span_avx2, &sum_of_squares_avx2};
  }
#endif
  TORCH_CHECK(isa == "scalar", "fused_adam_cpu: unknown or unsupported isa '", requested,
              "' (supported: auto, ", c10::Join(", ", supported_isas()), ")");
  return {&adam_span_scalar, &sum_of_squares_scalar};
}

// Returns whether every updated value (the fp32 working copy: the master where there is one) is finite.
bool adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& lp_out,
               const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adam_w_mode, const std::string& isa, double grad_scale) {
  const AdamLists lists{params, grads, exp_avgs, exp_avg_sqs, masters, lp_out, steps};
  const ParamType type = check_adam_lists("fused_adam_cpu", lists);
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale >= 0.0,
              "fused_adam_cpu: grad_scale must be a finite number >= 0, got ", grad_scale);
  if (!params.empty()) {
    TORCH_CHECK(params[0].device().is_cpu(), "fused_adam_cpu: tensors must be on the CPU");
  }
  const AdamSpanFn kernel = resolve_isa(isa).adam_span;
  // Per tensor: params of one group may be at different steps (added to the optimizer later).
  std::vector<AdamHyper> hypers;
  for (const int64_t step : increment_steps(steps)) {
    hypers.push_back(make_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, grad_scale));
  }

  std::vector<AdamSpan> spans;
  std::vector<size_t> span_tensor;
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    const int64_t elem = static_cast<int64_t>(p.element_size());
    for (int64_t begin = 0; begin < numel; begin += kChunk) {
      AdamSpan s{};
      s.param = static_cast<char*>(p.data_ptr()) + begin * elem;
      s.grad = static_cast<const char*>(grads[i].data_ptr()) + begin * elem;
      s.exp_avg = exp_avgs[i].data_ptr<float>() + begin;
      s.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>() + begin;
      s.master = masters.empty() ? nullptr : masters[i].data_ptr<float>() + begin;
      s.lp_out = lp_out.empty()
                     ? nullptr
                     : reinterpret_cast<bf16_t*>(lp_out[i].data_ptr<at::BFloat16>()) + begin;
      s.numel = std::min(kChunk, numel - begin);
      s.param_type = type;
      spans.push_back(s);
      span_tensor.push_back(i);
    }
    total += numel;
  }

  // Below one chunk of work a parallel region costs more than it saves.
  const int64_t grain = total <= kChunk ? static_cast<int64_t>(spans.size()) : 1;
  std::vector<char> finite(spans.size(), 1);
  at::parallel_for(0, static_cast<int64_t>(spans.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) finite[i] = kernel(spans[i], hypers[span_tensor[i]]);
  });
  return std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
}

// The L2 norm of every value of `tensors` together (a total gradient norm): float32 or bf16
// contiguous CPU tensors, cut into chunks summed on torch's intra-op threads in float vector
// accumulators, the chunks' sums added in double.
double l2_norm(const std::vector<at::Tensor>& tensors, const std::string& isa) {
  const SumOfSquaresFn kernel = resolve_isa(isa).sum_of_squares;
  struct Chunk {
    const char* data;
    int64_t n;
    ParamType type;
  };
  std::vector<Chunk> chunks;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "fused_adam_cpu.l2_norm: tensors must be contiguous float32 or bfloat16 CPU tensors, got ",
                t.scalar_type(), " on ", t.device());
    const ParamType type = t.scalar_type() == at::kBFloat16 ? ParamType::kBFloat16 : ParamType::kFloat32;
    const int64_t elem = static_cast<int64_t>(t.element_size());
    for (int64_t begin = 0; begin < t.numel(); begin += kChunk) {
      chunks.push_back({static_cast<const char*>(t.data_ptr()) + begin * elem, std::min(kChunk, t.numel() - begin),
                        type});
    }
  }
  std::vector<double> sums(chunks.size(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sums[i] = kernel(chunks[i].data, chunks[i].n, chunks[i].type);
  });
  double total = 0.0;
  for (const double x : sums) total += x;
  return std::sqrt(total);
}

}  // namespace
}  // namespace rlhf_adam

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused Adam/AdamW step for CPU tensors (AVX-512 / AVX2 / scalar, OpenMP)";
  m.def("adam_step", &rlhf_adam::adam_step, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("masters"), py::arg("lp_out"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adam_w_mode"), py::arg("isa") = "auto", py::arg("grad_scale") = 1.0,
        "One Adam/AdamW step over flat lists of contiguous CPU tensors (empty masters/lp_out "
        "lists mean none), each gradient read times grad_scale (gradient clipping's coefficient); "
        "increments each param's step counter first. Returns whether every updated value is finite.",
        py::call_guard<py::gil_scoped_release>());
  m.def("l2_norm", &rlhf_adam::l2_norm, py::arg("tensors"), py::arg("isa") = "auto",
        "The L2 norm of every value of the tensors together (contiguous float32 / bfloat16 CPU tensors): "
        "a total gradient norm in one parallel pass, chunks summed in double.",
        py::call_guard<py::gil_scoped_release>());
  m.def("supported_isas", &rlhf_adam::supported_isas,
        "Kernels this CPU can run, widest last (scalar, avx2, avx512).");
  m.def("best_isa", &rlhf_adam::best_isa, "The kernel isa='auto' picks on this CPU.");
}
