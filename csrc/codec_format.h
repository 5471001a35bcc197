// The compressed form of one packed block: plain structs shared by the host codec (codec.cpp) and the
// device decoder (codec_decode.cu), so this header includes nothing but <cstdint>.
//
// One contiguous region, copied to the device in one transfer:
//   Header | SegmentDesc[num_segments] | payload planes (each 16-byte aligned)
// The segments cover the packed block's bytes [0, raw_bytes) back to back, in order. A segment is
//   kRaw:   out_bytes copied as they are from `plane_offset`;
//   kBf16:  out_bytes / 2 bfloat16 values split in two planes: the sign+mantissa byte of each value
//           (raw, `plane_offset`), and a 4-bit code per value (`code_offset`, two per byte, low nibble
//           first) indexing `table`, the segment's 16 most useful exponents. Values whose exponent is not
//           in the table are listed in the exception list (`exc_offset`: uint32 entries, bits 0-15 the
//           position inside its tile, bits 16-23 the exponent byte), tile by tile; `exc_index_offset`
//           holds num_tiles + 1 uint32 starts into that list, so each tile finds its own exceptions.
// Work is cut in tiles of kTileBytes of output; a segment's tiles are numbered from `first_tile`, so a
// decoder finds the segment of any tile by a binary search over the table and decodes tiles
// independently (one CUDA thread block or one host task per tile).
#pragma once

#include <cstdint>

namespace fastoffload {
namespace codec {

constexpr uint32_t kMagic = 0x31434f46u;  // "FOC1" little-endian
constexpr uint32_t kVersion = 1;
constexpr uint32_t kTileBytes = 8192;            // output bytes per tile
constexpr uint32_t kTileValues = kTileBytes / 2;  // bf16 values per tile
constexpr uint32_t kPlaneAlignment = 16;
constexpr uint32_t kRaw = 0;
constexpr uint32_t kBf16 = 1;

struct Header {
  uint32_t magic;
  uint32_t version;
  uint64_t raw_bytes;    // bytes of the decoded block
  uint64_t total_bytes;  // bytes of this whole region
  uint32_t num_segments;
  uint32_t num_tiles;
  uint64_t checksum;     // of bytes [sizeof(Header), total_bytes)
  uint64_t reserved[3];
};
static_assert(sizeof(Header) == 64, "the header is 64 bytes so the segment table stays aligned");

struct SegmentDesc {
  uint32_t kind;
  uint32_t first_tile;
  uint64_t dst_offset;  // where the segment's bytes start in the decoded block
  uint64_t out_bytes;
  uint64_t plane_offset;
  uint64_t code_offset;
  uint64_t exc_index_offset;
  uint64_t exc_offset;
  uint32_t exc_count;
  uint32_t reserved;
  uint8_t table[16];
};
static_assert(sizeof(SegmentDesc) == 80, "segment descriptors keep 16-byte alignment");

inline uint64_t tiles_of(uint64_t out_bytes) { return (out_bytes + kTileBytes - 1) / kTileBytes; }

}  // namespace codec
}  // namespace fastoffload
