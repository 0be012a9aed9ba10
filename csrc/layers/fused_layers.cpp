// Torch binding of the fused layer ops (module `rlhf_fused_layers`): RMSNorm, RoPE, SwiGLU and
// attention of Llama-family decoder layers, forward and backward, float32 on the CPU.
//
// A decoder layer's eager forward spends as long in these elementwise ops as in half of its
// matmuls at small widths: HF's RMSNorm is five passes over the hidden states, RoPE seven over
// q and k plus a transposed copy, SwiGLU two over the MLP's widest activations, and autograd
// doubles each in backward. Each op here is one pass (RMSNorm's backward two), on torch's
// intra-op threads. engine/fused_layers.py wraps them in autograd Functions and holds the
// PyTorch references they must match (tests/test_fused_layers.py).
//
// Narrow includes instead of <torch/extension.h> keep the JIT build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/cpu_features.h"
#include "fused_layers.h"

namespace rlhf_layers {
namespace {

constexpr int64_t kGrainElements = 1 << 15;  // elements per parallel chunk, at least

std::vector<std::string> supported_isas() {
  std::vector<std::string> isas{"scalar"};
  if (rlhf::cpu_has_avx2()) isas.emplace_back("avx2");
  if (rlhf::cpu_has_avx2() && rlhf::cpu_has_avx512()) isas.emplace_back("avx512");
  return isas;
}

const LayerKernels& resolve_isa(const std::string& requested) {
  const std::string chosen = requested == "auto" ? supported_isas().back() : requested;
  if (chosen == "avx512") {
    TORCH_CHECK(rlhf::cpu_has_avx2() && rlhf::cpu_has_avx512(), "rlhf_fused_layers: this CPU has no AVX-512");
    return avx512_layer_kernels();
  }
  if (chosen == "avx2") {
    TORCH_CHECK(rlhf::cpu_has_avx2(), "rlhf_fused_layers: this CPU has no AVX2/FMA");
    return avx2_layer_kernels();
  }
  TORCH_CHECK(chosen == "scalar", "rlhf_fused_layers: unknown or unsupported isa '", requested,
              "' (supported: auto, ", c10::Join(", ", supported_isas()), ")");
  return scalar_layer_kernels();
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "rlhf_fused_layers: ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "rlhf_fused_layers: ", name, " must be contiguous");
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// x [..., dim], w [dim] -> (y like x, rstd [rows]).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps,
                                                    const std::string& isa) {
  check_float_cpu(x, "x");
  check_float_cpu(w, "weight");
  const int64_t dim = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim, "rlhf_fused_layers: rms_norm x's last dim ", x.size(-1),
              " != weight size ", dim);
  const LayerKernels& k = resolve_isa(isa);
  const int64_t rows = x.numel() / std::max<int64_t>(1, dim);
  at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    k.rms_norm_forward(xp, wp, yp, rp, begin, end, dim, static_cast<float>(eps));
  });
  return {y, rstd};
}

// -> (gx like x, gw [dim]). gw sums per-chunk partials, one row of `partials` per chunk.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd, const std::string& isa) {
  check_float_cpu(gy, "grad");
  check_float_cpu(x, "x");
  check_float_cpu(w, "weight");
  check_float_cpu(rstd, "rstd");
  const int64_t dim = w.numel(), rows = x.numel() / std::max<int64_t>(1, dim);
  TORCH_CHECK(gy.sizes() == x.sizes() && rstd.numel() == rows, "rlhf_fused_layers: rms_norm_backward shapes differ");
  const LayerKernels& k = resolve_isa(isa);
  at::Tensor gx = at::empty_like(x);
  const int64_t grain = grain_rows(dim);
  const int64_t chunks = std::max<int64_t>(1, (rows + grain - 1) / grain);
  at::Tensor partials = at::zeros({chunks, dim}, x.options());
  const float *gyp = gy.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float *gxp = gx.data_ptr<float>(), *pp = partials.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      k.rms_norm_backward(gyp, xp, wp, rp, gxp, pp + c * dim, c * grain, std::min(rows, (c + 1) * grain), dim);
    }
  });
  return {gx, partials.sum(0)};
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.sizes() == b.sizes(), "rlhf_fused_layers: ", what, " shapes differ: ", a.sizes(), " vs ", b.sizes());
}

at::Tensor swiglu_forward(const at::Tensor& g, const at::Tensor& u, const std::string& isa) {
  check_float_cpu(g, "gate");
  check_float_cpu(u, "up");
  check_same(g, u, "swiglu gate/up");
  const LayerKernels& k = resolve_isa(isa);
  at::Tensor y = at::empty_like(g);
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, g.numel(), kGrainElements, [&](int64_t b, int64_t e) { k.swiglu_forward(gp, up, yp, b, e); });
  return y;
}

