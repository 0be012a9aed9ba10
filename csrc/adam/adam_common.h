// Types shared by the CPU and CUDA fused Adam/AdamW kernels. Free of torch and of CUDA headers,
// so that the .cu kernels build with nvcc alone and the CPU kernels with a plain C++ compiler.
#pragma once

#include <cmath>
#include <cstdint>

namespace rlhf_adam {

// bfloat16 storage: the upper 16 bits of an IEEE float32. A struct (not a bare uint16_t) so that
// overloads can tell a bf16 pointer from an int16 one.
struct bf16_t {
  uint16_t bits;
};

enum class ParamType : int { kFloat32 = 0, kBFloat16 = 1 };

// Per-call constants of one Adam step, computed once on the host (in double, like torch does
// with Python floats) and rounded to float for the kernels.
struct AdamHyper {
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float decay;                  // 1 - lr * weight_decay (AdamW), 1 otherwise
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float grad_scale;             // the gradient is read times this (gradient clipping's coefficient)
  bool l2;                      // Adam with weight decay: grad += weight_decay * param
  bool decoupled;               // AdamW with weight decay: param *= decay
  bool scaled;                  // grad_scale != 1
};

// Mirrors torch.optim.Adam(W)'s non-capturable path: bias corrections in double from the step.
// `grad_scale` multiplies each gradient element as it is read, as torch's gradient clipping
// multiplies the gradients in place before the step (a float32 product: the same bits).
inline AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, int64_t step, bool adam_w_mode, double grad_scale = 1.0) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamHyper h{};
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.decoupled = adam_w_mode && weight_decay != 0.0;
  h.l2 = !adam_w_mode && weight_decay != 0.0;
  h.decay = h.decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  h.neg_step_size = static_cast<float>(-lr / bias_correction1);
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  h.grad_scale = static_cast<float>(grad_scale);
  h.scaled = h.grad_scale != 1.0f;
  return h;
}

}  // namespace rlhf_adam
