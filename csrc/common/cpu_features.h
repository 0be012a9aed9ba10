// Runtime CPU feature checks shared by the CPU ops (fused Adam, the CPU decode step).
#pragma once

namespace rlhf {

inline bool cpu_has_avx2() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  // F16C (half <-> float) came with AVX2 on every x86 CPU; checked all the same.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
  // libgcc's CPU probe also checks (via xgetbv) that the OS saves the AVX-512 registers.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

}  // namespace rlhf