// in_place: the gradients overwrite g and u (saved activations that nothing reads after this backward;
// the write lands on lines the kernel has just read, instead of fresh buffers faulted in and read for ownership).
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gy, const at::Tensor& g, const at::Tensor& u,
                                                   const std::string& isa, bool in_place) {
  check_float_cpu(gy, "grad");
  check_float_cpu(g, "gate");
  check_float_cpu(u, "up");
  check_same(g, u, "swiglu gate/up");
  check_same(g, gy, "swiglu grad");
  const LayerKernels& k = resolve_isa(isa);
  TORCH_CHECK(!in_place || (!g.is_same(u) && !g.is_same(gy) && !u.is_same(gy)),
              "rlhf_fused_layers: swiglu_backward in place needs separate grad, gate and up tensors");
  at::Tensor gg = in_place ? g : at::empty_like(g), gu = in_place ? u : at::empty_like(u);
  const float *gyp = gy.data_ptr<float>(), *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float *ggp = gg.data_ptr<float>(), *gup = gu.data_ptr<float>();
  at::parallel_for(0, g.numel(), kGrainElements,
                   [&](int64_t b, int64_t e) { k.swiglu_backward(gyp, gp, up, ggp, gup, b, e); });
  return {gg, gu};
}

// cos/sin [batch or 1, seq, head_dim] against rows of [batch, seq, ...].
RopeArgs rope_args(const at::Tensor& cos, const at::Tensor& sin, int64_t batch, int64_t seq, int64_t heads,
                   int64_t head_dim) {
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  check_same(cos, sin, "rope cos/sin");
  TORCH_CHECK(head_dim % 2 == 0, "rlhf_fused_layers: rope head_dim must be even, got ", head_dim);
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == batch || cos.size(0) == 1) && cos.size(1) == seq &&
                  cos.size(2) == head_dim,
              "rlhf_fused_layers: rope tables have shape ", cos.sizes(), ", expected [", batch, " or 1, ", seq, ", ",
              head_dim, "]");
  return RopeArgs{cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0) == 1 ? 0 : seq * head_dim, seq, heads,
                  head_dim};
}

// x [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim].
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                        const std::string& isa) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && heads > 0 && x.size(2) % heads == 0,
              "rlhf_fused_layers: rope x must be [batch, seq, heads * head_dim], got ", x.sizes());
  const int64_t batch = x.size(0), seq = x.size(1), head_dim = x.size(2) / heads;
  const RopeArgs a = rope_args(cos, sin, batch, seq, heads, head_dim);
  const LayerKernels& k = resolve_isa(isa);
  at::Tensor out = at::empty({batch, heads, seq, head_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * seq, grain_rows(x.size(2)), [&](int64_t b, int64_t e) { k.rope_forward(a, xp, op, b, e); });
  return out;
}

// gout [batch, heads, seq, head_dim] -> gx [batch, seq, heads * head_dim].
at::Tensor rope_backward(const at::Tensor& gout, const at::Tensor& cos, const at::Tensor& sin,
                         const std::string& isa) {
  check_float_cpu(gout, "grad");
  TORCH_CHECK(gout.dim() == 4, "rlhf_fused_layers: rope grad must be [batch, heads, seq, head_dim], got ", gout.sizes());
  const int64_t batch = gout.size(0), heads = gout.size(1), seq = gout.size(2), head_dim = gout.size(3);
  const RopeArgs a = rope_args(cos, sin, batch, seq, heads, head_dim);
  const LayerKernels& k = resolve_isa(isa);
  at::Tensor gx = at::empty({batch, seq, heads * head_dim}, gout.options());
  const float* gp = gout.data_ptr<float>();
  float* xp = gx.data_ptr<float>();
  at::parallel_for(0, batch * seq, grain_rows(heads * head_dim),
                   [&](int64_t b, int64_t e) { k.rope_backward(a, gp, xp, b, e); });
  return gx;
}

// 8 mask bytes as one word (bool bytes are 0 or 1).
inline uint64_t mask_word(const uint8_t* m) {
  uint64_t w;
  std::memcpy(&w, m, sizeof(w));
  return w;
}

