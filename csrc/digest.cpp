#include "digest.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

namespace fastoffload {
namespace {

// 256 KiB: a chunk is hashed right after it is copied, while it still sits in L2.
constexpr size_t kChunkBytes = size_t{1} << 18;
constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;  // odd: multiplication by it is a bijection mod 2^64
constexpr uint64_t kLaneSeeds[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                                    0x082EFA98EC4E6C89ull};

// A bijection of 64-bit values (multiply by an odd constant, then xorshift) that spreads every bit.
inline uint64_t mix(uint64_t x) {
  x *= kMul;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return x;
}

inline uint64_t load_word(const unsigned char* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));  // unaligned-safe; compiles to one load
  return word;
}

// Four independent lanes keep the multiplier busy; a lane's state after a word is mix(state ^ word).
uint64_t digest_chunk(const unsigned char* data, size_t nbytes, uint64_t chunk_index) {
  uint64_t lanes[4];
  for (int i = 0; i < 4; ++i) lanes[i] = kLaneSeeds[i] ^ chunk_index;
  size_t offset = 0;
  for (; offset + 32 <= nbytes; offset += 32) {
    lanes[0] = mix(lanes[0] ^ load_word(data + offset));
    lanes[1] = mix(lanes[1] ^ load_word(data + offset + 8));
    lanes[2] = mix(lanes[2] ^ load_word(data + offset + 16));
    lanes[3] = mix(lanes[3] ^ load_word(data + offset + 24));
  }
  for (int lane = 0; offset + 8 <= nbytes; offset += 8, ++lane) {
    lanes[lane] = mix(lanes[lane] ^ load_word(data + offset));
  }
  if (offset < nbytes) {
    // The tail, zero-padded; the length is folded in below, so padding cannot collide with real zeros.
    uint64_t tail = 0;
    std::memcpy(&tail, data + offset, nbytes - offset);
    lanes[0] = mix(lanes[0] ^ tail);
  }
  uint64_t result = mix(static_cast<uint64_t>(nbytes) ^ kLaneSeeds[0]);
  for (int i = 0; i < 4; ++i) result = mix(result ^ lanes[i]);
  return result;
}

uint64_t fold(const std::vector<uint64_t>& chunks, size_t nbytes) {
  uint64_t result = mix(static_cast<uint64_t>(nbytes) ^ kLaneSeeds[1]);
  for (uint64_t chunk : chunks) result = mix(result ^ chunk);
  return result;
}

// Runs `per_chunk(chunk index, byte offset, byte count)` over every chunk, in parallel.
template <typename PerChunk>
uint64_t over_chunks(size_t nbytes, PerChunk&& per_chunk) {
  const size_t count = (nbytes + kChunkBytes - 1) / kChunkBytes;
  std::vector<uint64_t> chunks(count);
  at::parallel_for(0, static_cast<int64_t>(count), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const size_t offset = static_cast<size_t>(c) * kChunkBytes;
      const size_t length = std::min(kChunkBytes, nbytes - offset);
      chunks[static_cast<size_t>(c)] = per_chunk(static_cast<uint64_t>(c), offset, length);
    }
  });
  return fold(chunks, nbytes);
}

}  // namespace

uint64_t digest_bytes(const void* data, size_t nbytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  return over_chunks(nbytes, [&](uint64_t index, size_t offset, size_t length) {
    return digest_chunk(bytes + offset, length, index);
  });
}

uint64_t copy_and_digest(void* dst, const void* src, size_t nbytes) {
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  return over_chunks(nbytes, [&](uint64_t index, size_t offset, size_t length) {
    std::memcpy(out + offset, in + offset, length);
    return digest_chunk(out + offset, length, index);
  });
}

}  // namespace fastoffload
