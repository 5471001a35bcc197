// ThreadGate: the threading contract of one OffloadEngine.
//
// One engine is driven by one forward at a time. The thread whose acquire() found the engine idle
// owns it until every block it acquired is released again; the slot ring, the binder and the
// parameters' bindings belong to that forward meanwhile.
//   - A per-step call (acquire, prefetch, release) from any other thread raises at once: it holds
//     the GIL, so it cannot wait for a forward that needs the GIL to finish.
//   - A call that rebuilds or frees blocks (restore, close, materialize, repack, add_block) runs
//     with the GIL released and waits until the owning thread has released its blocks, so a
//     disable from another thread never frees the bytes a running kernel reads.
// Every call also holds the gate's mutex for its whole duration: the GIL-free calls would
// otherwise race the per-step calls on the slot state.
//
// Lock order: a thread never waits for the mutex while it holds the GIL. A GIL-free call may need
// the GIL while it holds the mutex (dropping the last reference to a parameter runs a Python decref),
// so a GIL holder blocked on the mutex would deadlock. The mutex is tried first, which costs nothing
// uncontended; only a thread that has to wait drops the GIL for the wait (through WaitHooks, which
// the bindings install, so this file needs no Python).
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace fastoffload {

// before(): drops the GIL if the calling thread holds it, returning what after() needs to take it
// back (nullptr: nothing to take back).
struct WaitHooks {
  void* (*before)() = nullptr;
  void (*after)(void*) = nullptr;
};
void set_wait_hooks(WaitHooks hooks);

class ThreadGate {
 public:
  // The mutex, after checking that no other thread owns the engine (raises a c10::Error if one does).
  std::unique_lock<std::mutex> enter_step() const;
  // The mutex, once no other thread owns the engine (waits; call without the GIL).
  std::unique_lock<std::mutex> enter_waiting() const;
  // The mutex, for reads that do not care who owns the engine.
  std::unique_lock<std::mutex> enter_read() const { return lock(); }
  // Called with the mutex held when a call ends: the calling thread owns the engine while it has
  // blocks running, and nobody does once it has none (waiters are woken then).
  void settle(bool running) const noexcept;

 private:
  std::unique_lock<std::mutex> lock() const;
  bool owned_by_other() const { return owned_ && owner_ != std::this_thread::get_id(); }

  mutable std::mutex mutex_;
  mutable std::condition_variable idle_;
  mutable std::thread::id owner_;
  mutable bool owned_ = false;
};

}  // namespace fastoffload
