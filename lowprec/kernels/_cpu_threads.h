// Work split over XLA's intra-op threads for lowprec's native CPU kernels.
#ifndef LOWPREC_KERNELS_CPU_THREADS_H_
#define LOWPREC_KERNELS_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace lowprec_native {

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

#endif  // LOWPREC_KERNELS_CPU_THREADS_H_
