#include "codec_launch.h"

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
namespace codec {

void decode_on_device(const at::Tensor& host, const at::Tensor& device_src, at::Tensor& dst) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kByte && host.is_contiguous(),
              "fastoffload: the compressed block must be a contiguous CPU uint8 tensor, got ", host.toString());
  TORCH_CHECK(device_src.is_cuda() && dst.is_cuda() && device_src.device() == dst.device(),
              "fastoffload: the device copy of the compressed block and the output must be on one CUDA device, got ",
              device_src.device().str(), " and ", dst.device().str());
  TORCH_CHECK(device_src.scalar_type() == at::kByte && dst.scalar_type() == at::kByte && device_src.is_contiguous() &&
                  dst.is_contiguous(),
              "fastoffload: the device buffers of the decoder must be contiguous uint8 tensors");
  TORCH_CHECK(device_src.numel() == host.numel(), "fastoffload: the device copy holds ",
              std::to_string(device_src.numel()), " bytes, the compressed block ", std::to_string(host.numel()));
  const Summary summary = inspect(host.data_ptr<uint8_t>(), static_cast<size_t>(host.numel()));
  TORCH_CHECK(static_cast<uint64_t>(dst.numel()) == summary.raw_bytes, "fastoffload: the output must hold the block's ",
              std::to_string(summary.raw_bytes), " decoded bytes, got ", std::to_string(dst.numel()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(device_src.data_ptr()) % kPlaneAlignment == 0 &&
                  reinterpret_cast<uintptr_t>(dst.data_ptr()) % kPlaneAlignment == 0,
              "fastoffload: the device buffers of the decoder must be 16-byte aligned");
#ifdef FASTOFFLOAD_WITH_CUDA
  c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dst.device().index()).stream();
  C10_CUDA_CHECK(static_cast<cudaError_t>(launch_decode(device_src.data_ptr<uint8_t>(), dst.data_ptr<uint8_t>(),
                                                        summary.num_segments, summary.num_tiles, stream)));
#else
  TORCH_CHECK(false, "fastoffload: this build has no CUDA support; rebuild with a CUDA toolkit to decode on a GPU");
#endif
}

}  // namespace codec
}  // namespace fastoffload
