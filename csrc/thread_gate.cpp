#include "thread_gate.h"

#include <c10/util/Exception.h>

namespace fastoffload {

std::unique_lock<std::mutex> ThreadGate::enter_step() const {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(!owned_by_other(),
              "fastoffload: this offloaded model is running a forward in another thread; one offloaded model runs "
              "one forward at a time. Run its forwards from one thread (or one after another under a lock), or give "
              "each thread its own copy of the model.");
  return lock;
}

std::unique_lock<std::mutex> ThreadGate::enter_waiting() const {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return !owned_by_other(); });
  return lock;
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
