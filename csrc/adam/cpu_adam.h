// CPU fused Adam/AdamW: the span kernels of each instruction set, torch-free.
//
// A span is a contiguous run of one tensor (the binding cuts tensors into chunks and hands them
// to threads). Each ISA lives in its own translation unit compiled for that ISA only
// (cpu_adam_scalar.cpp, cpu_adam_avx2.cpp, cpu_adam_avx512.cpp); cpu_adam.cpp picks one at run
// time from what the CPU supports.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam_common.h"

namespace rlhf_adam {

// Pointers into one contiguous span. The update runs in fp32 on `master` when given (bf16 params
// with an fp32 master copy), else on the param itself (widened from bf16 if need be); the result
// is written back to the param, the master, and `lp_out` (a bf16 copy) when given.
struct AdamSpan {
  void* param;
  const void* grad;  // same dtype as param
  float* exp_avg;
  float* exp_avg_sq;
  float* master;     // nullable
  bf16_t* lp_out;    // nullable
  int64_t numel;
  ParamType param_type;
};

// Updates the span; returns whether every updated value is finite.
using AdamSpanFn = bool (*)(const AdamSpan&, const AdamHyper&);

bool adam_span_scalar(const AdamSpan& span, const AdamHyper& hyper);
#if defined(__x86_64__) || defined(_M_X64)
bool adam_span_avx2(const AdamSpan& span, const AdamHyper& hyper);
bool adam_span_avx512(const AdamSpan& span, const AdamHyper& hyper);
#endif

// The sum of squares of n contiguous values of `type` (a gradient norm's span), in double.
using SumOfSquaresFn = double (*)(const void* x, int64_t n, ParamType type);

double sum_of_squares_scalar(const void* x, int64_t n, ParamType type);
#if defined(__x86_64__) || defined(_M_X64)
double sum_of_squares_avx2(const void* x, int64_t n, ParamType type);
double sum_of_squares_avx512(const void* x, int64_t n, ParamType type);
#endif

inline float bf16_to_float(bf16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, NaN -> canonical quiet NaN: the same bits as c10::BFloat16(float).
inline bf16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16_t{0x7fc0};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(bits >> 16)};
}

}  // namespace rlhf_adam
