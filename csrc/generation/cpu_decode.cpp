// Torch binding of the CPU decode step (module `rlhf_cpu_decode`): one call runs a whole
// decode step of a Llama-family model (Llama, Qwen2, Mistral) for float32 on the CPU.
//
// LlamaDecodeStep is built once per rollout over the weights engine/fast_decode.py gathers
// (q/k/v and gate/up fused and transposed, optional biases), its RoPE tables and its preallocated KV cache;
// step() then takes one token per sequence and returns the next-token logits. Per layer it
// runs four matmuls through ATen (MKL: two of them add straight into the residual stream) and
// three kernels of its own on torch's intra-op threads: RMSNorm, SiLU(gate) * up, and one
// pass that applies RoPE, writes the new key and value into the cache and attends, per
// (sequence, KV head). This replaces the ~40 small PyTorch ops a layer costs in Python, which
// dominate a decode step of a small model. fast_decode.py's Python step is the reference.
//
// With weights packed once per rollout (pack_panels: 16-column panels, `in` after `in`), the
// projections run panel_gemm instead of MKL: at a decode step's few rows MKL repacks every weight
// on every call, and on AMD CPUs (AVX2 kernels) that repacking is ~40% of its time.
//
// Narrow includes instead of <torch/extension.h> keep the JIT build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mm.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../common/cpu_features.h"
#include "cpu_decode.h"

namespace rlhf_decode {
namespace {

// input_norm, wqkv_t, bqkv, wo, bo, post_norm, w_gate_up_t, b_gate_up, w_down, b_down: the fused q/k/v and
// gate/up weights come transposed ([hidden, out] row-major; at a decode step's few rows MKL multiplies that
// layout without repacking it), the others as the model holds them ([out, in]).
constexpr int64_t kTensorsPerLayer = 10;

// The avx512 set is avx2's with an AVX-512 panel GEMM: it needs both.
bool cpu_has_avx512_set() { return rlhf::cpu_has_avx2() && rlhf::cpu_has_avx512(); }

// Probed once: resolve_isa runs on every sampling call ("auto").
const std::vector<std::string>& supported_isas() {
  static const std::vector<std::string> isas = [] {
    std::vector<std::string> found{"scalar"};
    if (rlhf::cpu_has_avx2()) found.emplace_back("avx2");
    if (cpu_has_avx512_set()) found.emplace_back("avx512");
    return found;
  }();
  return isas;
}

const Kernels& resolve_isa(const std::string& requested, std::string& chosen) {
  chosen = requested == "auto" ? supported_isas().back() : requested;
  if (chosen == "avx512") {
    TORCH_CHECK(cpu_has_avx512_set(), "rlhf_cpu_decode: this CPU has no AVX-512F");
    return avx512_kernels();
  }
  if (chosen == "avx2") {
    TORCH_CHECK(rlhf::cpu_has_avx2(), "rlhf_cpu_decode: this CPU has no AVX2/FMA");
    return avx2_kernels();
  }
  TORCH_CHECK(chosen == "scalar", "rlhf_cpu_decode: unknown or unsupported isa '", requested,
              "' (supported: auto, ", c10::Join(", ", supported_isas()), ")");
  return scalar_kernels();
}

void check_weight(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "rlhf_cpu_decode: ", name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.sizes() == shape, "rlhf_cpu_decode: ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.is_contiguous(), "rlhf_cpu_decode: ", name, " must be contiguous");
}

// A KV cache buffer: float32 or float16 (--kv-cache-dtype fp16), CPU, contiguous, like the first layer's.
void check_cache(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && (dtype == at::kFloat || dtype == at::kHalf) &&
                  t.scalar_type() == dtype,
              "rlhf_cpu_decode: ", name, " caches must be float32 or float16 CPU tensors, all of one dtype");
  TORCH_CHECK(t.sizes() == shape, "rlhf_cpu_decode: ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.is_contiguous(), "rlhf_cpu_decode: ", name, " must be contiguous");
}

// An empty tensor stands for "no bias".
at::Tensor optional_bias(const at::Tensor& t, const char* name, int64_t size) {
  if (!t.defined() || t.numel() == 0) return at::Tensor();
  check_weight(t, name, {size});
  return t;
}

// One projection: w_t [in, out] (a row- or column-major view), its bias (undefined: none) and,
// where the step runs packed weights, w_t packed in panels (pack_panels; undefined: MKL).
struct Projection {
  at::Tensor w_t, bias, panels;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate, up, down;
  float input_eps = 0, post_eps = 0;
};

int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_packable(const at::Tensor& w_t, const char* fn) {
  TORCH_CHECK(w_t.dim() == 2 && w_t.device().is_cpu() && w_t.scalar_type() == at::kFloat,
              "rlhf_cpu_decode.", fn, ": the weight must be a [in, out] float32 CPU tensor");
}

// Panel p of w_t [in, out] (any strides) into dst [in, kPanelColumns], zero past `out`. Reads in
// the source's own order: along a row of w_t where its columns are adjacent (a transposed copy),
// through the kernels' register transposes where its rows are (a [out, in] weight's rows, viewed
// transposed: Kernels::pack_transposed), else one float at a time down a column. Measured on a
// 2-core Zen 5 EPYC, a [1536, 576] weight viewed transposed (SmolLM2's gate): 0.21 -> 0.05 ms.
void pack_panel(const Kernels& kernels, const at::Tensor& w_t, int64_t p, float* dst) {
  const int64_t in = w_t.size(0), out = w_t.size(1);
  const int64_t row_stride = w_t.stride(0), col_stride = w_t.stride(1);
  const int64_t cols = std::min(kPanelColumns, out - p * kPanelColumns);
  const float* src = w_t.data_ptr<float>() + p * kPanelColumns * col_stride;
  if (cols < kPanelColumns) {
    for (int64_t k = 0; k < in; ++k)
      std::memset(dst + k * kPanelColumns + cols, 0, (kPanelColumns - cols) * sizeof(float));
  }
  if (col_stride == 1) {
    for (int64_t k = 0; k < in; ++k) std::memcpy(dst + k * kPanelColumns, src + k * row_stride, cols * sizeof(float));
  } else if (row_stride == 1) {
    kernels.pack_transposed(src, col_stride, in, cols, dst);
  } else {
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t k = 0; k < in; ++k) dst[k * kPanelColumns + c] = src[c * col_stride + k * row_stride];
  }
}

// w_t [in, out] (any strides) packed for panel_gemm: [ceil(out / 16), in, 16], zero past `out`;
// `isa` picks the kernels whose register transposes pack a transposed view (the same floats whichever).
at::Tensor pack_panels(const at::Tensor& w_t, const std::string& isa) {
  check_packable(w_t, "pack_panels");
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  const int64_t in = w_t.size(0), panels = divup(w_t.size(1), kPanelColumns);
  at::Tensor packed = at::empty({panels, in, kPanelColumns}, w_t.options());
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) pack_panel(kernels, w_t, p, dst + p * in * kPanelColumns);
  });
  return packed;
}

