// Host-side launcher of the device decoder for tensors (tests and the codec benchmark): checks the
// tensors and the block's descriptors, then decodes on the current CUDA stream. The engine's own path
// is CopyEngine::decode_to_device.
#pragma once

#include <ATen/core/Tensor.h>

namespace fastoffload {
namespace codec {

// host: the compressed block (CPU uint8, contiguous); device_src: the same bytes on a CUDA device;
// dst: a CUDA uint8 tensor of the block's raw size, same device. Asynchronous on the current stream.
void decode_on_device(const at::Tensor& host, const at::Tensor& device_src, at::Tensor& dst);

}  // namespace codec
}  // namespace fastoffload
