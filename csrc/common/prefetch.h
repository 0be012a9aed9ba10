// Software prefetch shared by the CPU ops' kernels (the decode step's attention, the fused layers'
// attention): asks for cache lines ahead of their use where the hardware prefetcher does not
// (streams too short to ramp up on, rows strided too far apart to follow).
#pragma once

#include <cstdint>

namespace rlhf {

// Every 64-byte cache line of [p, p + bytes), for reading.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// The 64-byte line at p, for reading once: a non-temporal hint (prefetchnta), so that on a
// victim L3 (AMD's) the line, once evicted from the core's caches, does not push out lines that
// are read again.
inline void prefetch_line_once(const void* p) { __builtin_prefetch(p, 0, 0); }

}  // namespace rlhf
