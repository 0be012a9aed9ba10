// Torch binding of the decode attention kernel (decode_attention.cu).
#include <optional>

#include "binding_utils.h"

namespace rlhf_gen {
namespace {

// q [B, H, D]; k_cache, v_cache [B, Hkv, S, D]; keys [0, seq_len) are scanned and further
// limited by lengths [B] (valid keys are positions < length) and/or mask [B, >= seq_len]
// (nonzero = attend). Returns [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& lengths, const std::optional<at::Tensor>& mask,
                            int64_t seq_len, double scale) {
  TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda(), "decode_attention: tensors must be on CUDA");
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: k_cache and v_cache must both be [B, Hkv, S, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "decode_attention: float16 or bfloat16 only, got ", q.scalar_type());
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), cache_len = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == batch && k_cache.size(3) == head_dim, "decode_attention: cache shape ",
              k_cache.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: num_heads ", heads,
              " is not a multiple of num_kv_heads ", kv_heads);
  TORCH_CHECK(decode_attention_supports_head_dim(static_cast<int>(head_dim)),
              "decode_attention: unsupported head_dim ", head_dim);
  TORCH_CHECK(batch <= 65535, "decode_attention: batch must be <= 65535");
  TORCH_CHECK(seq_len >= 0 && seq_len <= cache_len, "decode_attention: seq_len ", seq_len, " outside [0, ",
              cache_len, "]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "decode_attention: the head dimension must be contiguous");
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(is_16_byte_aligned(*t) && t->stride(0) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(2) % 8 == 0,
                "decode_attention: KV cache rows must be 16-byte aligned");
  }

  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options());
  DecodeAttentionParams p;
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_b = k_cache.stride(0);
  p.k_stride_h = k_cache.stride(1);
  p.k_stride_s = k_cache.stride(2);
  p.v_stride_b = v_cache.stride(0);
  p.v_stride_h = v_cache.stride(1);
  p.v_stride_s = v_cache.stride(2);
  p.out_stride_b = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.batch = static_cast<int>(batch);
  p.num_heads = static_cast<int>(heads);
  p.num_kv_heads = static_cast<int>(kv_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.seq_len = static_cast<int>(seq_len);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  // Converted copies must outlive the launch call; the caching allocator orders their reuse
  // after the kernel on this stream.
  at::Tensor lengths_i64, mask_u8;
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->is_cuda() && lengths->dim() == 1 && lengths->size(0) == batch,
                "decode_attention: lengths must be a CUDA tensor of shape [B]");
    lengths_i64 = lengths->to(at::kLong).contiguous();
    p.lengths = lengths_i64.data_ptr<int64_t>();
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->is_cuda() && mask->dim() == 2 && mask->size(0) == batch && mask->size(1) >= seq_len,
                "decode_attention: mask must be a CUDA tensor of shape [B, >= seq_len]");
    mask_u8 = mask->scalar_type() == at::kBool ? mask->view(at::kByte) : mask->ne(0).view(at::kByte);
    if (mask_u8.stride(1) != 1) mask_u8 = mask_u8.contiguous();
    p.mask = mask_u8.data_ptr<uint8_t>();
    p.mask_stride_b = mask_u8.stride(0);
  }

  check_launch(decode_attention_plan(p, q.get_device()), "decode_attention_plan");
  at::Tensor ws_out, ws_lse;
  if (p.num_splits > 1) {
    ws_out = at::empty({batch, heads, p.num_splits, head_dim}, q.options().dtype(at::kFloat));
    ws_lse = at::empty({batch, heads, p.num_splits}, q.options().dtype(at::kFloat));
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
  }
  check_launch(launch_decode_attention(p, to_kernel_dtype(q.scalar_type()), c10::cuda::getCurrentCUDAStream().stream()),
               "decode_attention");
  return out;
}

}  // namespace
}  // namespace rlhf_gen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &rlhf_gen::decode_attention, "Flash-decoding attention over a static KV cache",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("lengths"),
        pybind11::arg("mask"), pybind11::arg("seq_len"), pybind11::arg("scale"));
}