// A SwiGLU MLP's gate_t and up_t [in, ffn] packed for panel_swiglu: their panels interleaved,
// [2 ceil(ffn / 16), in, 16] (gate's panel q at 2q, up's at 2q + 1).
at::Tensor pack_swiglu_panels(const at::Tensor& gate_t, const at::Tensor& up_t, const std::string& isa) {
  check_packable(gate_t, "pack_swiglu_panels");
  check_packable(up_t, "pack_swiglu_panels");
  TORCH_CHECK(gate_t.sizes() == up_t.sizes(), "rlhf_cpu_decode.pack_swiglu_panels: gate and up differ in shape: ",
              gate_t.sizes(), " vs ", up_t.sizes());
  const int64_t in = gate_t.size(0), panels = divup(gate_t.size(1), kPanelColumns);
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  at::Tensor packed = at::empty({2 * panels, in, kPanelColumns}, gate_t.options());
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, 2 * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      pack_panel(kernels, p % 2 == 0 ? gate_t : up_t, p / 2, dst + p * in * kPanelColumns);
  });
  return packed;
}

// out = x @ w_t (+ bias): out and w_t are column slices of the full output and weight.
void linear_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w_t, const at::Tensor& bias) {
  if (bias.defined()) {
    at::addmm_out(out, bias, x, w_t);
  } else {
    at::mm_out(out, x, w_t);
  }
}

// residual += x @ w_t (+ bias): the GEMM accumulates into (a column slice of) the residual stream.
void add_linear(at::Tensor residual, const at::Tensor& x, const at::Tensor& w_t, const at::Tensor& bias) {
  residual.addmm_(x, w_t);
  if (bias.defined()) residual.add_(bias);
}

at::Tensor cols(const at::Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.narrow(t.dim() - 1, begin, end - begin) : t;
}

// fn(c0, c1) over slices of [0, columns) on torch's intra-op threads, one slice per thread
// (slices are multiples of kPanelColumns). A GEMM called inside a parallel region runs on one
// thread, so each thread multiplies its own slice of the weight: for the small GEMMs of a
// decode step this scales across cores far better than MKL threading each GEMM itself.
template <class Fn>
void for_column_chunks(int64_t columns, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = divup(divup(columns, threads), kPanelColumns) * kPanelColumns;
  at::parallel_for(0, divup(columns, chunk), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) fn(c * chunk, std::min(columns, (c + 1) * chunk));
  });
}