// The span of keys one mask row sees (see MaskRowSpan), scanning 8 bytes at a time.
MaskRowSpan mask_row_span(const uint8_t* m, int64_t keys) {
  int64_t end = keys, start = 0;
  while (end >= 8 && mask_word(m + end - 8) == 0) end -= 8;
  while (end > 0 && m[end - 1] == 0) --end;
  while (start + 8 <= end && mask_word(m + start) == 0) start += 8;
  while (start < end && m[start] == 0) ++start;
  constexpr uint64_t kOnes = 0x0101010101010101ull, kHighs = 0x8080808080808080ull;
  bool contiguous = true;
  int64_t j = start;
  for (; contiguous && j + 8 <= end; j += 8) {
    const uint64_t w = mask_word(m + j);
    contiguous = ((w - kOnes) & ~w & kHighs) == 0;  // no zero byte among the 8
  }
  for (; contiguous && j < end; ++j) contiguous = m[j] != 0;
  int64_t gap_start = 0, gap_end = 0;
  if (!contiguous) {  // the first unseen key after start, then the next seen one (end - 1 is seen)
    gap_start = start;
    while (m[gap_start] != 0) ++gap_start;
    gap_end = gap_start;
    while (gap_end + 8 <= end && mask_word(m + gap_end) == 0) gap_end += 8;
    while (m[gap_end] == 0) ++gap_end;
  }
  return {static_cast<int32_t>(start), static_cast<int32_t>(end), contiguous ? 1 : 0,
          static_cast<int32_t>(gap_start), static_cast<int32_t>(gap_end), 0};
}

// Every row's span of a bool mask [mask batch, 1, seq, keys], as int32 [mask batch * seq, 6].
at::Tensor mask_row_spans(const at::Tensor& mask) {
  static_assert(sizeof(MaskRowSpan) == 6 * sizeof(int32_t), "MaskRowSpan is six int32");
  TORCH_CHECK(mask.defined() && mask.device().is_cpu() && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                  mask.dim() == 4 && mask.size(1) == 1 && mask.size(3) < (int64_t{1} << 31),
              "rlhf_fused_layers: mask_spans wants a contiguous bool CPU mask [B or 1, 1, T, S]");
  const int64_t rows = mask.size(0) * mask.size(2), keys = mask.size(3);
  at::Tensor spans = at::empty({rows, 6}, mask.options().dtype(at::kInt));
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask.data_ptr());
  auto* out = reinterpret_cast<MaskRowSpan*>(spans.data_ptr<int32_t>());
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(keys, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) out[r] = mask_row_span(m + r * keys, keys);
  });
  return spans;
}

// q [batch, heads, seq, head_dim], k/v [batch, kv_heads, keys, head_dim]; mask: undefined
// (causal, keys == seq) or bool [batch or 1, 1, seq, keys], whose row spans are `spans` (the
// caller's `mask_spans(mask)` of an earlier call, or computed here; kept alive by the caller while
// the kernels run).
//
// With RoPE tables cos/sin [batch or 1, seq, head_dim] (defined), q [B, T, H, D] and k [B, S, Hkv, D] are
// token-major and not yet rotated: the kernels rotate them (self-attention: S == T).
AttentionArgs attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                             double scale, at::Tensor& spans, const at::Tensor& cos = at::Tensor(),
                             const at::Tensor& sin = at::Tensor()) {
  check_float_cpu(q, "query");
  check_float_cpu(k, "key");
  TORCH_CHECK(v.defined() && v.device().is_cpu() && v.scalar_type() == at::kFloat && v.dim() == 4 && v.stride(3) == 1,
              "rlhf_fused_layers: value must be a 4-D float32 CPU tensor whose last dim is contiguous");
  const bool rope = cos.defined();
  const int64_t head_axis = rope ? 2 : 1, seq_axis = rope ? 1 : 2;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(3) == k.size(3) &&
                  k.size(head_axis) > 0 && q.size(head_axis) % k.size(head_axis) == 0 && v.size(0) == k.size(0) &&
                  v.size(1) == k.size(head_axis) && v.size(2) == k.size(seq_axis) && v.size(3) == k.size(3),
              "rlhf_fused_layers: attention wants q [B, H, T, D] and k, v [B, Hkv, S, D] (with RoPE inside: q [B, T, H, D], "
              "k [B, S, Hkv, D]) with H a multiple of Hkv; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t batch = q.size(0), seq = q.size(seq_axis), keys = k.size(seq_axis);
  const uint8_t* mask_ptr = nullptr;
  int64_t mask_stride = 0;
  if (mask.defined()) {
    TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 4 &&
                    (mask.size(0) == 1 || mask.size(0) == batch) && mask.size(1) == 1 && mask.size(2) == seq &&
                    mask.size(3) == keys,
                "rlhf_fused_layers: attention mask must be a contiguous bool CPU tensor [", batch, " or 1, 1, ", seq,
                ", ", keys, "], got ", mask.sizes(), " ", mask.scalar_type());
    mask_ptr = reinterpret_cast<const uint8_t*>(mask.data_ptr());
    mask_stride = mask.size(0) == 1 ? 0 : seq * keys;
    TORCH_CHECK(keys < (int64_t{1} << 31), "rlhf_fused_layers: attention over 2^31 keys or more");
    if (spans.defined()) {
      TORCH_CHECK(spans.scalar_type() == at::kInt && spans.is_contiguous() && spans.dim() == 2 &&
                      spans.size(0) == mask.size(0) * seq && spans.size(1) == 6,
                  "rlhf_fused_layers: spans must be mask_spans(mask), int32 [", mask.size(0) * seq, ", 6]");
    } else {
      spans = mask_row_spans(mask);
    }
  } else {
    TORCH_CHECK(keys == seq, "rlhf_fused_layers: causal attention (no mask) needs as many keys as queries, got ", keys,
                " and ", seq);
  }
  const auto* span_ptr = spans.defined() ? reinterpret_cast<const MaskRowSpan*>(spans.data_ptr<int32_t>()) : nullptr;
  AttentionArgs a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask_ptr, mask_stride, span_ptr,
                  batch, q.size(head_axis), k.size(head_axis), seq, keys, q.size(3), static_cast<float>(scale), {}, {}};
  for (int i = 0; i < 3; ++i) a.v_stride[i] = a.gv_stride[i] = v.stride(i);
  if (rope) {
    TORCH_CHECK(keys == seq, "rlhf_fused_layers: attention with RoPE inside is self-attention, got ", keys,
                " keys for ", seq, " queries");
    const RopeArgs r = rope_args(cos, sin, batch, seq, a.heads, a.head_dim);
    a.cos = r.cos;
    a.sin = r.sin;
    a.table_batch_stride = r.table_batch_stride;
  }
  return a;
}

