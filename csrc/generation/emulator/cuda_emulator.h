// A small SIMT emulator that runs the generation kernels' CUDA source on the CPU, for tests on
// machines without a GPU (tests/test_generation_kernels.py builds it with g++).
//
// Each CUDA thread of a block is a fiber (ucontext) on one OS thread; blocks run one after the
// other. Fibers switch only at barriers: __syncthreads waits for every live thread of the
// block, and each warp intrinsic (__shfl_*_sync, __match_any_sync) is an exchange between the
// 32 lanes of a warp. A barrier that can never complete (divergent __syncthreads, a shuffle
// after some lanes returned) is reported as an error instead of hanging. Because switches only
// happen at barriers, data races between barriers are NOT detected; that remains the job of
// compute-sanitizer on a GPU. Shared memory is `static`, which is correct because exactly one
// block runs at a time. Only what the generation kernels use is provided.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

// ----------------------------------------------------------------------------------------------
// Runtime types and API
// ----------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct float2 {
  float x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorLaunchFailure = 719;
using cudaStream_t = void*;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

namespace emu {
inline int sm_count = 132;
inline cudaError_t last_error = cudaSuccess;
inline std::string last_message;
}  // namespace emu

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = emu::sm_count;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t err = emu::last_error;
  emu::last_error = cudaSuccess;
  return err;
}
inline const char* cudaGetErrorString(cudaError_t) { return emu::last_message.c_str(); }

