#include "copy_engine.h"

#include <cstring>

#include <c10/util/Exception.h>

#include "codec.h"
#include "codec_decode.h"

#ifdef FASTOFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace fastoffload {

namespace {
#ifdef FASTOFFLOAD_WITH_CUDA
cudaEvent_t as_event(void* handle) { return static_cast<cudaEvent_t>(handle); }
cudaStream_t as_stream(void* handle) { return static_cast<cudaStream_t>(handle); }

// Non-blocking: the engine's streams must never serialise with the legacy default stream. High priority:
// a prefetch (or its decode) should not queue behind compute kernels for the GPU's attention.
cudaStream_t new_priority_stream() {
  int least = 0;
  int greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  return stream;
}
#else
// Always throws: an Event or CopyEngine for a device cannot exist in a host-only build.
void refuse_without_cuda(int device_index) {
  TORCH_CHECK(false, "fastoffload: this build has no CUDA support; rebuild with a CUDA toolkit to use cuda:",
              std::to_string(device_index));
}
#endif
}  // namespace

Event::Event(int device_index, bool timing) : device_index_(device_index) {
  if (device_index_ < 0) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  cudaEvent_t event = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = event;
#else
  refuse_without_cuda(device_index);
#endif
}

Event::~Event() {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (handle_ != nullptr) {
    (void)cudaEventDestroy(as_event(handle_));
    (void)cudaGetLastError();
  }
#endif
}

CopyEngine::CopyEngine(int device_index) : device_index_(device_index) {
  if (device_index_ < 0) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  copy_stream_ = new_priority_stream();
  cudaEvent_t join = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  join_event_ = join;
#else
  refuse_without_cuda(device_index);
#endif
}

CopyEngine::~CopyEngine() {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (copy_stream_ != nullptr) {
    // A copy still in flight reads pinned memory that is about to be freed: finish it first.
    (void)cudaStreamSynchronize(as_stream(copy_stream_));
    (void)cudaStreamDestroy(as_stream(copy_stream_));
  }
  if (decode_stream_ != nullptr) {
    (void)cudaStreamSynchronize(as_stream(decode_stream_));
    (void)cudaStreamDestroy(as_stream(decode_stream_));
  }
  if (join_event_ != nullptr) (void)cudaEventDestroy(as_event(join_event_));
  (void)cudaGetLastError();
#endif
}

void* CopyEngine::current_stream() const {
#ifdef FASTOFFLOAD_WITH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
#else
  return nullptr;
#endif
}

void CopyEngine::begin_transfer(Event* free_event) {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (capturing()) {
    C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(current_stream())));
    C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(copy_stream_), as_event(join_event_), 0));
    forked_ = true;
  }
  if (free_event != nullptr) wait_on(copy_stream_, *free_event);
#else
  (void)free_event;
#endif
}

void CopyEngine::wait_on(void* stream, Event& event) {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (!event.recorded_) return;
  if (event.epoch_ == capture_epoch_) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event.handle_), 0));
  } else if (!capturing() && event.epoch_ != 0) {
    // Recorded inside an earlier capture: the node it stood for runs in that graph's replays, which
    // were launched on the compute stream; waiting for the compute stream covers them.
    C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(current_stream())));
    C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(join_event_), 0));
  }
#else
  (void)stream;
  (void)event;
#endif
}

void CopyEngine::record_on(void* stream, Event& event) {
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaEventRecord(as_event(event.handle_), as_stream(stream)));
  event.recorded_ = true;
  event.epoch_ = capture_epoch_;
#else
  (void)stream;
  (void)event;
#endif
}

void CopyEngine::copy_to_device(void* dst, const void* src, size_t nbytes, Event& free_event, Event& ready_event,
                                Event* timing_start, Event* timing_end) {
  copies_issued_ += 1;
  bytes_copied_ += nbytes;
  if (is_host()) {
    if (nbytes > 0) std::memcpy(dst, src, nbytes);
    return;
  }
  begin_transfer(&free_event);
#ifdef FASTOFFLOAD_WITH_CUDA
  cudaStream_t stream = as_stream(copy_stream_);
  const bool timed = timing_start != nullptr && timing_end != nullptr && !capturing();
  if (timed) record_on(copy_stream_, *timing_start);
  if (nbytes > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream));
  if (timed) record_on(copy_stream_, *timing_end);
#else
  (void)timing_start;
  (void)timing_end;
#endif
  record_on(copy_stream_, ready_event);
}

void CopyEngine::ensure_decode_stream() {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (decode_stream_ != nullptr) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  decode_stream_ = new_priority_stream();
  for (auto& e : landed_) e = std::make_unique<Event>(device_index_);
  for (auto& e : decoded_) e = std::make_unique<Event>(device_index_);
#endif
}

