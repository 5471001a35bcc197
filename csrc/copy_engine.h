// CopyEngine: the only place that talks to the CUDA runtime about streams, events and copies.
//
// Prefetching a block is: the copy stream waits for the slot's "free" event (recorded on the compute
// stream when the slot's previous block was released), one cudaMemcpyAsync of the whole packed block,
// and a "ready" event recorded on the copy stream. Acquiring it is the current compute stream waiting
// on "ready". The host never blocks on the hot path and no record_stream is needed, because the slots
// are static and their reuse is ordered by events alone.
//
// With the host as the "device" (device_index < 0) copies are memcpy and events are no-ops: the slot
// rotation above them is exactly the one that runs on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace fastoffload {

class Event {
 public:
  // timing: the event can be measured against another (compress="auto" times copies and blocks).
  explicit Event(int device_index, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool recorded() const { return recorded_; }

 private:
  friend class CopyEngine;
  int device_index_;
  void* handle_ = nullptr;  // cudaEvent_t
  bool recorded_ = false;
  uint64_t epoch_ = 0;  // the capture it was recorded in (0: outside any capture)
};

class CopyEngine {
 public:
  explicit CopyEngine(int device_index);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  bool is_host() const { return device_index_ < 0; }
  int device_index() const { return device_index_; }

  // On the copy stream: wait for `free_event` (if ever recorded), copy, record `ready_event`.
  // timing_start/timing_end (optional, timing events): recorded on the copy stream around the copy itself.
  void copy_to_device(void* dst, const void* src, size_t nbytes, Event& free_event, Event& ready_event,
                      Event* timing_start = nullptr, Event* timing_end = nullptr);
  // A compressed block (codec_format.h): the copy stream copies its `nbytes` at `src` into one of the two
  // device staging buffers (`staging[0]`, `staging[1]`, alternately, each `staging_bytes` long; it waits
  // until the decode that last read that buffer is done), then the decode stream waits for that copy
  // and for `free_event`, decodes into `dst` (`raw_bytes` long, one kernel launch) and records
  // `ready_event`. Two streams and two buffers let the next block's copy run while this one decodes, so
  // the PCIe link never waits for a kernel. On the host "device": the host decoder, from `src` straight
  // into `dst` (verify: check the block's checksum first).
  void decode_to_device(void* dst, size_t raw_bytes, const void* src, size_t nbytes, void* const staging[2],
                        size_t staging_bytes, uint32_t num_segments, uint32_t num_tiles, bool verify,
                        Event& free_event, Event& ready_event);
  // The current compute stream waits until `ready_event` has completed.
  void wait_on_current(Event& ready_event);
  // Record `event` on the current compute stream.
  void record_on_current(Event& event);
  // Milliseconds from `start` to `end` (timing events, recorded outside any capture), or a negative
  // value when either has not completed yet; never blocks.
  double elapsed_ms(Event& start, Event& end) const;
  // Host blocks until every copy issued so far has completed.
  void synchronize_copies();
  // The next copy into either decode staging buffer waits for the work queued on the current stream
  // so far (called when the buffers are new: their memory may still be in use by queued kernels).
  void staging_after_current();
  // Record `event` on the copy stream (after the copies issued so far).
  void record_on_copy(Event& event);
  // Host blocks until `event` (if ever recorded) has completed. Safe from any thread.
  void host_wait(Event& event) const;
  // CUDA-graph capture of an offloaded forward on the current stream. Inside a capture an event
  // recorded before it cannot be waited on, so:
  //   - each copy first makes the copy stream wait on the capturing stream (this forks the copy
  //     stream into the capture and orders the copy after every kernel that used the slot before),
  //     and waits on a slot's free event only if that event was recorded inside this capture;
  //   - waiting on a ready event recorded before the capture is skipped: that copy was issued before
  //     the capture (the previous step's wrap-around prefetch) and completes before the graph is
  //     launched (torch.cuda.graph synchronizes on entry; each replay leaves it done for the next);
  //   - end_capture() joins the copy stream back into the capturing stream.
  void begin_capture();
  void end_capture();
  bool capturing() const { return capture_epoch_ != 0; }
  // The current stream waits on everything issued to the copy stream so far.
  void current_waits_for_copies();

  uint64_t copies_issued() const { return copies_issued_; }
  uint64_t bytes_copied() const { return bytes_copied_; }

 private:
  void* current_stream() const;
  // The current stream waits on the copy stream (and the decode stream, with_decodes).
  void join_into_current(bool with_decodes);
  // The copy stream joins a capture if one runs and waits for `free_event` (if given); then, after the
  // work, `ready_event` is recorded on `stream`.
  void begin_transfer(Event* free_event);
  void record_on(void* stream, Event& event);
  // `stream` waits for `event` if it was recorded in the current capture epoch (outside a capture, for
  // one recorded in an earlier capture, it waits for the compute stream instead).
  void wait_on(void* stream, Event& event);
  void ensure_decode_stream();
  int device_index_;
  void* copy_stream_ = nullptr;  // cudaStream_t
  void* join_event_ = nullptr;   // cudaEvent_t used for stream-to-stream joins
  void* decode_stream_ = nullptr;  // cudaStream_t of the decode kernels (created on the first decode)
  std::unique_ptr<Event> landed_[2];   // a compressed block is in staging buffer k
  std::unique_ptr<Event> decoded_[2];  // the decoder is done reading staging buffer k
  uint64_t decodes_issued_ = 0;
  bool decode_forked_ = false;  // the decode stream joined the current capture
  uint64_t capture_epoch_ = 0;   // non-zero while capturing
  uint64_t captures_ = 0;
  bool forked_ = false;  // the copy stream joined the current capture
  uint64_t copies_issued_ = 0;
  uint64_t bytes_copied_ = 0;
};

}  // namespace fastoffload