class LlamaDecodeStep {
 public:
  LlamaDecodeStep(const at::Tensor& embed, const std::vector<at::Tensor>& layer_tensors,
                  const std::vector<double>& layer_eps, const at::Tensor& norm, double norm_eps,
                  const at::Tensor& lm_head, const at::Tensor& lm_head_bias, const at::Tensor& cos,
                  const at::Tensor& sin_signed, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values, int64_t heads, int64_t kv_heads, double scale,
                  const std::string& isa, const std::vector<at::Tensor>& packed)
      : kernels_(resolve_isa(isa, isa_)), heads_(heads), kv_heads_(kv_heads), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(embed.dim() == 2, "rlhf_cpu_decode: embed must be [vocab, hidden]");
    vocab_ = embed.size(0);
    hidden_ = embed.size(1);
    check_weight(embed, "embed", {vocab_, hidden_});
    embed_ = embed;
    const int64_t num_layers = static_cast<int64_t>(keys.size());
    TORCH_CHECK(num_layers > 0 && values.size() == keys.size(), "rlhf_cpu_decode: one key and value cache per layer");
    TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == kTensorsPerLayer * num_layers,
                "rlhf_cpu_decode: expected ", kTensorsPerLayer, " tensors per layer");
    TORCH_CHECK(static_cast<int64_t>(layer_eps.size()) == 2 * num_layers, "rlhf_cpu_decode: two eps per layer");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "rlhf_cpu_decode: heads ", heads,
                " must be a multiple of kv_heads ", kv_heads);
    const at::Tensor& k0 = keys[0];
    TORCH_CHECK(k0.dim() == 4 && k0.size(1) == kv_heads, "rlhf_cpu_decode: caches must be [batch, kv_heads, len, head_dim]");
    batch_ = k0.size(0);
    cache_len_ = k0.size(2);
    head_dim_ = k0.size(3);
    TORCH_CHECK(head_dim_ % 2 == 0, "rlhf_cpu_decode: head_dim must be even (RoPE)");
    half_cache_ = k0.scalar_type() == at::kHalf;
    for (int64_t l = 0; l < num_layers; ++l) {
      check_cache(keys[l], "keys", k0.sizes(), k0.scalar_type());
      check_cache(values[l], "values", k0.sizes(), k0.scalar_type());
    }
    keys_ = keys;
    values_ = values;
    check_weight(cos, "cos", {cache_len_, head_dim_});
    check_weight(sin_signed, "sin_signed", {cache_len_, head_dim_});
    cos_ = cos;
    sin_signed_ = sin_signed;

    const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim_, attn_width = heads * head_dim_;
    const at::Tensor& w_gate_up0 = layer_tensors[6];
    TORCH_CHECK(w_gate_up0.dim() == 2 && w_gate_up0.size(1) % 2 == 0,
                "rlhf_cpu_decode: w_gate_up_t must be [hidden, 2 * ffn]");
    ffn_ = w_gate_up0.size(1) / 2;
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* t = layer_tensors.data() + kTensorsPerLayer * l;
      Layer layer;
      check_weight(t[0], "input_norm", {hidden_});
      check_weight(t[1], "wqkv_t", {hidden_, qkv_width});
      check_weight(t[3], "wo", {hidden_, attn_width});
      check_weight(t[5], "post_norm", {hidden_});
      check_weight(t[6], "w_gate_up_t", {hidden_, 2 * ffn_});
      check_weight(t[8], "w_down", {hidden_, ffn_});
      layer.input_norm = t[0];
      layer.qkv = {t[1], optional_bias(t[2], "bqkv", qkv_width)};
      layer.o = {t[3].t(), optional_bias(t[4], "bo", hidden_)};
      layer.post_norm = t[5];
      const at::Tensor b_gate_up = optional_bias(t[7], "b_gate_up", 2 * ffn_);
      layer.gate = {cols(t[6], 0, ffn_), cols(b_gate_up, 0, ffn_)};
      layer.up = {cols(t[6], ffn_, 2 * ffn_), cols(b_gate_up, ffn_, 2 * ffn_)};
      layer.down = {t[8].t(), optional_bias(t[9], "b_down", hidden_)};
      layer.input_eps = static_cast<float>(layer_eps[2 * l]);
      layer.post_eps = static_cast<float>(layer_eps[2 * l + 1]);
      layers_.push_back(std::move(layer));
    }
    check_weight(norm, "norm", {hidden_});
    norm_ = norm;
    norm_eps_ = static_cast<float>(norm_eps);
    TORCH_CHECK(lm_head.dim() == 2, "rlhf_cpu_decode: lm_head must be [vocab, hidden]");
    check_weight(lm_head, "lm_head", {lm_head.size(0), hidden_});
    lm_head_ = {lm_head.t(), optional_bias(lm_head_bias, "lm_head_bias", lm_head.size(0))};
    if (!packed.empty()) use_packed(packed);

    const auto f32 = embed.options();
    x_ = at::empty({batch_, hidden_}, f32);
    qkv_ = at::empty({batch_, qkv_width}, f32);
    attn_ = at::empty({batch_, attn_width}, f32);
    gate_up_ = at::empty({batch_, 2 * ffn_}, f32);
    gate_ = cols(gate_up_, 0, ffn_);
    up_ = cols(gate_up_, ffn_, 2 * ffn_);
    act_ = at::empty({batch_, ffn_}, f32);
  }

  // tokens [B] or [B, 1] int64; positions likewise; visible [B, >= length + 1] (nonzero = attend,
  // any integer or bool dtype); length = tokens already cached. Returns [B, vocab] logits.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& visible, int64_t length) {
    TORCH_CHECK(tokens.numel() == batch_ && tokens.scalar_type() == at::kLong && tokens.device().is_cpu(),
                "rlhf_cpu_decode: tokens must be ", batch_, " int64 CPU values");
    TORCH_CHECK(positions.numel() == batch_ && positions.scalar_type() == at::kLong && positions.device().is_cpu(),
                "rlhf_cpu_decode: positions must be ", batch_, " int64 CPU values");
    TORCH_CHECK(length >= 0 && length < cache_len_, "rlhf_cpu_decode: KV cache overflow: writing position ", length,
                " of ", cache_len_);
    TORCH_CHECK(visible.dim() == 2 && visible.size(0) == batch_ && visible.size(1) >= length + 1,
                "rlhf_cpu_decode: the attention mask must be [", batch_, ", >= ", length + 1, "], got ", visible.sizes());
    const at::Tensor token_ids = tokens.reshape({batch_}).contiguous();
    const at::Tensor pos = positions.reshape({batch_}).contiguous();
    const at::Tensor mask = (visible.scalar_type() == at::kBool ? visible : visible.ne(0)).contiguous();
    const int64_t* token_ptr = token_ids.data_ptr<int64_t>();
    const int64_t* pos_ptr = pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch_; ++b) {
      TORCH_CHECK(token_ptr[b] >= 0 && token_ptr[b] < vocab_, "rlhf_cpu_decode: token id ", token_ptr[b],
                  " outside the vocabulary [0, ", vocab_, ")");
      TORCH_CHECK(pos_ptr[b] >= 0 && pos_ptr[b] < cache_len_, "rlhf_cpu_decode: position ", pos_ptr[b],
                  " outside the RoPE table [0, ", cache_len_, ")");
    }

    float* x = x_.data_ptr<float>();
    const float* embed = embed_.data_ptr<float>();
    for (int64_t b = 0; b < batch_; ++b) {
      std::memcpy(x + b * hidden_, embed + token_ptr[b] * hidden_, hidden_ * sizeof(float));
    }
    ensure_thread_buffers();

    AttentionArgs args{};
    args.qkv = qkv_.data_ptr<float>();
    args.qkv_stride = qkv_.size(1);
    args.cos = cos_.data_ptr<float>();
    args.sin_signed = sin_signed_.data_ptr<float>();
    args.positions = pos_ptr;
    args.visible = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
    args.visible_stride = mask.size(1);
    args.out = attn_.data_ptr<float>();
    args.heads = heads_;
    args.kv_heads = kv_heads_;
    args.head_dim = head_dim_;
    args.cache_len = cache_len_;
    args.length = length;
    args.scale = scale_;
    const int64_t scratch_floats = attention_scratch_floats(args);

    float* gate_up = gate_up_.data_ptr<float>();
    float* act = act_.data_ptr<float>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      for_column_chunks(qkv_.size(1), [&](int64_t c0, int64_t c1) {
        project(normed(w.input_norm, w.input_eps), w.qkv, qkv_, c0, c1, false);
      });
      args.keys = keys_[l].data_ptr();
      args.values = values_[l].data_ptr();
      const auto attention = half_cache_ ? kernels_.attention_half : kernels_.attention;
      at::parallel_for(0, batch_ * kv_heads_, 1, [&](int64_t begin, int64_t end) {
        float* scratch = thread_scratch(scratch_floats);
        attention(args, begin, end, scratch);
      });
      for_column_chunks(hidden_, [&](int64_t c0, int64_t c1) { project(attn_, w.o, x_, c0, c1, true); });
      for_column_chunks(ffn_, [&](int64_t c0, int64_t c1) {
        const at::Tensor h = normed(w.post_norm, w.post_eps);
        project(h, w.gate, gate_, c0, c1, false);
        project(h, w.up, up_, c0, c1, false);
        kernels_.silu_mul(gate_up + c0, gate_up + ffn_ + c0, 2 * ffn_, act + c0, ffn_, batch_, c1 - c0);
      });
      for_column_chunks(hidden_, [&](int64_t c0, int64_t c1) { project(act_, w.down, x_, c0, c1, true); });
    }
    const int64_t vocab_out = lm_head_.w_t.size(1);
    at::Tensor logits = at::empty({batch_, vocab_out}, x_.options());
    for_column_chunks(vocab_out, [&](int64_t c0, int64_t c1) {
      project(normed(norm_, norm_eps_), lm_head_, logits, c0, c1, false);
    });
    return logits;
  }

  const std::string& isa() const { return isa_; }
  bool packed() const { return lm_head_.panels.defined(); }

 private:
  // The projections run panel_gemm over `packed`: per layer q/k/v, o, gate, up, down, then the LM
  // head, each pack_panels() of the projection's w_t.
  void use_packed(const std::vector<at::Tensor>& packed) {
    TORCH_CHECK(static_cast<int64_t>(packed.size()) == 5 * static_cast<int64_t>(layers_.size()) + 1,
                "rlhf_cpu_decode: expected 5 packed weights per layer and the LM head's");
    auto attach = [&](Projection& p, const at::Tensor& panels, const char* name) {
      const int64_t in = p.w_t.size(0), out = p.w_t.size(1);
      check_weight(panels, name, {(out + kPanelColumns - 1) / kPanelColumns, in, kPanelColumns});
      p.panels = panels;
    };
    for (size_t l = 0; l < layers_.size(); ++l) {
      const at::Tensor* t = packed.data() + 5 * l;
      attach(layers_[l].qkv, t[0], "packed q/k/v");
      attach(layers_[l].o, t[1], "packed o");
      attach(layers_[l].gate, t[2], "packed gate");
      attach(layers_[l].up, t[3], "packed up");
      attach(layers_[l].down, t[4], "packed down");
    }
    attach(lm_head_, packed.back(), "packed lm_head");
  }

  // out[:, c0:c1] = x @ p.w_t[:, c0:c1] + bias (`accumulate`: +=), out's column 0 being the
  // projection's: through panel_gemm where the weight is packed, else MKL on column slices.
  void project(const at::Tensor& x, const Projection& p, const at::Tensor& out, int64_t c0, int64_t c1,
               bool accumulate) const {
    if (p.panels.defined()) {
      PanelGemmArgs args{x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), p.panels.data_ptr<float>(),
                         p.bias.defined() ? p.bias.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                         out.stride(0), accumulate};
      args.read_once_rows_ahead = kDecodeWeightsAhead;
      kernels_.panel_gemm(args, c0, c1);
    } else if (accumulate) {
      add_linear(cols(out, c0, c1), x, cols(p.w_t, c0, c1), cols(p.bias, c0, c1));
    } else {
      linear_into(cols(out, c0, c1), x, cols(p.w_t, c0, c1), cols(p.bias, c0, c1));
    }
  }

  // Per-thread buffers, sized for the current thread count.
  void ensure_thread_buffers() {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    if (!thread_h_.defined() || thread_h_.size(0) < threads) {
      thread_h_ = at::empty({threads, batch_, hidden_}, x_.options());
      thread_scratch_.assign(threads, std::vector<float>());
    }
  }

  // The residual stream RMS-normalised into this thread's buffer (each thread of a region
  // needs all of it, and normalising 32 x hidden floats is cheaper than another region).
  at::Tensor normed(const at::Tensor& weight, float eps) const {
    at::Tensor h = thread_h_.select(0, at::get_thread_num());
    kernels_.rms_norm(x_.data_ptr<float>(), weight.data_ptr<float>(), h.data_ptr<float>(), batch_, hidden_, eps);
    return h;
  }

  float* thread_scratch(int64_t floats) {
    std::vector<float>& buffer = thread_scratch_[at::get_thread_num()];
    if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
    return buffer.data();
  }

  std::string isa_;
  const Kernels& kernels_;
  int64_t heads_, kv_heads_;
  float scale_;
  int64_t batch_ = 0, cache_len_ = 0, head_dim_ = 0, hidden_ = 0, vocab_ = 0, ffn_ = 0;
  at::Tensor embed_, cos_, sin_signed_, norm_;
  Projection lm_head_;
  float norm_eps_ = 0;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> keys_, values_;
  bool half_cache_ = false;  // the KV cache holds fp16 (attention_half), else float32
  at::Tensor x_, qkv_, attn_, gate_up_, gate_, up_, act_;
  at::Tensor thread_h_;                             // [threads, batch, hidden]
  std::vector<std::vector<float>> thread_scratch_;  // attention scratch per thread
};

