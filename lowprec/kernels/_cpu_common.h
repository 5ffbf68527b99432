// What lowprec's native CPU kernels share: the work split over XLA's intra-op threads, the
// guard that keeps C++ exceptions inside a handler, reading float32 bits, the CPU's AVX2
// check, and FP6's group layout (four 6-bit codes per three bytes, code j in bits 6j..6j+5 of
// the group's little-endian 24-bit word, as lowprec/_pack.py).
#ifndef LOWPREC_KERNELS_CPU_COMMON_H_
#define LOWPREC_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LOWPREC_X86_AVX2 1
#endif

// The library's entry points (the handlers and _cpu_lib.cc's build facts) are its only
// visible symbols: setup.py compiles with -fvisibility=hidden, so that the FFI headers'
// inline functions in here bind to this library's copies, never to those of another library
// built against other headers.
#define LOWPREC_EXPORT extern "C" __attribute__((visibility("default")))

namespace lowprec_native {

// The bits of the float32 at p (no aliasing of the buffer through an integer type).
inline uint32_t Bits(const float* p) noexcept {
  uint32_t b;
  std::memcpy(&b, p, sizeof b);
  return b;
}

// FP6: `groups` groups of four codes (one per byte; only the low 6 bits count) to three
// bytes each.
inline void PackFp6(const uint8_t* c, uint8_t* p, size_t groups) noexcept {
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
// threads and on this one, and returns when every chunk is done. Each thread claims chunks
// from a shared counter, so this thread finishes the work alone if no scheduled task starts
// (a busy or one-thread pool), and a task that starts after the call returned finds no chunk
// left and touches no buffer. A task holds copies only: of `work` (whose captures must be
// values too) and of a shared_ptr to the counters; nothing on this stack. `work` must be
// noexcept (it runs on XLA's threads, where an exception would end the process), and once a
// task is scheduled nothing here throws: the call returns only when no task can touch the
// buffers any more. Where the pool or memory fails, this thread does the rest alone.
template <typename Work>
void RunChunked(xla::ffi::ThreadPool& pool, size_t items, size_t chunk, const Work& work) {
  static_assert(std::is_nothrow_invocable_v<const Work&, size_t, size_t>,
                "work runs on XLA's threads: declare it noexcept");
  const size_t chunks = (items + chunk - 1) / chunk;
  struct State {
    std::atomic<size_t> next{0}, done{0};
  };
  std::shared_ptr<State> state;
  if (chunks > 1 && pool.num_threads() > 1) {
    try {
      state = std::make_shared<State>();
    } catch (...) {  // no memory for the counters: this thread alone
    }
  }
  if (!state) {
    if (items > 0) work(size_t{0}, items);
    return;
  }
  auto run = [state, work, items, chunk, chunks]() noexcept {
    for (size_t i; (i = state->next.fetch_add(1)) < chunks;) {
      const size_t first = i * chunk;
      work(first, std::min(chunk, items - first));
      state->done.fetch_add(1);  // after the chunk's writes (release), read below (acquire)
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(chunks) - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    try {
      pool.Schedule([run]() noexcept { run(); });
    } catch (...) {  // the task's copy could not be made: fewer helpers
      break;
    }
  }
  run();
  // Every chunk is claimed now; those still running on other threads are at most one chunk
  // each (tens of microseconds), so this thread polls rather than sleeps on a lock.
  for (int spins = 0; state->done.load() != chunks; ++spins) {
    if (spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

// An FFI error carrying `message` (XLA copies it), or nullptr where the call frame has no
// API table: XLA's metadata query at registration, which runs no kernel code.
inline XLA_FFI_Error* ErrorOf(const XLA_FFI_CallFrame* frame, const char* message) noexcept {
  if (frame == nullptr || frame->api == nullptr) return nullptr;
  XLA_FFI_Error_Create_Args args;
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.message = message;
  args.errc = XLA_FFI_Error_Code_INTERNAL;
  return frame->api->XLA_FFI_Error_Create(&args);
}

// Calls an FFI handler so that no C++ exception leaves it: the FFI boundary is a C one, and
// an exception crossing it into an XLA built by another compiler and C++ runtime is undefined
// behaviour. What the handler throws (std::bad_alloc while decoding the call, say) becomes an
// INTERNAL error naming the target; the message is formatted on this stack.
inline XLA_FFI_Error* Guarded(XLA_FFI_Handler* handler, XLA_FFI_CallFrame* frame,
                              const char* target) noexcept {
  char message[512];
  try {
    return handler(frame);
  } catch (const std::exception& e) {
    std::snprintf(message, sizeof message, "%s: C++ exception in the native kernel: %s", target,
                  e.what());
  } catch (...) {
    std::snprintf(message, sizeof message, "%s: unknown C++ exception in the native kernel",
                  target);
  }
  return ErrorOf(frame, message);
}

// MX quantization of blocks [0, blocks) of float32 x on the calling thread, by the loops of
// _mx_quantize_cpu.cc; `attrs`: the 13 integers of _mx_quantize_cpu.attributes. False (nothing
// written) for attributes those loops do not take.
bool MxQuantizeBlocks(const float* x, size_t blocks, const int64_t* attrs, uint8_t* elements,
                      uint8_t* scales) noexcept;

// Binds those 13 attributes, in that order, after what `b` binds already (the handlers of
// lowprec_mx_quantize and lowprec_mx_fake_quantize take them as their next parameters).
template <typename Binding>
auto BindMxFormat(Binding&& b) {
  return std::forward<Binding>(b)
      .template Attr<int64_t>("mantissa_bits")
      .template Attr<int64_t>("emin")
      .template Attr<int64_t>("emax_elem")
      .template Attr<int64_t>("max_code")
      .template Attr<int64_t>("code_bits")
      .template Attr<bool>("twos_complement")
      .template Attr<int64_t>("rule")
      .template Attr<int64_t>("block")
      .template Attr<int64_t>("even_drop")
      .template Attr<int64_t>("rceil_k")
      .template Attr<int64_t>("rceil_mant")
      .template Attr<int64_t>("rceil_small")
      .template Attr<int64_t>("rceil_thr");
}

}  // namespace lowprec_native

// Defines the exported C symbol `symbol`, the XLA FFI handler of `target` binding `impl` as
// the binding (the rest of the arguments) says, through Guarded.
#define LOWPREC_FFI_HANDLER(symbol, target, impl, ...)                  \
  LOWPREC_EXPORT XLA_FFI_Error* symbol(XLA_FFI_CallFrame* frame) {      \
    XLA_FFI_DEFINE_HANDLER(handler, impl, __VA_ARGS__);                 \
    return ::lowprec_native::Guarded(handler, frame, target);          \
  }

#endif  // LOWPREC_KERNELS_CPU_COMMON_H_
