// parallel_for: runs job(i) for i in [0, n) on up to `threads` std::threads (0: one per hardware
// thread), handing out indices through an atomic counter so uneven jobs balance. The first exception a
// job throws is rethrown in the caller once every thread has stopped.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fastoffload {

inline unsigned default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

template <typename Job>
void parallel_for(size_t n, unsigned threads, Job&& job) {
  if (n == 0) return;
  const size_t workers = std::min<size_t>(n, threads == 0 ? default_threads() : threads);
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) job(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&]() {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= n || failed.load(std::memory_order_relaxed)) return;
      try {
        job(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace fastoffload