// x [rows, in] @ w_t (+ bias) through the step's packed GEMM, `panels` being pack_panels(w_t) of an
// [in, out_features] weight: one slice of 16-column panels per intra-op thread, as the step's
// projections run (scripts/bench_ppo.py times it beside torch's matmul for the decode reference).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const std::optional<at::Tensor>& bias, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rlhf_cpu_decode.panel_linear: x must be a contiguous [rows, in] float32 CPU tensor");
  const int64_t in = x.size(1);
  TORCH_CHECK(out_features >= 1, "rlhf_cpu_decode.panel_linear: out_features must be >= 1, got ", out_features);
  check_weight(panels, "panels", {divup(out_features, kPanelColumns), in, kPanelColumns});
  if (bias.has_value() && bias->defined()) check_weight(*bias, "bias", {out_features});
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const PanelGemmArgs args{x.data_ptr<float>(), in, x.size(0), in, panels.data_ptr<float>(),
                           bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr,
                           out.data_ptr<float>(), out_features, false};
  for_column_chunks(out_features, [&](int64_t c0, int64_t c1) { kernels.panel_gemm(args, c0, c1); });
  return out;
}

// silu(x @ gate_t) * (x @ up_t) [rows, ffn] through panel_swiglu, `panels` being
// pack_swiglu_panels(gate_t, up_t): the SwiGLU MLP's activation without its two [rows, ffn]
// products ever written (`products`: written too, after it as [activation, gate, up], for a
// backward), one slice of output panels per intra-op thread.
std::vector<at::Tensor> swiglu_through_panels(const at::Tensor& x, const at::Tensor& panels, int64_t ffn,
                                              const std::string& isa, bool products) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rlhf_cpu_decode.panel_swiglu: x must be a contiguous [rows, in] float32 CPU tensor");
  const int64_t in = x.size(1);
  TORCH_CHECK(ffn >= 1, "rlhf_cpu_decode.panel_swiglu: ffn must be >= 1, got ", ffn);
  check_weight(panels, "panels", {2 * divup(ffn, kPanelColumns), in, kPanelColumns});
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  std::vector<at::Tensor> outs{at::empty({x.size(0), ffn}, x.options())};
  if (products) {
    outs.push_back(at::empty({x.size(0), ffn}, x.options()));
    outs.push_back(at::empty({x.size(0), ffn}, x.options()));
  }
  PanelGemmArgs args{x.data_ptr<float>(), in, x.size(0), in, panels.data_ptr<float>(), nullptr,
                     outs[0].data_ptr<float>(), ffn, false};
  if (products) {
    args.gate_out = outs[1].data_ptr<float>();
    args.up_out = outs[2].data_ptr<float>();
  }
  for_column_chunks(ffn, [&](int64_t c0, int64_t c1) { kernels.panel_swiglu(args, c0, c1); });
  return outs;
}

