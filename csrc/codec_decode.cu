// Device decoder of the block codec (format: codec_format.h). One thread block decodes one tile, 8 KiB
// of output: 256 threads, each reading 16 sign+mantissa bytes and 8 bytes of codes and writing 32 bytes,
// so the kernel is a single memory-bound pass. A tile with exceptions goes through shared memory once
// to patch them; raw segments are copied 16 bytes per thread and step.
#include <cuda_runtime.h>

#include "codec_decode.h"
#include "codec_format.h"

namespace fastoffload {
namespace codec {
namespace {

constexpr int kThreads = 256;
constexpr int kValuesPerThread = kTileValues / kThreads;  // 16
static_assert(kValuesPerThread == 16, "one thread decodes 16 values: one 16-byte load of the plane");

__device__ __forceinline__ uint32_t value_of(uint32_t sm, uint32_t exponent) {
  return ((sm & 0x80u) << 8) | (exponent << 7) | (sm & 0x7Fu);
}

__device__ void copy_raw_tile(const SegmentDesc& d, uint32_t local, const uint8_t* __restrict__ src,
                              uint8_t* __restrict__ dst) {
  const uint64_t begin = static_cast<uint64_t>(local) * kTileBytes;
  const uint64_t remaining = d.out_bytes - begin;
  const uint32_t length = remaining < kTileBytes ? static_cast<uint32_t>(remaining) : kTileBytes;
  const uint8_t* from = src + d.plane_offset + begin;
  uint8_t* to = dst + d.dst_offset + begin;
  uint32_t done = 0;
  if (((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to)) & 15u) == 0) {
    const uint32_t vectors = length / 16;
    for (uint32_t i = threadIdx.x; i < vectors; i += kThreads)
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
    done = vectors * 16;
  }
  for (uint32_t i = done + threadIdx.x; i < length; i += kThreads) to[i] = from[i];
}

__device__ void decode_bf16_tile(const SegmentDesc& d, uint32_t local, const uint8_t* __restrict__ src,
                                 uint8_t* __restrict__ dst, uint8_t* exponents) {
  const uint64_t first = static_cast<uint64_t>(local) * kTileValues;
  const uint64_t left = d.out_bytes / 2 - first;
  const uint32_t count = left < kTileValues ? static_cast<uint32_t>(left) : kTileValues;
  const uint32_t base = threadIdx.x * kValuesPerThread;
  const uint8_t* sm_plane = src + d.plane_offset + first;
  const uint8_t* codes = src + d.code_offset + first / 2;
  uint32_t sm[4] = {0, 0, 0, 0};
  uint32_t code[2] = {0, 0};
  const bool full = base + kValuesPerThread <= count;
  if (full) {
    const uint4 s = *reinterpret_cast<const uint4*>(sm_plane + base);
    const uint2 c = *reinterpret_cast<const uint2*>(codes + base / 2);
    sm[0] = s.x; sm[1] = s.y; sm[2] = s.z; sm[3] = s.w;
    code[0] = c.x; code[1] = c.y;
  } else {
    for (uint32_t k = 0; k < kValuesPerThread && base + k < count; ++k) {
      sm[k / 4] |= static_cast<uint32_t>(sm_plane[base + k]) << (8 * (k % 4));
      if (k % 2 == 0) code[k / 8] |= static_cast<uint32_t>(codes[(base + k) / 2]) << (4 * (k % 8));
    }
  }
  uint8_t e[kValuesPerThread];
#pragma unroll
  for (int k = 0; k < kValuesPerThread; ++k) e[k] = d.table[(code[k / 8] >> (4 * (k % 8))) & 0xFu];

  // The exception range is the same for every thread of the tile, so the barriers are uniform.
  const uint32_t* starts = reinterpret_cast<const uint32_t*>(src + d.exc_index_offset);
  uint32_t end = starts[local + 1];
  end = end < d.exc_count ? end : d.exc_count;
  uint32_t begin = starts[local];
  begin = begin < end ? begin : end;
  if (begin < end) {
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) exponents[base + k] = e[k];
    __syncthreads();
    const uint32_t* entries = reinterpret_cast<const uint32_t*>(src + d.exc_offset);
    for (uint32_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const uint32_t entry = entries[i];
      const uint32_t position = entry & 0xFFFFu;
      if (position < count) exponents[position] = static_cast<uint8_t>(entry >> 16);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) e[k] = exponents[base + k];
  }

  uint16_t* out = reinterpret_cast<uint16_t*>(dst + d.dst_offset) + first;
  if (full) {
    uint32_t words[8];
#pragma unroll
    for (int k = 0; k < kValuesPerThread; k += 2) {
      const uint32_t a = value_of((sm[k / 4] >> (8 * (k % 4))) & 0xFFu, e[k]);
      const uint32_t b = value_of((sm[(k + 1) / 4] >> (8 * ((k + 1) % 4))) & 0xFFu, e[k + 1]);
      words[k / 2] = a | (b << 16);
    }
    uint4* to = reinterpret_cast<uint4*>(out + base);
    to[0] = make_uint4(words[0], words[1], words[2], words[3]);
    to[1] = make_uint4(words[4], words[5], words[6], words[7]);
  } else {
    for (uint32_t k = 0; k < kValuesPerThread && base + k < count; ++k)
      out[base + k] = static_cast<uint16_t>(value_of((sm[k / 4] >> (8 * (k % 4))) & 0xFFu, e[k]));
  }
}

__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                                          uint32_t num_segments) {
  __shared__ SegmentDesc segment;
  __shared__ uint8_t exponents[kTileValues];
  const uint32_t tile = blockIdx.x;
  if (threadIdx.x == 0) {
    const SegmentDesc* table = reinterpret_cast<const SegmentDesc*>(src + sizeof(Header));
    uint32_t lo = 0;
    uint32_t hi = num_segments - 1;
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) / 2;
      if (table[mid].first_tile <= tile) lo = mid;
      else hi = mid - 1;
    }
    segment = table[lo];
  }
  __syncthreads();
  const uint32_t local = tile - segment.first_tile;
  if (segment.kind == kRaw) copy_raw_tile(segment, local, src, dst);
  else decode_bf16_tile(segment, local, src, dst, exponents);
}

}  // namespace

int launch_decode(const uint8_t* src, uint8_t* dst, uint32_t num_segments, uint32_t num_tiles, void* stream) {
  if (num_tiles == 0 || num_segments == 0) return static_cast<int>(cudaSuccess);
  decode_kernel<<<num_tiles, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, num_segments);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace codec
}  // namespace fastoffload
