// Fused elementwise kernels of a Llama-family decoder layer for training and teacher-forced
// forwards: RMSNorm, rotary position embedding (RoPE) and SwiGLU, each forward and backward,
// one set per ISA (scalar, AVX2). engine/fused_layers.py holds their PyTorch references.
//
// These files hold no torch code: fused_layers.cpp checks the tensors and hands row or element
// ranges of float32 buffers to these kernels on torch's intra-op threads.
#pragma once

#include <cstdint>

namespace rlhf_layers {

// RoPE over rows (b, t) of a projection x [batch, seq, heads * head_dim] with its tables
// cos/sin [batch or 1, seq, head_dim]; the rotated heads are in [batch, heads, seq, head_dim]
// (the attention's layout), so no transposed copy follows.
struct RopeArgs {
  const float* cos;
  const float* sin;
  int64_t table_batch_stride;  // 0 when one table serves the whole batch
  int64_t seq, heads, head_dim;
};

struct LayerKernels {
  // y[r] = w * (x[r] * rstd[r]), rstd[r] = 1 / sqrt(mean(x[r]^2) + eps), rows [begin, end).
  void (*rms_norm_forward)(const float* x, const float* w, float* y, float* rstd, int64_t begin, int64_t end,
                           int64_t dim, float eps);
  // gx[r] = rstd * (gy*w - xhat * mean(gy*w*xhat)), xhat = x * rstd; gw_partial += gy * xhat.
  void (*rms_norm_backward)(const float* gy, const float* x, const float* w, const float* rstd, float* gx,
                            float* gw_partial, int64_t begin, int64_t end, int64_t dim);
  // y = silu(g) * u over elements [begin, end).
  void (*swiglu_forward)(const float* g, const float* u, float* y, int64_t begin, int64_t end);
  // gg = gy * u * s * (1 + g * (1 - s)), s = sigmoid(g); gu = gy * silu(g).
  void (*swiglu_backward)(const float* gy, const float* g, const float* u, float* gg, float* gu, int64_t begin,
                          int64_t end);
  // out[b, h, t] = x[b, t, h] * cos + rotate_half(x[b, t, h]) * sin for rows r = b * seq + t in [begin, end).
  void (*rope_forward)(const RopeArgs& a, const float* x, float* out, int64_t begin, int64_t end);
  // gx[b, t, h] = the transpose of rope_forward applied to gout[b, h, t], rows as above.
  void (*rope_backward)(const RopeArgs& a, const float* gout, float* gx, int64_t begin, int64_t end);
};

const LayerKernels& scalar_layer_kernels();
const LayerKernels& avx2_layer_kernels();

}  // namespace rlhf_layers
