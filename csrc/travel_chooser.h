// TravelChooser: how compress="auto" decides whether a block travels compressed.
//
// Compression pays only where the copy is the bottleneck: a transfer-bound step gets faster by the
// compression ratio, while a compute-bound step hides its copies anyway and would only add decode
// kernels next to its compute. So while blocks are "measuring" (they travel raw, with their compressed
// copy already made) the chooser times each one's raw copy (on the copy stream) and its compute (from
// acquire to release on the compute stream) with timing events, or the host clock on the host
// "device". Once every measuring block has kSamples compute samples it decides for all of them at once:
// compressed when the summed copy time is at least `threshold` times the summed compute time. Minimums
// over the samples are used, so the first step's one-off costs do not count.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "copy_engine.h"

namespace fastoffload {

class TravelChooser {
 public:
  static constexpr size_t kSamples = 2;
  static constexpr double kDefaultThreshold = 0.9;

  explicit TravelChooser(CopyEngine& copy) : copy_(copy) {}

  void track(size_t block);
  void forget(size_t block);
  bool tracking(size_t block) const { return block < blocks_.size() && blocks_[block] != nullptr; }
  size_t tracked() const;

  // Timing events for the block's next raw copy (nullptr on the host "device"; see add_host_copy).
  Event* copy_start(size_t block);
  Event* copy_end(size_t block);
  void add_host_copy(size_t block, double ms);
  void compute_started(size_t block);
  void compute_ended(size_t block);

  // Whether every tracked block has enough samples for a decision (collects finished timings; never blocks).
  bool ready();
  // The decision for the tracked blocks: true = transfer-bound, so they travel compressed.
  bool transfer_bound();
  std::vector<size_t> tracked_blocks() const;

  void set_threshold(double threshold) { threshold_ = threshold; }
  double threshold() const { return threshold_; }
  // Summed minimum copy and compute milliseconds of the last decision (negative before any).
  double last_copy_ms() const { return last_copy_ms_; }
  double last_compute_ms() const { return last_compute_ms_; }

 private:
  struct Samples {
    std::unique_ptr<Event> copy_start, copy_end, compute_start, compute_end;
    bool copy_pending = false;
    bool compute_pending = false;
    std::chrono::steady_clock::time_point host_start;
    double min_copy_ms = -1.0;
    double min_compute_ms = -1.0;
    size_t compute_samples = 0;
  };
  void harvest(Samples& s);

  CopyEngine& copy_;
  std::vector<std::unique_ptr<Samples>> blocks_;
  double threshold_ = kDefaultThreshold;
  double last_copy_ms_ = -1.0;
  double last_compute_ms_ = -1.0;
};

}  // namespace fastoffload
