// Entry point of the device decoder (codec_decode.cu). A plain header: no CUDA or torch types, so the
// host code that calls it builds the same way with or without CUDA.
#pragma once

#include <cstdint>

namespace fastoffload {
namespace codec {

// Enqueues the decode of the compressed block at device address `src` into `dst` (raw_bytes long) on
// `stream` (a cudaStream_t): one thread block per tile, `num_tiles` of them. Returns the cudaError_t of
// the launch as an int. It does not validate: the host-side caller (CopyEngine::decode_to_device)
// checks its arguments and the block's descriptors (codec::inspect over the host copy of the same bytes).
int launch_decode(const uint8_t* src, uint8_t* dst, uint32_t num_segments, uint32_t num_tiles, void* stream);

}  // namespace codec
}  // namespace fastoffload
