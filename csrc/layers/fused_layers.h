// Fused kernels of a Llama-family decoder layer for training and teacher-forced forwards:
// RMSNorm, rotary position embedding (RoPE), SwiGLU and attention, each forward and backward, and
// a matrix transpose (for a linear's weight gradient, engine/cpu_matmul.py), one set per ISA
// (scalar, AVX2, AVX-512). engine/fused_layers.py holds their PyTorch references (the transpose's,
// x.t().contiguous(), is in engine/layer_op.py).
//
// These files hold no torch code: fused_layers.cpp checks the tensors and hands row or element
// ranges of float32 buffers to these kernels on torch's intra-op threads.
#pragma once

#include <cstdint>

#include "../common/prefetch.h"

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

// The keys one mask row (a query of one mask batch row) sees: [start, end), every one of them
// when `contiguous` (causal, left padding: the kernels then read none of its bytes), else those
// of its mask bytes that are nonzero, none of [gap_start, gap_end) (its first run of unseen keys
// after `start`: a packed row's keys between its shared prompt and its own tokens, which blocks
// of such rows skip). end 0: it sees none.
struct MaskRowSpan {
  int32_t start, end;
  int32_t contiguous;
  int32_t gap_start, gap_end;
  int32_t unused;
};

// Attention of one (batch row, KV head) task: its query heads over its keys, in the layouts
// q [batch, heads, seq, head_dim], k [batch, kv_heads, keys, head_dim] (contiguous) and v of k's
// shape with any strides but a contiguous last dim (a value projection's [batch, keys, kv_heads,
// head_dim] seen transposed needs no copy), with either causal visibility (key j visible to query
// i when j <= i) or a boolean mask [batch or 1, 1, seq, keys] (nonzero = visible). A query that
// sees no key gets zeros.
//
// With RoPE tables (cos non-null) the kernels rotate the heads themselves: q and k are then the
// projections' rows before RoPE, token-major (q [batch, seq, heads, head_dim], k [batch, keys,
// kv_heads, head_dim], keys == seq), rotated as rope_forward rotates them (cos/sin [batch or 1, seq,
// head_dim]), and their gradients come back in those layouts with RoPE's transpose applied: no
// separate RoPE pass over the activations, forward or backward.
struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  const uint8_t* mask;        // null: causal
  int64_t mask_batch_stride;  // 0 when one mask serves the whole batch
  const MaskRowSpan* mask_rows;  // with a mask: its rows' spans, [mask batch][seq]
  int64_t batch, heads, kv_heads, seq, keys, head_dim;
  float scale;
  int64_t v_stride[3];        // v's strides (floats) over batch, kv head, key
  int64_t gv_stride[3];       // backward: the value gradient's, likewise
  const float* cos = nullptr;  // RoPE inside the kernels (see above); null: q / k are rotated already
  const float* sin = nullptr;
  int64_t table_batch_stride = 0;  // 0 when one table serves the whole batch
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
  // Tasks [begin, end) of batch * kv_heads: out [batch, seq, heads, head_dim] (the layout the
  // output projection reads) = softmax(scale * q k^T) v over visible keys; stats [batch, heads, seq, 2]
  // = each row's max of the visible scaled scores and 1 / sum exp(score - max) (-inf, 0 for a query
  // that sees nothing): its softmax is exp(score - max) * that, with no logarithm to take.
  void (*attention_forward)(const AttentionArgs& a, float* out, float* stats, int64_t begin, int64_t end);
  // The same tasks' gradients from gout [batch, seq, heads, head_dim], with the forward's out and
  // stats: gq like q, gk and gv like k and v (each task owns its KV head's rows of gk and gv).
  void (*attention_backward)(const AttentionArgs& a, const float* out, const float* stats, const float* gout, float* gq,
                             float* gk, float* gv, int64_t begin, int64_t end);
  // Rows [begin, end) of x [rows, cols] into out [cols, rows]: out[c * rows + r] = x[r * cols + c].
  void (*transpose)(const float* x, int64_t rows, int64_t cols, float* out, int64_t begin, int64_t end);
};

const LayerKernels& scalar_layer_kernels();
const LayerKernels& avx2_layer_kernels();
const LayerKernels& avx512_layer_kernels();

}  // namespace rlhf_layers
