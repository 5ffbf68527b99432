// What lowprec's native CPU kernels share: the work split over XLA's intra-op threads, the
// CPU's AVX2 check, and FP6's group layout (four 6-bit codes per three bytes, code j in bits
// 6j..6j+5 of the group's little-endian 24-bit word, as lowprec/_pack.py).
#ifndef LOWPREC_KERNELS_CPU_COMMON_H_
#define LOWPREC_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LOWPREC_X86_AVX2 1
#endif

namespace lowprec_native {

// FP6: `groups` groups of four codes (one per byte; only the low 6 bits count) to three
// bytes each.
inline void PackFp6(const uint8_t* c, uint8_t* p, size_t groups) {
  for (size_t g = 0; g < groups; ++g, c += 4, p += 3) {
    const uint32_t w = (c[0] & 0x3Fu) | (c[1] & 0x3Fu) << 6 | (c[2] & 0x3Fu) << 12 |
                       static_cast<uint32_t>(c[3] & 0x3Fu) << 18;
    p[0] = static_cast<uint8_t>(w);
    p[1] = static_cast<uint8_t>(w >> 8);
    p[2] = static_cast<uint8_t>(w >> 16);
  }
}

#ifdef LOWPREC_X86_AVX2
inline bool HasAvx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

// FP6: 32 codes (one per byte, each < 64) to 8 groups: each 128-bit half holds its 4 groups'
// 12 bytes in bytes 0..11. Two multiply-adds form the 24-bit words (c0 + 64 c1 in each
// 16-bit lane, then lo + 4096 hi in each 32-bit lane), a byte shuffle drops their top bytes.
__attribute__((target("avx2"))) inline __m256i Fp6GroupsAvx2(__m256i codes) {
  const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, _mm256_set1_epi16(1 | (64 << 8))),
                                      _mm256_set1_epi32(1 | (4096 << 16)));
  const __m256i squeeze = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                           0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  return _mm256_shuffle_epi8(w, squeeze);
}
#endif

// Runs work(first, count) over [0, items) in chunks of `chunk` items, on XLA's intra-op
// threads and on this one. Each thread claims chunks from a shared counter, so this thread
// finishes the work alone if no scheduled task starts (a busy or one-thread pool), and a task
// that starts after the call returned finds no chunk left and touches no buffer (the state
// is shared, not on this stack). `work` must be safe to copy and call from any thread.
template <typename Work>
void RunChunked(xla::ffi::ThreadPool& pool, size_t items, size_t chunk, Work work) {
  const size_t chunks = (items + chunk - 1) / chunk;
  const int64_t threads = pool.num_threads();
  if (chunks <= 1 || threads <= 1) {
    if (items > 0) work(size_t{0}, items);
    return;
  }
  struct State {
    std::atomic<size_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  auto run = [state, work, items, chunk, chunks]() {
    for (size_t i; (i = state->next.fetch_add(1)) < chunks;) {
      const size_t first = i * chunk;
      work(first, std::min(chunk, items - first));
      if (state->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->all_done.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, static_cast<int64_t>(chunks) - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run]() { run(); });
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&state, chunks]() { return state->done.load() == chunks; });
}

}  // namespace lowprec_native

#endif  // LOWPREC_KERNELS_CPU_COMMON_H_