void CopyEngine::decode_to_device(void* dst, size_t raw_bytes, const void* src, size_t nbytes, void* const staging[2],
                                  size_t staging_bytes, uint32_t num_segments, uint32_t num_tiles, bool verify,
                                  Event& free_event, Event& ready_event) {
  TORCH_CHECK(dst != nullptr && src != nullptr && nbytes >= sizeof(codec::Header),
              "fastoffload: internal error: decode of a compressed block without its buffers (", std::to_string(nbytes),
              " bytes)");
  copies_issued_ += 1;
  bytes_copied_ += nbytes;
  if (is_host()) {
    codec::decode_block(static_cast<const uint8_t*>(src), nbytes, static_cast<uint8_t*>(dst), raw_bytes, verify);
    return;
  }
  const size_t k = decodes_issued_ % 2;
  TORCH_CHECK(staging != nullptr && staging[k] != nullptr && staging_bytes >= nbytes,
              "fastoffload: internal error: the staging buffer holds ", std::to_string(staging_bytes),
              " bytes, the compressed block needs ", std::to_string(nbytes));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(staging[k]) % codec::kPlaneAlignment == 0 &&
                  reinterpret_cast<uintptr_t>(dst) % codec::kPlaneAlignment == 0,
              "fastoffload: internal error: device buffers of the decoder must be 16-byte aligned");
  if (verify) codec::verify_block(static_cast<const uint8_t*>(src), nbytes);
  ensure_decode_stream();
#ifdef FASTOFFLOAD_WITH_CUDA
  decodes_issued_ += 1;
  // A kernel launches on the current device: it must be the engine's, whatever the caller's is.
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  begin_transfer(nullptr);
  wait_on(copy_stream_, *decoded_[k]);
  C10_CUDA_CHECK(cudaMemcpyAsync(staging[k], src, nbytes, cudaMemcpyHostToDevice, as_stream(copy_stream_)));
  record_on(copy_stream_, *landed_[k]);
  // Waiting on an event recorded inside the capture forks the decode stream into it.
  wait_on(decode_stream_, *landed_[k]);
  if (capturing()) decode_forked_ = true;
  wait_on(decode_stream_, free_event);
  C10_CUDA_CHECK(static_cast<cudaError_t>(codec::launch_decode(static_cast<const uint8_t*>(staging[k]),
                                                               static_cast<uint8_t*>(dst), num_segments, num_tiles,
                                                               decode_stream_)));
  record_on(decode_stream_, *decoded_[k]);
  record_on(decode_stream_, ready_event);
#else
  (void)num_segments;
  (void)num_tiles;
  (void)free_event;
  (void)ready_event;
#endif
}

double CopyEngine::elapsed_ms(Event& start, Event& end) const {
  if (is_host() || !start.recorded_ || !end.recorded_ || start.epoch_ != 0 || end.epoch_ != 0) return -1.0;
#ifdef FASTOFFLOAD_WITH_CUDA
  const cudaError_t status = cudaEventQuery(as_event(end.handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return -1.0;
  }
  C10_CUDA_CHECK(status);
  float ms = 0.0f;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start.handle_), as_event(end.handle_)));
  return ms;
#else
  return -1.0;
#endif
}

void CopyEngine::wait_on_current(Event& ready_event) {
  if (is_host() || !ready_event.recorded_ || ready_event.epoch_ != capture_epoch_) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(current_stream()), as_event(ready_event.handle_), 0));
#endif
}

void CopyEngine::record_on_current(Event& event) {
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaEventRecord(as_event(event.handle_), as_stream(current_stream())));
  event.recorded_ = true;
  event.epoch_ = capture_epoch_;
#endif
}

void CopyEngine::synchronize_copies() {
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaStreamSynchronize(as_stream(copy_stream_)));
  if (decode_stream_ != nullptr) C10_CUDA_CHECK(cudaStreamSynchronize(as_stream(decode_stream_)));
#endif
}

void CopyEngine::staging_after_current() {
  if (is_host()) return;
  ensure_decode_stream();
  for (auto& e : decoded_)
    if (e != nullptr) record_on_current(*e);
}

void CopyEngine::record_on_copy(Event& event) {
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaEventRecord(as_event(event.handle_), as_stream(copy_stream_)));
  event.recorded_ = true;
  event.epoch_ = capture_epoch_;
#endif
}

void CopyEngine::host_wait(Event& event) const {
  if (is_host() || !event.recorded_) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  // Called from reader threads, which have no current device of their own.
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  C10_CUDA_CHECK(cudaEventSynchronize(as_event(event.handle_)));
#endif
}

void CopyEngine::begin_capture() {
  TORCH_CHECK(!capturing(), "fastoffload: a capture is already in progress on this engine");
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(as_stream(current_stream()), &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusActive,
              "fastoffload: begin_capture() must be called while the current stream is capturing a CUDA graph "
              "(inside torch.cuda.graph(...)); use fastoffload_ext.OffloadedCUDAGraph, which does this for you");
#endif
  capture_epoch_ = ++captures_;
  forked_ = false;
  decode_forked_ = false;
}

void CopyEngine::end_capture() {
  if (!capturing()) return;
  const bool forked = forked_ || decode_forked_;
  const bool decode_forked = decode_forked_;
  // Left capturing, later eager steps would skip the waits on events recorded outside it: the state is
  // reset first, also when the join below fails (a capture that the driver already invalidated).
  capture_epoch_ = 0;
  forked_ = false;
  decode_forked_ = false;
  // Join the copy stream back: a capture must end with every forked stream joined.
  if (forked) join_into_current(decode_forked);
}

void CopyEngine::current_waits_for_copies() {
  // Outside a capture, or once the decode stream joined it: its decodes are copies too.
  join_into_current(!capturing() || decode_forked_);
}

void CopyEngine::join_into_current(bool with_decodes) {
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(copy_stream_)));
  C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(current_stream()), as_event(join_event_), 0));
  if (decode_stream_ != nullptr && with_decodes) {
    C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(decode_stream_)));
    C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(current_stream()), as_event(join_event_), 0));
  }
#else
  (void)with_decodes;
#endif
}

}  // namespace fastoffload