// -> (out [batch, seq, heads, head_dim], stats [batch, heads, seq, 2]: each row's score max and 1 / sum).
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::optional<at::Tensor>& mask, double scale,
                                                     const std::string& isa, const std::optional<at::Tensor>& mask_spans,
                                                     const std::optional<at::Tensor>& cos,
                                                     const std::optional<at::Tensor>& sin) {
  at::Tensor spans = mask_spans.value_or(at::Tensor());
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rlhf_fused_layers: RoPE needs both cos and sin");
  const AttentionArgs a = attention_args(q, k, v, mask.value_or(at::Tensor()), scale, spans, cos.value_or(at::Tensor()),
                                         sin.value_or(at::Tensor()));
  const LayerKernels& kernels = resolve_isa(isa);
  at::Tensor out = at::empty({a.batch, a.seq, a.heads, a.head_dim}, q.options());
  at::Tensor stats = at::empty({a.batch, a.heads, a.seq, 2}, q.options());
  float *op = out.data_ptr<float>(), *sp = stats.data_ptr<float>();
  at::parallel_for(0, a.batch * a.kv_heads, 1, [&](int64_t b, int64_t e) { kernels.attention_forward(a, op, sp, b, e); });
  return {out, stats};
}

// -> (grad_q, grad_k, grad_v) from grad_out [batch, seq, heads, head_dim].
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, const at::Tensor& out, const at::Tensor& stats, double scale,
    const std::string& isa, const std::optional<at::Tensor>& mask_spans, const std::optional<at::Tensor>& cos,
    const std::optional<at::Tensor>& sin) {
  at::Tensor spans = mask_spans.value_or(at::Tensor());
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rlhf_fused_layers: RoPE needs both cos and sin");
  AttentionArgs a = attention_args(q, k, v, mask.value_or(at::Tensor()), scale, spans, cos.value_or(at::Tensor()),
                                   sin.value_or(at::Tensor()));
  check_float_cpu(grad, "grad");
  check_float_cpu(out, "out");
  check_float_cpu(stats, "stats");
  TORCH_CHECK(grad.sizes() == out.sizes() && out.dim() == 4 && out.size(0) == a.batch && out.size(1) == a.seq &&
                  out.size(2) == a.heads && out.size(3) == a.head_dim && stats.numel() == 2 * a.batch * a.heads * a.seq,
              "rlhf_fused_layers: attention_backward shapes differ from the forward's");
  const LayerKernels& kernels = resolve_isa(isa);
  // The value gradient in the value's layout where that is dense (a transposed projection), else contiguous.
  at::Tensor gq = at::empty_like(q), gk = at::empty_like(k), gv = at::empty_like(v);
  for (int i = 0; i < 3; ++i) a.gv_stride[i] = gv.stride(i);
  TORCH_CHECK(gv.stride(3) == 1, "rlhf_fused_layers: value gradient layout");
  const float *op = out.data_ptr<float>(), *sp = stats.data_ptr<float>(), *gp = grad.data_ptr<float>();
  float *gqp = gq.data_ptr<float>(), *gkp = gk.data_ptr<float>(), *gvp = gv.data_ptr<float>();
  at::parallel_for(0, a.batch * a.kv_heads, 1,
                   [&](int64_t b, int64_t e) { kernels.attention_backward(a, op, sp, gp, gqp, gkp, gvp, b, e); });
  return {gq, gk, gv};
}