at::Tensor panel_swiglu(const at::Tensor& x, const at::Tensor& panels, int64_t ffn, const std::string& isa) {
  return swiglu_through_panels(x, panels, ffn, isa, false)[0];
}

std::vector<at::Tensor> panel_swiglu_products(const at::Tensor& x, const at::Tensor& panels, int64_t ffn,
                                              const std::string& isa) {
  return swiglu_through_panels(x, panels, ffn, isa, true);
}

// dy^T x [out, in] (a linear's weight gradient from its output gradient's rows dy [n, out] and
// its input's rows x [n, in], both contiguous) straight from their rows (tn_gemm: no transposes);
// `in` a multiple of 16. Rows of the output split evenly over the intra-op threads.
at::Tensor tn_weight_grad(const at::Tensor& dy, const at::Tensor& x, const std::string& isa) {
  TORCH_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0),
              "rlhf_cpu_decode.tn_weight_grad: dy [n, out] and x [n, in] must have the same rows");
  check_weight(dy, "dy", {dy.size(0), dy.size(1)});
  check_weight(x, "x", {x.size(0), x.size(1)});
  TORCH_CHECK(x.size(1) % kPanelColumns == 0, "rlhf_cpu_decode.tn_weight_grad: in (", x.size(1),
              ") must be a multiple of ", kPanelColumns);
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  const int64_t m = dy.size(1), n = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  const TnGemmArgs args{dy.data_ptr<float>(), m, x.data_ptr<float>(), n, out.data_ptr<float>(), m, n, x.size(0)};
  // One contiguous run of rows per thread, cut at multiples of 8 rows (every block size's).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_thread = divup(divup(m, threads), 8) * 8;
  at::parallel_for(0, divup(m, per_thread), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) kernels.tn_gemm(args, i * per_thread, std::min(m, (i + 1) * per_thread));
  });
  return out;
}

