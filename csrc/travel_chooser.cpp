#include "travel_chooser.h"

#include <algorithm>

namespace fastoffload {
namespace {

void keep_min(double& current, double sample) {
  if (sample < 0) return;
  current = current < 0 ? sample : std::min(current, sample);
}

}  // namespace

void TravelChooser::track(size_t block) {
  if (blocks_.size() <= block) blocks_.resize(block + 1);
  auto samples = std::make_unique<Samples>();
  const int device = copy_.device_index();
  if (!copy_.is_host()) {
    samples->copy_start = std::make_unique<Event>(device, true);
    samples->copy_end = std::make_unique<Event>(device, true);
    samples->compute_start = std::make_unique<Event>(device, true);
    samples->compute_end = std::make_unique<Event>(device, true);
  }
  blocks_[block] = std::move(samples);
}

void TravelChooser::forget(size_t block) {
  if (block < blocks_.size()) blocks_[block].reset();
}

size_t TravelChooser::tracked() const {
  return static_cast<size_t>(std::count_if(blocks_.begin(), blocks_.end(), [](const auto& s) { return s != nullptr; }));
}

std::vector<size_t> TravelChooser::tracked_blocks() const {
  std::vector<size_t> result;
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (blocks_[b]) result.push_back(b);
  return result;
}

void TravelChooser::harvest(Samples& s) {
  if (copy_.is_host()) return;
  if (s.copy_pending) {
    const double ms = copy_.elapsed_ms(*s.copy_start, *s.copy_end);
    if (ms >= 0) {
      keep_min(s.min_copy_ms, ms);
      s.copy_pending = false;
    }
  }
  if (s.compute_pending) {
    const double ms = copy_.elapsed_ms(*s.compute_start, *s.compute_end);
    if (ms >= 0) {
      keep_min(s.min_compute_ms, ms);
      s.compute_samples += 1;
      s.compute_pending = false;
    }
  }
}

Event* TravelChooser::copy_start(size_t block) {
  if (!tracking(block) || copy_.is_host() || copy_.capturing()) return nullptr;
  Samples& s = *blocks_[block];
  harvest(s);
  // An unfinished earlier sample is dropped: its events are recorded again now.
  s.copy_pending = true;
  return s.copy_start.get();
}

Event* TravelChooser::copy_end(size_t block) {
  if (!tracking(block) || copy_.is_host() || copy_.capturing()) return nullptr;
  return blocks_[block]->copy_end.get();
}

void TravelChooser::add_host_copy(size_t block, double ms) {
  if (tracking(block)) keep_min(blocks_[block]->min_copy_ms, ms);
}

void TravelChooser::compute_started(size_t block) {
  if (!tracking(block) || copy_.capturing()) return;
  Samples& s = *blocks_[block];
  if (copy_.is_host()) {
    s.host_start = std::chrono::steady_clock::now();
    return;
  }
  harvest(s);
  s.compute_pending = false;
  copy_.record_on_current(*s.compute_start);
}

void TravelChooser::compute_ended(size_t block) {
  if (!tracking(block) || copy_.capturing()) return;
  Samples& s = *blocks_[block];
  if (copy_.is_host()) {
    keep_min(s.min_compute_ms,
             std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s.host_start).count());
    s.compute_samples += 1;
    return;
  }
  copy_.record_on_current(*s.compute_end);
  s.compute_pending = true;
}

bool TravelChooser::ready() {
  bool any = false;
  for (auto& s : blocks_) {
    if (!s) continue;
    any = true;
    harvest(*s);
    if (s->compute_samples < kSamples) return false;
  }
  return any;
}

bool TravelChooser::transfer_bound() {
  double copy_ms = 0.0;
  double compute_ms = 0.0;
  for (auto& s : blocks_) {
    if (!s) continue;
    harvest(*s);
    copy_ms += std::max(s->min_copy_ms, 0.0);
    compute_ms += std::max(s->min_compute_ms, 0.0);
  }
  last_copy_ms_ = copy_ms;
  last_compute_ms_ = compute_ms;
  return copy_ms > 0.0 && copy_ms >= threshold_ * compute_ms;
}

}  // namespace fastoffload
