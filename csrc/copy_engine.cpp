#include "copy_engine.h"

#include <cstring>

#include <c10/util/Exception.h>

#ifdef FASTOFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace fastoffload {

#ifdef FASTOFFLOAD_WITH_CUDA
namespace {
cudaEvent_t as_event(void* handle) { return static_cast<cudaEvent_t>(handle); }
cudaStream_t as_stream(void* handle) { return static_cast<cudaStream_t>(handle); }
}  // namespace
#endif

Event::Event(int device_index) : device_index_(device_index) {
  if (device_index_ < 0) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  cudaEvent_t event = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  handle_ = event;
#else
  TORCH_CHECK(false, "fastoffload: this build has no CUDA support; rebuild with a CUDA toolkit to use cuda:",
              std::to_string(device_index));
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
  int least = 0;
  int greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  // Non-blocking: the copy stream must never serialise with the legacy default stream. High priority:
  // a prefetch should not queue behind compute kernels for the copy engine's attention.
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  copy_stream_ = stream;
  cudaEvent_t join = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  join_event_ = join;
#else
  TORCH_CHECK(false, "fastoffload: this build has no CUDA support; rebuild with a CUDA toolkit to use cuda:",
              std::to_string(device_index));
#endif
}

CopyEngine::~CopyEngine() {
#ifdef FASTOFFLOAD_WITH_CUDA
  if (copy_stream_ != nullptr) {
    // A copy still in flight reads pinned memory that is about to be freed: finish it first.
    (void)cudaStreamSynchronize(as_stream(copy_stream_));
    (void)cudaStreamDestroy(as_stream(copy_stream_));
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

void CopyEngine::copy_to_device(void* dst, const void* src, size_t nbytes, Event& free_event, Event& ready_event) {
  copies_issued_ += 1;
  bytes_copied_ += nbytes;
  if (is_host()) {
    if (nbytes > 0) std::memcpy(dst, src, nbytes);
    return;
  }
#ifdef FASTOFFLOAD_WITH_CUDA
  cudaStream_t stream = as_stream(copy_stream_);
  if (capturing()) {
    C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(current_stream())));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, as_event(join_event_), 0));
    forked_ = true;
  }
  if (free_event.recorded_ && free_event.epoch_ == capture_epoch_)
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, as_event(free_event.handle_), 0));
  if (nbytes > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaEventRecord(as_event(ready_event.handle_), stream));
  ready_event.recorded_ = true;
  ready_event.epoch_ = capture_epoch_;
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
#endif
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
}

void CopyEngine::end_capture() {
  if (!capturing()) return;
  // Join the copy stream back: a capture must end with every forked stream joined.
  if (forked_) current_waits_for_copies();
  capture_epoch_ = 0;
  forked_ = false;
}

void CopyEngine::current_waits_for_copies() {
  if (is_host()) return;
#ifdef FASTOFFLOAD_WITH_CUDA
  C10_CUDA_CHECK(cudaEventRecord(as_event(join_event_), as_stream(copy_stream_)));
  C10_CUDA_CHECK(cudaStreamWaitEvent(as_stream(current_stream()), as_event(join_event_), 0));
#endif
}

}  // namespace fastoffload
