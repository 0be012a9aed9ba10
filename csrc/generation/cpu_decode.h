// The CPU decode step's elementwise and attention kernels, one set per ISA (scalar, AVX2).
//
// These files hold no torch code: cpu_decode.cpp runs the matmuls through ATen (MKL) or, over
// weights packed in panels, through panel_gemm here, and hands row, column or task ranges of
// float32 buffers to these kernels on torch's intra-op threads.
#pragma once

#include <cstdint>

#include "../common/prefetch.h"

namespace rlhf_decode {

// One decode step of one layer's attention, for all (sequence, KV head) tasks.
struct AttentionArgs {
  const float* qkv;           // [batch, (heads + 2 * kv_heads) * head_dim]: q heads, k heads, v heads
  int64_t qkv_stride;         // elements between rows of qkv
  const float* cos;           // [cache_len, head_dim] RoPE cos table, row = position
  const float* sin_signed;    // [cache_len, head_dim] sin with its first half negated
  const int64_t* positions;   // [batch] position of this step's token
  const uint8_t* visible;     // [batch, visible_stride]: nonzero = key visible, keys [0, length]
  int64_t visible_stride;
  void* keys;                 // [batch, kv_heads, cache_len, head_dim] cache (float, or half bits where
  void* values;               // the cache is fp16: attention_half), written at `length`; values alike
  float* out;                 // [batch, heads * head_dim]
  int64_t heads, kv_heads, head_dim, cache_len;
  int64_t length;             // tokens cached before this step
  float scale;                // softmax scale applied to q.k
};

// Floats of scratch one attention task needs.
inline int64_t attention_scratch_floats(const AttentionArgs& a) {
  const int64_t groups = a.heads / a.kv_heads;
  return groups * (a.head_dim + (a.length + 16) / 16 * 16) + a.head_dim;  // keys padded to 16
}

// Columns of one panel of a packed weight: [panels, in, kPanelColumns] holds columns
// [p * kPanelColumns, (p + 1) * kPanelColumns) of an [in, out] weight, in after in, zero past `out`.
constexpr int64_t kPanelColumns = 16;

// PanelGemmArgs::read_once_rows_ahead of the decode step's projections: 48 rows of a panel (3 KiB)
// ahead. The tiny Llama's step (batch 32, cache 64-320, fp16 KV) 4-8% faster on a Zen 5 EPYC than
// without (24 rows ahead: 3%, 96: 2%), at batch 8 6%.
constexpr int64_t kDecodeWeightsAhead = 48;

// One projection of a decode step over a packed weight: out[r, c] = sum_k x[r, k] w[k, c] + bias[c]
// (`accumulate`: out[r, c] += that) for rows [0, rows) and columns [c0, c1), c0 a multiple of
// kPanelColumns. x is [rows, in] (rows `ldx` apart), out's rows `ldo` apart, bias null for none.
struct PanelGemmArgs {
  const float* x;
  int64_t ldx, rows, in;
  const float* panels;
  const float* bias;
  float* out;
  int64_t ldo;
  bool accumulate;
  // Weight rows (k) ahead of its multiply-adds that the first block of rows asks for with
  // prefetch_line_once (0: none): a decode step reads each weight once, and a normal fill of them
  // would push out of L3 the KV cache that the step's attention reads (kDecodeWeightsAhead).
  int64_t read_once_rows_ahead = 0;
  // panel_swiglu only: where the gate and up products are stored as well (stride ldo; nullptr: not
  // stored), for a backward that needs them.
  float* gate_out = nullptr;
  float* up_out = nullptr;
};

// A^T B over row-major A [K, M] and B [K, N] (a linear's output gradient dY and input X: its
// weight gradient dY^T X [M, N]) read straight from their rows: no transposes, no packing.
struct TnGemmArgs {
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* out;  // [M, N], row stride N
  int64_t m, n, k;
};

struct Kernels {
  // out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for rows [0, rows) of width dim.
  void (*rms_norm)(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps);
  // out[r * out_stride + i] = silu(gate[r * in_stride + i]) * up[r * in_stride + i], i < width.
  void (*silu_mul)(const float* gate, const float* up, int64_t in_stride, float* out, int64_t out_stride,
                   int64_t rows, int64_t width);
  // Tasks [begin, end) of batch * kv_heads (task = b * kv_heads + kv head): RoPE on this step's
  // key and queries, key and value written to the cache at `length`, then attention of the
  // kv head's query heads over visible keys [0, length]. `scratch`: attention_scratch_floats().
  void (*attention)(const AttentionArgs& a, int64_t begin, int64_t end, float* scratch);
  // The same over an fp16 cache (IEEE half bits): keys and values widened to float as they are read,
  // this step's rounded to nearest as they are written.
  void (*attention_half)(const AttentionArgs& a, int64_t begin, int64_t end, float* scratch);
  // One draw from softmax(logits / temperature) by inverse CDF with uniform u in [0, 1): the
  // first token whose running mass exceeds u * total, else the last token of positive mass
  // (engine/sampling.py's sample_from_logits contract). `mass`: vocab floats of scratch.
  int64_t (*sample_row)(const float* logits, int64_t vocab, float temperature, float u, float* mass);
  // Columns [c0, c1) of a projection over a packed weight (PanelGemmArgs); each output is one
  // multiply-add chain over k in order, then the bias, then (accumulate) the add into out.
  void (*panel_gemm)(const PanelGemmArgs& a, int64_t c0, int64_t c1);
  // Output columns [c0, c1) of silu(x @ gate) * (x @ up) over pack_swiglu_panels' pairs of panels
  // (a.bias unused): each product the same multiply-add chain as panel_gemm's, then silu_mul's math.
  void (*panel_swiglu)(const PanelGemmArgs& a, int64_t c0, int64_t c1);
  // Rows [m0, m1) of A^T B (TnGemmArgs; N a multiple of kPanelColumns): each output one
  // multiply-add chain over k in order, k taken in chunks that stay in L2.
  void (*tn_gemm)(const TnGemmArgs& t, int64_t m0, int64_t m1);
  // One packed panel (pack_panels) of a transposed view: column c of the panel is the `in` consecutive
  // floats at src + c * col_stride (a [out, in] weight's row), c < cols <= kPanelColumns, written as
  // dst[k * kPanelColumns + c]; dst's columns past `cols` are left as they are (pack_panel zeroes them).
  void (*pack_transposed)(const float* src, int64_t col_stride, int64_t in, int64_t cols, float* dst);
  // log softmax(row)[token] in float32: the row's maximum, then the log of the sum of exp(x - max)
  // (torch.logsumexp's math; the sum's order and exp's last bit differ).
  float (*row_logprob)(const float* row, int64_t vocab, int64_t token);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();    // only on x86-64 CPUs with AVX2 + FMA
const Kernels& avx512_kernels();  // AVX2's with an AVX-512 panel GEMM: only with AVX2 and AVX-512F

}  // namespace rlhf_decode