// One token per row of logits [B, vocab] (float32, CPU) from uniforms [B] in [0, 1).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& uniform, double temperature, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == at::kFloat,
              "rlhf_cpu_decode.sample: logits must be a [batch, vocab] float32 CPU tensor");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == logits.size(0) && uniform.scalar_type() == at::kFloat &&
                  uniform.device().is_cpu(),
              "rlhf_cpu_decode.sample: uniform must be [batch] float32 on the CPU");
  TORCH_CHECK(temperature > 0, "rlhf_cpu_decode.sample: temperature must be > 0");
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  const at::Tensor scores = logits.contiguous();
  const at::Tensor u = uniform.contiguous();
  const int64_t batch = scores.size(0), vocab = scores.size(1);
  at::Tensor tokens = at::empty({batch}, scores.options().dtype(at::kLong));
  std::vector<float> mass(vocab);
  const float* rows = scores.data_ptr<float>();
  const float* draws = u.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    out[b] = kernels.sample_row(rows + b * vocab, vocab, static_cast<float>(temperature), draws[b], mass.data());
  }
  return tokens;
}

// One generation step's sampling and bookkeeping in one call (engine/generation.py's loop body,
// whose Python is the reference): for each decoded row (`rows`, or every row when empty) a token
// from softmax(logits / temperature) with EOS ids masked while `suppress_eos` (min_new_tokens),
// drawn with its batch row's uniform; its log-prob under the raw logits; then for every batch row
// b: sequences[b, col] = its token (pad once finished), action_mask[b, col] = not finished,
// token_logprobs[b, col] = its log-prob (0 once finished), and finished[b] |= token is an EOS.
// Returns the decoded rows' tokens [n, 1]: the next decode step's input.
at::Tensor sample_record(const at::Tensor& logits, const at::Tensor& uniform, const at::Tensor& rows,
                         double temperature, const at::Tensor& eos_ids, bool suppress_eos, int64_t pad_id,
                         int64_t col, at::Tensor& sequences, at::Tensor& action_mask, at::Tensor& token_logprobs,
                         at::Tensor& finished, const std::string& isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "rlhf_cpu_decode.sample_record: logits must be a contiguous [rows, vocab] float32 CPU tensor");
  TORCH_CHECK(temperature > 0, "rlhf_cpu_decode.sample_record: temperature must be > 0");
  const int64_t n = logits.size(0), vocab = logits.size(1), batch = finished.numel();
  TORCH_CHECK(finished.scalar_type() == at::kBool && finished.is_contiguous() && finished.dim() == 1,
              "rlhf_cpu_decode.sample_record: finished must be a contiguous [batch] bool tensor");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.is_contiguous() && uniform.numel() == batch,
              "rlhf_cpu_decode.sample_record: uniform must be [batch] float32, one per batch row");
  TORCH_CHECK(rows.numel() == 0 ? n == batch : (rows.scalar_type() == at::kLong && rows.numel() == n),
              "rlhf_cpu_decode.sample_record: rows must index the logits' rows in the batch");
  TORCH_CHECK(sequences.scalar_type() == at::kLong && action_mask.scalar_type() == at::kBool &&
                  token_logprobs.scalar_type() == at::kFloat && sequences.is_contiguous() &&
                  action_mask.is_contiguous() && token_logprobs.is_contiguous() && sequences.size(0) == batch &&
                  action_mask.sizes() == sequences.sizes() && token_logprobs.sizes() == sequences.sizes() &&
                  col >= 0 && col < sequences.size(1),
              "rlhf_cpu_decode.sample_record: sequences (int64) / action_mask (bool) / token_logprobs (float32) "
              "must be contiguous [batch, total_len] and col inside them");
  TORCH_CHECK(eos_ids.scalar_type() == at::kLong && eos_ids.is_contiguous(),
              "rlhf_cpu_decode.sample_record: eos_ids must be contiguous int64");
  std::string chosen;
  const Kernels& kernels = resolve_isa(isa, chosen);
  const float* scores = logits.data_ptr<float>();
  const float* draws = uniform.data_ptr<float>();
  const int64_t* row_ids = rows.numel() == 0 ? nullptr : rows.data_ptr<int64_t>();
  const int64_t* eos = eos_ids.data_ptr<int64_t>();
  const int64_t n_eos = eos_ids.numel(), width = sequences.size(1);
  for (int64_t e = 0; e < n_eos; ++e)
    TORCH_CHECK(!suppress_eos || (eos[e] >= 0 && eos[e] < vocab), "rlhf_cpu_decode.sample_record: EOS id ",
                eos[e], " outside the vocabulary");
  for (int64_t i = 0; row_ids != nullptr && i < n; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < batch, "rlhf_cpu_decode.sample_record: row ", row_ids[i],
                " outside the batch");
  // Rows not decoded are finished: they take the pad like every finished row.
  std::vector<int64_t> decoded(batch, pad_id);
  std::vector<float> logprob(batch, 0.0f);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> mass(vocab), masked;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = row_ids == nullptr ? i : row_ids[i];
      const float* raw = scores + i * vocab;
      const float* sampled = raw;
      if (suppress_eos && n_eos > 0) {
        masked.assign(raw, raw + vocab);
        for (int64_t e = 0; e < n_eos; ++e) masked[eos[e]] = -INFINITY;
        sampled = masked.data();
      }
      decoded[b] = kernels.sample_row(sampled, vocab, static_cast<float>(temperature), draws[b], mass.data());
      logprob[b] = kernels.row_logprob(raw, vocab, decoded[b]);
    }
  });
  bool* done = finished.data_ptr<bool>();
  int64_t* seq = sequences.data_ptr<int64_t>();
  bool* act = action_mask.data_ptr<bool>();
  float* lp = token_logprobs.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t token = done[b] ? pad_id : decoded[b];
    seq[b * width + col] = token;
    act[b * width + col] = !done[b];
    lp[b * width + col] = done[b] ? 0.0f : logprob[b];
    for (int64_t e = 0; e < n_eos; ++e) done[b] = done[b] || token == eos[e];
  }
  at::Tensor next = at::empty({n, 1}, sequences.options());
  int64_t* next_ptr = next.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) next_ptr[i] = seq[(row_ids == nullptr ? i : row_ids[i]) * width + col];
  return next;
}

}  // namespace
}  // namespace rlhf_decode

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using rlhf_decode::LlamaDecodeStep;
  m.doc() = "Whole-model float32 decode step of Llama-family models on the CPU (AVX-512 / AVX2 / scalar kernels + MKL "
            "or packed-weight GEMMs)";
  py::class_<LlamaDecodeStep>(m, "LlamaDecodeStep")
      .def(py::init<const at::Tensor&, const std::vector<at::Tensor>&, const std::vector<double>&, const at::Tensor&,
                    double, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, int64_t, int64_t, double,
                    const std::string&, const std::vector<at::Tensor>&>(),
           py::arg("embed"), py::arg("layer_tensors"), py::arg("layer_eps"), py::arg("norm"), py::arg("norm_eps"),
           py::arg("lm_head"), py::arg("lm_head_bias"), py::arg("cos"), py::arg("sin_signed"), py::arg("keys"),
           py::arg("values"), py::arg("heads"), py::arg("kv_heads"), py::arg("scale"), py::arg("isa") = "auto",
           py::arg("packed") = std::vector<at::Tensor>())
      .def("step", &LlamaDecodeStep::step, py::arg("tokens"), py::arg("positions"), py::arg("visible"),
           py::arg("length"), "One token per sequence -> [batch, vocab] logits; writes the KV cache at `length`.",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("isa", &LlamaDecodeStep::isa)
      .def_property_readonly("packed", &LlamaDecodeStep::packed, "Whether the projections run packed weights.");
  m.def("pack_panels", &rlhf_decode::pack_panels, py::arg("w_t"), py::arg("isa") = "auto",
        "An [in, out] weight packed for the step's packed projections: [ceil(out / 16), in, 16].",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear", &rlhf_decode::panel_linear, py::arg("x"), py::arg("panels"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("isa") = "auto",
        "x [rows, in] @ w_t (+ bias) through the step's packed GEMM over pack_panels(w_t) -> [rows, out_features].",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_swiglu_panels", &rlhf_decode::pack_swiglu_panels, py::arg("gate_t"), py::arg("up_t"),
        py::arg("isa") = "auto",
        "A SwiGLU MLP's [in, ffn] gate and up weights packed for panel_swiglu: [2 ceil(ffn / 16), in, 16].",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_swiglu", &rlhf_decode::panel_swiglu, py::arg("x"), py::arg("panels"), py::arg("ffn"),
        py::arg("isa") = "auto",
        "silu(x @ gate_t) * (x @ up_t) [rows, ffn] over pack_swiglu_panels(gate_t, up_t), the products kept in "
        "registers.",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_swiglu_products", &rlhf_decode::panel_swiglu_products, py::arg("x"), py::arg("panels"),
        py::arg("ffn"), py::arg("isa") = "auto",
        "panel_swiglu's activation and the two products it multiplied, [activation, x @ gate_t, x @ up_t], each "
        "[rows, ffn] (for a backward).",
        py::call_guard<py::gil_scoped_release>());
  m.def("tn_weight_grad", &rlhf_decode::tn_weight_grad, py::arg("dy"), py::arg("x"), py::arg("isa") = "auto",
        "dy^T x [out, in] (a linear's weight gradient) from the rows of dy [n, out] and x [n, in], no transposes.",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample", &rlhf_decode::sample_rows, py::arg("logits"), py::arg("uniform"), py::arg("temperature") = 1.0,
        py::arg("isa") = "auto",
        "One draw per row from softmax(logits / temperature) by inverse CDF with the given uniforms "
        "(engine/sampling.py's sample_from_logits contract) -> [batch] int64.",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_record", &rlhf_decode::sample_record, py::arg("logits"), py::arg("uniform"), py::arg("rows"),
        py::arg("temperature"), py::arg("eos_ids"), py::arg("suppress_eos"), py::arg("pad_id"), py::arg("col"),
        py::arg("sequences"), py::arg("action_mask"), py::arg("token_logprobs"), py::arg("finished"),
        py::arg("isa") = "auto",
        "One generation step's sampling and bookkeeping (engine/generation.py's loop body): tokens drawn "
        "for the decoded rows, their log-probs, sequences / action_mask / token_logprobs column `col` and "
        "`finished` updated in place -> the decoded rows' tokens [n, 1].");
  m.def("supported_isas", &rlhf_decode::supported_isas,
        "Kernels this CPU can run, widest last (scalar, avx2, avx512).");
}