// ----------------------------------------------------------------------------------------------
// Half precision (storage types with round-to-nearest-even conversions)
// ----------------------------------------------------------------------------------------------
struct __half {
  uint16_t bits;
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __half2float(__half h) { return static_cast<float>(std::bit_cast<_Float16>(h.bits)); }
inline __half __float2half_rn(float f) { return {std::bit_cast<uint16_t>(static_cast<_Float16>(f))}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return {static_cast<uint16_t>((u >> 16) | 0x40)};
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }

// ----------------------------------------------------------------------------------------------
// Built-in variables, math and bit intrinsics
// ----------------------------------------------------------------------------------------------
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return std::bit_cast<float>(x); }
inline unsigned int __float_as_uint(float x) { return std::bit_cast<unsigned int>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline int __popc(unsigned int x) { return std::popcount(x); }
inline int __ffs(unsigned int x) { return x == 0 ? 0 : std::countr_zero(x) + 1; }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
// Fibers never run concurrently, so plain read-modify-writes are atomic.
template <typename T, typename U>
inline T atomicAdd(T* p, U v) {
  const T old = *p;
  *p = static_cast<T>(old + v);
  return old;
}
inline int atomicMin(int* p, int v) {
  const int old = *p;
  *p = std::min(old, v);
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = std::max(old, v);
  return old;
}

// ----------------------------------------------------------------------------------------------
// Fiber scheduler
// ----------------------------------------------------------------------------------------------
namespace emu {

enum class State { kRunnable, kBlockBarrier, kWarpBarrier, kDone };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  uint3 tid;
  State state = State::kDone;
};

constexpr size_t kStackBytes = 256 * 1024;
inline ucontext_t scheduler_context;
inline std::vector<Fiber> fibers;
inline std::vector<uint64_t> lane_slots;  // one exchange slot per thread of the block
inline int current = -1;
inline std::function<void()> block_body;

inline void trampoline() {
  block_body();
  fibers[current].state = State::kDone;
  // Returning resumes uc_link, the scheduler.
}

inline void wait(State state) {
  fibers[current].state = state;
  swapcontext(&fibers[current].context, &scheduler_context);
}

// Lane values of the calling thread's warp after every lane has contributed `value`.
inline void warp_exchange(uint64_t value, uint64_t out[32]) {
  const int base = current & ~31;
  lane_slots[current] = value;
  wait(State::kWarpBarrier);
  for (int lane = 0; lane < 32; ++lane) out[lane] = lane_slots[base + lane];
  wait(State::kWarpBarrier);  // nobody overwrites a slot before every lane has read it
}

inline std::string where() {
  return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + ")";
}

// Releases one barrier if it can complete; returns false if nothing can move.
inline bool release_barrier() {
  const int n = static_cast<int>(fibers.size());
  bool released = false;
  for (int base = 0; base < n; base += 32) {
    int waiting = 0, done = 0;
    for (int i = base; i < std::min(base + 32, n); ++i) {
      waiting += fibers[i].state == State::kWarpBarrier;
      done += fibers[i].state == State::kDone;
    }
    if (waiting == 0) continue;
    if (waiting == 32) {
      for (int i = base; i < base + 32; ++i) fibers[i].state = State::kRunnable;
      released = true;
    } else if (waiting + done == std::min(32, n - base)) {
      throw std::runtime_error("warp intrinsic with a full mask while lanes of warp " + std::to_string(base / 32) +
                               " have exited (or a partial warp) in " + where());
    }
  }
  if (released) return true;
  int live = 0, at_block = 0;
  for (const Fiber& f : fibers) {
    live += f.state != State::kDone;
    at_block += f.state == State::kBlockBarrier;
  }
  if (live > 0 && at_block == live) {
    for (Fiber& f : fibers) {
      if (f.state == State::kBlockBarrier) f.state = State::kRunnable;
    }
    return true;
  }
  return false;
}

inline void run_block(int num_threads) {
  fibers.resize(num_threads);
  lane_slots.assign(num_threads, 0);
  for (int i = 0; i < num_threads; ++i) {
    Fiber& f = fibers[i];
    if (f.stack.empty()) f.stack.resize(kStackBytes);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = &scheduler_context;
    makecontext(&f.context, trampoline, 0);
    f.tid = {i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
    f.state = State::kRunnable;
  }
  for (;;) {
    bool ran = false;
    for (int i = 0; i < num_threads; ++i) {
      if (fibers[i].state != State::kRunnable) continue;
      current = i;
      threadIdx = fibers[i].tid;
      swapcontext(&scheduler_context, &fibers[i].context);
      ran = true;
    }
    if (std::all_of(fibers.begin(), fibers.end(), [](const Fiber& f) { return f.state == State::kDone; })) return;
    if (!ran && !release_barrier()) {
      throw std::runtime_error("deadlock: some threads wait at __syncthreads, others at a warp intrinsic, in " + where());
    }
  }
}

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, Args&&... args) {
  const int num_threads = static_cast<int>(block.x * block.y * block.z);
  if (num_threads <= 0 || num_threads > 1024) {
    last_error = cudaErrorInvalidValue;
    last_message = "invalid block size";
    return;
  }
  gridDim = grid;
  blockDim = block;
  block_body = [&]() { kernel(args...); };
  try {
    for (unsigned int z = 0; z < grid.z; ++z)
      for (unsigned int y = 0; y < grid.y; ++y)
        for (unsigned int x = 0; x < grid.x; ++x) {
          blockIdx = {x, y, z};
          run_block(num_threads);
        }
  } catch (const std::exception& e) {
    last_error = cudaErrorLaunchFailure;
    last_message = e.what();
  }
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::State::kBlockBarrier); }

// A barrier among the warp's lanes (on the GPU also ordering their shared-memory accesses).
inline void __syncwarp(unsigned int = 0xffffffffu) {
  uint64_t lanes[32];
  emu::warp_exchange(0, lanes);
}

template <typename T>
inline T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
  uint64_t lanes[32];
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  emu::warp_exchange(bits, lanes);
  T out;
  std::memcpy(&out, &lanes[(emu::current & 31) ^ lane_mask], sizeof(T));
  return out;
}

template <typename T>
inline T __shfl_up_sync(unsigned int, T value, unsigned int delta) {
  uint64_t lanes[32];
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  emu::warp_exchange(bits, lanes);
  const unsigned int lane = emu::current & 31;
  T out;
  std::memcpy(&out, &lanes[lane >= delta ? lane - delta : lane], sizeof(T));
  return out;
}

inline unsigned int __match_any_sync(unsigned int, unsigned int value) {
  uint64_t lanes[32];
  emu::warp_exchange(value, lanes);
  unsigned int peers = 0;
  for (int lane = 0; lane < 32; ++lane) peers |= (lanes[lane] == value ? 1u : 0u) << lane;
  return peers;
}