// x [rows, cols] -> its transpose [cols, rows], contiguous. The threads take blocks of whole
// register tiles (16 rows: a multiple of every kernel set's width).
at::Tensor transpose(const at::Tensor& x, const std::string& isa) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, "rlhf_fused_layers: transpose takes a matrix, got ", x.dim(), " dims");
  const LayerKernels& k = resolve_isa(isa);
  const int64_t rows = x.size(0), cols = x.size(1), tile = 16;
  at::Tensor out = at::empty({cols, rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, grain_rows(cols) / tile);
  at::parallel_for(0, (rows + tile - 1) / tile, grain, [&](int64_t b, int64_t e) {
    k.transpose(xp, rows, cols, op, b * tile, std::min(rows, e * tile));
  });
  return out;
}

}  // namespace
}  // namespace rlhf_layers

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace L = rlhf_layers;
  m.doc() = "Fused RMSNorm / RoPE / SwiGLU / attention forward and backward of Llama-family layers, and a "
            "transpose, float32 on the CPU";
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm_forward", &L::rms_norm_forward, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("isa") = "auto", "-> (y, rstd)", release);
  m.def("rms_norm_backward", &L::rms_norm_backward, py::arg("grad"), py::arg("x"), py::arg("weight"), py::arg("rstd"),
        py::arg("isa") = "auto", "-> (grad_x, grad_weight)", release);
  m.def("swiglu_forward", &L::swiglu_forward, py::arg("gate"), py::arg("up"), py::arg("isa") = "auto",
        "silu(gate) * up", release);
  m.def("swiglu_backward", &L::swiglu_backward, py::arg("grad"), py::arg("gate"), py::arg("up"),
        py::arg("isa") = "auto", py::arg("in_place") = false,
        "-> (grad_gate, grad_up); in_place: written over gate and up", release);
  m.def("rope_forward", &L::rope_forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
        py::arg("isa") = "auto", "[batch, seq, heads * head_dim] -> rotated [batch, heads, seq, head_dim]", release);
  m.def("rope_backward", &L::rope_backward, py::arg("grad"), py::arg("cos"), py::arg("sin"), py::arg("isa") = "auto",
        "[batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]", release);
  m.def("mask_spans", &L::mask_row_spans, py::arg("mask"),
        "bool mask [B or 1, 1, T, S] -> its rows' spans (int32 [B or 1 * T, 6]), for the attention calls that share it",
        release);
  m.def("attention_forward", &L::attention_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("scale"), py::arg("isa") = "auto", py::arg("spans") = py::none(), py::arg("cos") = py::none(),
        py::arg("sin") = py::none(),
        "q [B, H, T, D], k/v [B, Hkv, S, D] (v: any strides, last dim contiguous), mask None (causal) or bool [B or 1, 1, T, S] (spans: mask_spans(mask), else computed) -> (out [B, T, H, D], stats [B, H, T, 2]); with RoPE tables cos/sin [B or 1, T, D], q [B, T, H, D] and k [B, S, Hkv, D] are token-major and rotated by the kernels",
        release);
  m.def("attention_backward", &L::attention_backward, py::arg("grad"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mask"), py::arg("out"), py::arg("stats"), py::arg("scale"), py::arg("isa") = "auto",
        py::arg("spans") = py::none(), py::arg("cos") = py::none(), py::arg("sin") = py::none(),
        "-> (grad_q, grad_k, grad_v), in q's, k's and v's layouts (with RoPE tables: gradients before RoPE)", release);
  m.def("transpose", &L::transpose, py::arg("x"), py::arg("isa") = "auto",
        "x [rows, cols] -> x.t().contiguous() [cols, rows]", release);
  m.def("supported_isas", &L::supported_isas, "Kernels this CPU can run, widest last (scalar, avx2, avx512).");
}
