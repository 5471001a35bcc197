#include "thread_gate.h"

#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

WaitHooks wait_hooks;

// Drops the GIL (if held) for its lifetime.
class WithoutGil {
 public:
  WithoutGil() : state_(wait_hooks.before != nullptr ? wait_hooks.before() : nullptr) {}
  ~WithoutGil() {
    if (state_ != nullptr && wait_hooks.after != nullptr) wait_hooks.after(state_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  void* state_;
};

}  // namespace

void set_wait_hooks(WaitHooks hooks) { wait_hooks = hooks; }

std::unique_lock<std::mutex> ThreadGate::lock() const {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) {
    WithoutGil no_gil;
    lock.lock();
  }
  return lock;
}

std::unique_lock<std::mutex> ThreadGate::enter_step() const {
  std::unique_lock<std::mutex> lock = this->lock();
  TORCH_CHECK(!owned_by_other(),
              "fastoffload: this offloaded model is running a forward in another thread; one offloaded model runs "
              "one forward at a time. Run its forwards from one thread (or one after another under a lock), or give "
              "each thread its own copy of the model.");
  return lock;
}

std::unique_lock<std::mutex> ThreadGate::enter_waiting() const {
  for (;;) {
    std::unique_lock<std::mutex> lock = this->lock();
    if (!owned_by_other()) return lock;
    lock.unlock();
    // The owner needs the GIL to finish its block, and the mutex must be free again before this
    // thread takes the GIL back: wait in an inner scope, then try again from the top.
    WithoutGil no_gil;
    std::unique_lock<std::mutex> waiting(mutex_);
    idle_.wait(waiting, [this] { return !owned_by_other(); });
    waiting.unlock();
  }
}

void ThreadGate::settle(bool running) const noexcept {
  if (running) {
    owner_ = std::this_thread::get_id();
    owned_ = true;
    return;
  }
  const bool was_owned = owned_;
  owned_ = false;
  if (was_owned) idle_.notify_all();
}

}  // namespace fastoffload
