#include "codec.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>

#include <c10/util/Exception.h>

#include "parallel.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the codec reads bf16 values as little-endian bytes");

namespace fastoffload {
namespace codec {
namespace {

constexpr size_t kHistogramChunk = size_t{1} << 20;  // values per histogram job
constexpr size_t kTilesPerJob = 32;                  // 256 KiB of output per encode/decode job
constexpr size_t kChecksumChunk = size_t{1} << 20;
constexpr uint8_t kExceptionFlag = 0x10;
constexpr uint8_t kEscape = 15;

size_t align_to(size_t value, size_t alignment) { return (value + alignment - 1) / alignment * alignment; }

uint8_t exponent_of(uint16_t v) { return static_cast<uint8_t>((v >> 7) & 0xFF); }
uint8_t sign_mantissa_of(uint16_t v) { return static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F)); }
uint16_t compose(uint8_t sm, uint8_t exponent) {
  return static_cast<uint16_t>((static_cast<uint16_t>(sm & 0x80) << 8) | (static_cast<uint16_t>(exponent) << 7) |
                               (sm & 0x7F));
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

uint64_t chunk_hash(const uint8_t* data, size_t nbytes, uint64_t index);

// The checksum covers the header too (with its checksum field taken as zero), so no byte of the region
// can change unnoticed.
uint64_t region_checksum(const uint8_t* region, size_t nbytes, unsigned threads) {
  Header h;
  std::memcpy(&h, region, sizeof(Header));
  h.checksum = 0;
  const uint64_t head = chunk_hash(reinterpret_cast<const uint8_t*>(&h), sizeof(Header), ~uint64_t{0});
  return mix64(head ^ checksum(region + sizeof(Header), nbytes - sizeof(Header), threads));
}

uint64_t chunk_hash(const uint8_t* data, size_t nbytes, uint64_t index) {
  // Four independent lanes: the multiply chains overlap, so one core hashes several GB/s.
  uint64_t lane[4] = {0x9E3779B97F4A7C15ULL ^ index, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL, 0x27D4EB2F165667C5ULL};
  size_t i = 0;
  for (; i + 32 <= nbytes; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * k, 8);
      lane[k] = rotl(lane[k] ^ (w * 0x87C37B91114253D5ULL), 29) * 0x4CF5AD432745937FULL;
    }
  }
  uint64_t h = mix64(lane[0]) ^ rotl(mix64(lane[1]), 17) ^ rotl(mix64(lane[2]), 31) ^ rotl(mix64(lane[3]), 47);
  for (; i < nbytes; ++i) h = (h ^ data[i]) * 0x100000001B3ULL;
  return mix64(h ^ nbytes);
}

// The 16-entry exponent table of a segment and each exponent byte's code (kExceptionFlag: not in it).
struct Coding {
  std::array<uint8_t, 16> table{};
  std::vector<uint8_t> code_of = std::vector<uint8_t>(256, 0);
  uint64_t exceptions = 0;
};

std::array<uint64_t, 256> exponent_histogram(const uint8_t* values, size_t count, unsigned threads) {
  std::array<uint64_t, 256> total{};
  std::mutex mutex;
  const size_t jobs = (count + kHistogramChunk - 1) / kHistogramChunk;
  parallel_for(jobs, threads, [&](size_t job) {
    std::array<uint64_t, 256> local{};
    const size_t end = std::min(count, (job + 1) * kHistogramChunk);
    for (size_t i = job * kHistogramChunk; i < end; ++i) local[exponent_of(load_u16(values + 2 * i))] += 1;
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t e = 0; e < 256; ++e) total[e] += local[e];
  });
  return total;
}

Coding choose_coding(const std::array<uint64_t, 256>& histogram) {
  std::array<int, 256> order;
  std::iota(order.begin(), order.end(), 0);
  // Ties by exponent value, so the table does not depend on the sort implementation.
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return histogram[a] != histogram[b] ? histogram[a] > histogram[b] : a < b; });
  size_t distinct = 0;
  while (distinct < 256 && histogram[order[distinct]] > 0) ++distinct;
  Coding coding;
  // Up to 16 distinct exponents fit the table; beyond that code 15 is the escape to the exception list.
  const size_t in_table = distinct <= 16 ? distinct : 15;
  for (size_t e = 0; e < 256; ++e) coding.code_of[e] = kExceptionFlag | kEscape;
  for (size_t c = 0; c < in_table; ++c) {
    coding.table[c] = static_cast<uint8_t>(order[c]);
    coding.code_of[order[c]] = static_cast<uint8_t>(c);
  }
  for (size_t k = in_table; k < distinct; ++k) coding.exceptions += histogram[order[k]];
  return coding;
}

size_t coded_bytes(size_t values, uint64_t exceptions) {
  const uint64_t tiles = tiles_of(2 * values);
  return align_to(values, kPlaneAlignment) + align_to((values + 1) / 2, kPlaneAlignment) +
         align_to(4 * (tiles + 1), kPlaneAlignment) + align_to(4 * exceptions, kPlaneAlignment);
}

SegmentDesc raw_segment(size_t begin, size_t end) {
  SegmentDesc d{};
  d.kind = kRaw;
  d.dst_offset = begin;
  d.out_bytes = end - begin;
  return d;
}

void push_raw(std::vector<SegmentDesc>& segments, std::vector<std::vector<uint8_t>>& codes, size_t begin, size_t end) {
  if (begin >= end) return;
  // An unaligned start (after a coded tensor of odd length) gets a short head of its own, so the long
  // rest of the range starts aligned and the device copies it 16 bytes at a time.
  if (begin % kPlaneAlignment != 0) {
    const size_t head = std::min(end, align_to(begin, 256));
    segments.push_back(raw_segment(begin, head));
    codes.emplace_back();
    begin = head;
  }
  if (begin < end) {
    segments.push_back(raw_segment(begin, end));
    codes.emplace_back();
  }
}

void lay_out(Plan& plan) {
  size_t offset = align_to(sizeof(Header) + plan.segments.size() * sizeof(SegmentDesc), kPlaneAlignment);
  uint64_t tile = 0;
  for (SegmentDesc& d : plan.segments) {
    const uint64_t tiles = tiles_of(d.out_bytes);
    d.first_tile = static_cast<uint32_t>(tile);
    tile += tiles;
    TORCH_CHECK(tile <= UINT32_MAX, "fastoffload: a block of ", std::to_string(plan.raw_bytes),
                " bytes is too large for the codec (more than 2^32 tiles); offload it uncompressed");
    d.plane_offset = offset;
    if (d.kind == kRaw) {
      offset = align_to(offset + d.out_bytes, kPlaneAlignment);
      continue;
    }
    const size_t values = d.out_bytes / 2;
    offset = align_to(offset + values, kPlaneAlignment);
    d.code_offset = offset;
    offset = align_to(offset + (values + 1) / 2, kPlaneAlignment);
    d.exc_index_offset = offset;
    offset = align_to(offset + 4 * (tiles + 1), kPlaneAlignment);
    d.exc_offset = offset;
    offset = align_to(offset + 4 * static_cast<size_t>(d.exc_count), kPlaneAlignment);
  }
  plan.num_tiles = static_cast<uint32_t>(tile);
  plan.total_bytes = offset;
}

struct Job {
  size_t segment;
  uint64_t tile_begin;
  uint64_t tile_end;
};

std::vector<Job> tile_jobs(const std::vector<SegmentDesc>& segments) {
  std::vector<Job> jobs;
  for (size_t s = 0; s < segments.size(); ++s) {
    const uint64_t tiles = tiles_of(segments[s].out_bytes);
    for (uint64_t t = 0; t < tiles; t += kTilesPerJob) jobs.push_back({s, t, std::min<uint64_t>(tiles, t + kTilesPerJob)});
  }
  return jobs;
}

uint64_t tile_values(const SegmentDesc& d, uint64_t tile) {
  return std::min<uint64_t>(kTileValues, d.out_bytes / 2 - tile * kTileValues);
}

// Sign+mantissa plane and codes of one tile; returns its exception count.
uint32_t encode_tile(const uint8_t* raw, const SegmentDesc& d, const uint8_t* code_of, uint64_t tile, uint8_t* out) {
  const uint64_t first = tile * kTileValues;
  const uint64_t count = tile_values(d, tile);
  const uint8_t* values = raw + d.dst_offset + 2 * first;
  uint8_t* sm = out + d.plane_offset + first;
  uint8_t* codes = out + d.code_offset + first / 2;
  uint32_t exceptions = 0;
  for (uint64_t i = 0; i < count; i += 2) {
    const uint16_t a = load_u16(values + 2 * i);
    const uint8_t ca = code_of[exponent_of(a)];
    sm[i] = sign_mantissa_of(a);
    exceptions += ca >> 4;
    uint8_t byte = ca & 0x0F;
    if (i + 1 < count) {
      const uint16_t b = load_u16(values + 2 * i + 2);
      const uint8_t cb = code_of[exponent_of(b)];
      sm[i + 1] = sign_mantissa_of(b);
      exceptions += cb >> 4;
      byte = static_cast<uint8_t>(byte | ((cb & 0x0F) << 4));
    }
    codes[i / 2] = byte;
  }
  return exceptions;
}

void write_exceptions(const uint8_t* raw, const SegmentDesc& d, const uint8_t* code_of, uint64_t tile, uint32_t start,
                      uint8_t* out) {
  const uint64_t first = tile * kTileValues;
  const uint64_t count = tile_values(d, tile);
  const uint8_t* values = raw + d.dst_offset + 2 * first;
  uint8_t* entries = out + d.exc_offset + 4 * static_cast<size_t>(start);
  for (uint64_t i = 0; i < count; ++i) {
    const uint8_t e = exponent_of(load_u16(values + 2 * i));
    if (!(code_of[e] & kExceptionFlag)) continue;
    const uint32_t entry = static_cast<uint32_t>(i) | (static_cast<uint32_t>(e) << 16);
    std::memcpy(entries, &entry, 4);
    entries += 4;
  }
}

bool in_region(uint64_t offset, uint64_t length, uint64_t total) { return offset <= total && length <= total - offset; }

void check_segment(const SegmentDesc& d, size_t index, uint64_t cursor, uint64_t tile, const Header& h) {
  const std::string which = "segment " + std::to_string(index);
  TORCH_CHECK(d.kind == kRaw || d.kind == kBf16, "fastoffload: corrupted compressed block: ", which, " has kind ",
              std::to_string(d.kind), "; re-enable offload to rebuild the host copy");
  TORCH_CHECK(d.dst_offset == cursor && d.out_bytes > 0 && d.out_bytes <= h.raw_bytes - cursor,
              "fastoffload: corrupted compressed block: ", which, " covers [", std::to_string(d.dst_offset), ", +",
              std::to_string(d.out_bytes), ") but the next bytes to decode start at ", std::to_string(cursor), " of ",
              std::to_string(h.raw_bytes));
  TORCH_CHECK(d.first_tile == tile, "fastoffload: corrupted compressed block: ", which, " starts at tile ",
              std::to_string(d.first_tile), ", expected ", std::to_string(tile));
  const uint64_t total = h.total_bytes;
  if (d.kind == kRaw) {
    TORCH_CHECK(in_region(d.plane_offset, d.out_bytes, total), "fastoffload: corrupted compressed block: ", which,
                " reads past the end of the region");
    return;
  }
  const uint64_t values = d.out_bytes / 2;
  const uint64_t tiles = tiles_of(d.out_bytes);
  const bool aligned = d.out_bytes % 2 == 0 && d.dst_offset % kPlaneAlignment == 0 &&
                       d.plane_offset % kPlaneAlignment == 0 && d.code_offset % kPlaneAlignment == 0 &&
                       d.exc_index_offset % 4 == 0 && d.exc_offset % 4 == 0;
  TORCH_CHECK(aligned, "fastoffload: corrupted compressed block: ", which, " has misaligned planes");
  TORCH_CHECK(in_region(d.plane_offset, values, total) && in_region(d.code_offset, (values + 1) / 2, total) &&
                  in_region(d.exc_index_offset, 4 * (tiles + 1), total) &&
                  in_region(d.exc_offset, 4 * static_cast<uint64_t>(d.exc_count), total),
              "fastoffload: corrupted compressed block: ", which, " reads past the end of the region");
}

void decode_tile(const uint8_t* src, const SegmentDesc& d, uint64_t tile, uint8_t* dst) {
  if (d.kind == kRaw) {
    const uint64_t begin = tile * kTileBytes;
    const uint64_t length = std::min<uint64_t>(kTileBytes, d.out_bytes - begin);
    std::memcpy(dst + d.dst_offset + begin, src + d.plane_offset + begin, length);
    return;
  }
  const uint64_t first = tile * kTileValues;
  const uint64_t count = tile_values(d, tile);
  const uint8_t* sm = src + d.plane_offset + first;
  const uint8_t* codes = src + d.code_offset + first / 2;
  uint8_t* out = dst + d.dst_offset + 2 * first;
  for (uint64_t i = 0; i < count; ++i) {
    const uint8_t code = (codes[i / 2] >> ((i & 1) * 4)) & 0x0F;
    const uint16_t v = compose(sm[i], d.table[code]);
    std::memcpy(out + 2 * i, &v, 2);
  }
  const uint32_t begin = load_u32(src + d.exc_index_offset + 4 * tile);
  const uint32_t end = load_u32(src + d.exc_index_offset + 4 * (tile + 1));
  TORCH_CHECK(begin <= end && end <= d.exc_count, "fastoffload: corrupted compressed block: tile ",
              std::to_string(d.first_tile + tile), " lists exceptions [", std::to_string(begin), ", ",
              std::to_string(end), ") of ", std::to_string(d.exc_count));
  for (uint32_t k = begin; k < end; ++k) {
    const uint32_t entry = load_u32(src + d.exc_offset + 4 * static_cast<uint64_t>(k));
    const uint32_t position = entry & 0xFFFF;
    TORCH_CHECK(position < count, "fastoffload: corrupted compressed block: an exception of tile ",
                std::to_string(d.first_tile + tile), " is at position ", std::to_string(position), " of ",
                std::to_string(count));
    const uint16_t v = compose(sm[position], static_cast<uint8_t>(entry >> 16));
    std::memcpy(out + 2 * position, &v, 2);
  }
}

}  // namespace

Plan plan_block(const uint8_t* raw, size_t raw_bytes, const std::vector<TensorSpan>& spans,
                const EncodeOptions& options) {
  std::vector<TensorSpan> sorted = spans;
  std::sort(sorted.begin(), sorted.end(), [](const TensorSpan& a, const TensorSpan& b) { return a.offset < b.offset; });
  Plan plan;
  plan.raw_bytes = raw_bytes;
  size_t cursor = 0;    // end of the last coded span
  size_t previous = 0;  // end of the last span
  for (const TensorSpan& span : sorted) {
    if (span.nbytes == 0) continue;  // an empty tensor holds no bytes, wherever its offset points
    TORCH_CHECK(span.offset >= previous && span.nbytes <= raw_bytes && span.offset <= raw_bytes - span.nbytes,
                "fastoffload: codec input tensors must lie inside the block and not overlap, got [",
                std::to_string(span.offset), ", +", std::to_string(span.nbytes), ") after byte ",
                std::to_string(previous), " of ", std::to_string(raw_bytes));
    previous = span.offset + span.nbytes;
    const bool candidate = span.bf16 && span.nbytes >= options.min_bytes && span.nbytes >= 2 &&
                           span.nbytes % 2 == 0 && span.offset % kPlaneAlignment == 0;
    if (!candidate) continue;
    const size_t values = span.nbytes / 2;
    const Coding coding = choose_coding(exponent_histogram(raw + span.offset, values, options.threads));
    if (static_cast<double>(coded_bytes(values, coding.exceptions)) > options.max_ratio * static_cast<double>(span.nbytes))
      continue;
    push_raw(plan.segments, plan.code_of, cursor, span.offset);
    SegmentDesc d{};
    d.kind = kBf16;
    d.dst_offset = span.offset;
    d.out_bytes = span.nbytes;
    TORCH_CHECK(coding.exceptions <= UINT32_MAX, "fastoffload: internal error: too many codec exceptions");
    d.exc_count = static_cast<uint32_t>(coding.exceptions);
    std::memcpy(d.table, coding.table.data(), 16);
    plan.segments.push_back(d);
    plan.code_of.push_back(coding.code_of);
    plan.coded_segments += 1;
    plan.coded_raw_bytes += span.nbytes;
    plan.exceptions += coding.exceptions;
    cursor = span.offset + span.nbytes;
  }
  push_raw(plan.segments, plan.code_of, cursor, raw_bytes);
  lay_out(plan);
  return plan;
}

void encode_block(const uint8_t* raw, const Plan& plan, uint8_t* out, unsigned threads) {
  Header h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.raw_bytes = plan.raw_bytes;
  h.total_bytes = plan.total_bytes;
  h.num_segments = static_cast<uint32_t>(plan.segments.size());
  h.num_tiles = plan.num_tiles;
  std::memcpy(out + sizeof(Header), plan.segments.data(), plan.segments.size() * sizeof(SegmentDesc));
  // Alignment gaps are zeroed so the same block always encodes to the same bytes (and checksum).
  size_t end = sizeof(Header) + plan.segments.size() * sizeof(SegmentDesc);
  auto zero_to = [&](size_t offset) {
    if (offset > end) std::memset(out + end, 0, offset - end);
  };
  for (const SegmentDesc& d : plan.segments) {
    zero_to(d.plane_offset);
    if (d.kind == kRaw) {
      end = d.plane_offset + d.out_bytes;
      continue;
    }
    end = d.plane_offset + d.out_bytes / 2;
    zero_to(d.code_offset);
    end = d.code_offset + (d.out_bytes / 2 + 1) / 2;
    zero_to(d.exc_index_offset);
    end = d.exc_index_offset + 4 * (tiles_of(d.out_bytes) + 1);
    zero_to(d.exc_offset);
    end = d.exc_offset + 4 * static_cast<size_t>(d.exc_count);
  }
  zero_to(plan.total_bytes);

  const std::vector<Job> jobs = tile_jobs(plan.segments);
  std::vector<std::vector<uint32_t>> tile_exceptions(plan.segments.size());
  for (size_t s = 0; s < plan.segments.size(); ++s)
    if (plan.segments[s].kind == kBf16) tile_exceptions[s].assign(tiles_of(plan.segments[s].out_bytes) + 1, 0);
  parallel_for(jobs.size(), threads, [&](size_t j) {
    const Job& job = jobs[j];
    const SegmentDesc& d = plan.segments[job.segment];
    if (d.kind == kRaw) {
      const uint64_t begin = job.tile_begin * kTileBytes;
      const uint64_t length = std::min<uint64_t>(d.out_bytes, job.tile_end * kTileBytes) - begin;
      std::memcpy(out + d.plane_offset + begin, raw + d.dst_offset + begin, length);
      return;
    }
    const uint8_t* code_of = plan.code_of[job.segment].data();
    for (uint64_t t = job.tile_begin; t < job.tile_end; ++t)
      tile_exceptions[job.segment][t + 1] = encode_tile(raw, d, code_of, t, out);
  });
  for (size_t s = 0; s < plan.segments.size(); ++s) {
    std::vector<uint32_t>& starts = tile_exceptions[s];
    if (starts.empty()) continue;
    for (size_t t = 1; t < starts.size(); ++t) starts[t] += starts[t - 1];
    TORCH_CHECK(starts.back() == plan.segments[s].exc_count, "fastoffload: internal error: the codec counted ",
                std::to_string(starts.back()), " exceptions, planned ", std::to_string(plan.segments[s].exc_count),
                " (did the weights change while they were being encoded?)");
    std::memcpy(out + plan.segments[s].exc_index_offset, starts.data(), 4 * starts.size());
  }
  parallel_for(jobs.size(), threads, [&](size_t j) {
    const Job& job = jobs[j];
    const SegmentDesc& d = plan.segments[job.segment];
    if (d.kind != kBf16 || d.exc_count == 0) return;
    const std::vector<uint32_t>& starts = tile_exceptions[job.segment];
    for (uint64_t t = job.tile_begin; t < job.tile_end; ++t)
      if (starts[t + 1] > starts[t]) write_exceptions(raw, d, plan.code_of[job.segment].data(), t, starts[t], out);
  });
  std::memcpy(out, &h, sizeof(Header));
  h.checksum = region_checksum(out, plan.total_bytes, threads);
  std::memcpy(out, &h, sizeof(Header));
}

uint64_t checksum(const uint8_t* data, size_t nbytes, unsigned threads) {
  const size_t chunks = (nbytes + kChecksumChunk - 1) / kChecksumChunk;
  std::vector<uint64_t> hashes(chunks);
  parallel_for(chunks, threads, [&](size_t c) {
    const size_t begin = c * kChecksumChunk;
    hashes[c] = chunk_hash(data + begin, std::min(kChecksumChunk, nbytes - begin), c);
  });
  uint64_t h = mix64(nbytes ^ 0x5851F42D4C957F2DULL);
  for (uint64_t x : hashes) h = mix64(h ^ x) + 0x9E3779B97F4A7C15ULL;
  return h;
}

Summary inspect(const uint8_t* src, size_t src_bytes) {
  TORCH_CHECK(src_bytes >= sizeof(Header), "fastoffload: corrupted compressed block: ", std::to_string(src_bytes),
              " bytes is shorter than its header");
  Header h;
  std::memcpy(&h, src, sizeof(Header));
  TORCH_CHECK(h.magic == kMagic && h.version == kVersion,
              "fastoffload: corrupted compressed block: bad magic or version (not a block this codec wrote); "
              "re-enable offload to rebuild the host copy");
  TORCH_CHECK(h.total_bytes == src_bytes, "fastoffload: corrupted compressed block: its header says ",
              std::to_string(h.total_bytes), " bytes, the region holds ", std::to_string(src_bytes));
  TORCH_CHECK(h.num_segments <= (src_bytes - sizeof(Header)) / sizeof(SegmentDesc),
              "fastoffload: corrupted compressed block: ", std::to_string(h.num_segments),
              " segments do not fit in the region");
  Summary summary;
  summary.raw_bytes = h.raw_bytes;
  summary.total_bytes = h.total_bytes;
  summary.num_segments = h.num_segments;
  summary.num_tiles = h.num_tiles;
  uint64_t cursor = 0;
  uint64_t tile = 0;
  for (uint32_t s = 0; s < h.num_segments; ++s) {
    SegmentDesc d;
    std::memcpy(&d, src + sizeof(Header) + s * sizeof(SegmentDesc), sizeof(SegmentDesc));
    check_segment(d, s, cursor, tile, h);
    cursor += d.out_bytes;
    tile += tiles_of(d.out_bytes);
    if (d.kind == kBf16) {
      summary.coded_segments += 1;
      summary.exceptions += d.exc_count;
    }
  }
  TORCH_CHECK(cursor == h.raw_bytes && tile == h.num_tiles, "fastoffload: corrupted compressed block: its segments "
              "cover ", std::to_string(cursor), " of ", std::to_string(h.raw_bytes), " bytes in ", std::to_string(tile),
              " of ", std::to_string(h.num_tiles), " tiles");
  return summary;
}

void verify_block(const uint8_t* src, size_t src_bytes, unsigned threads) {
  inspect(src, src_bytes);
  Header h;
  std::memcpy(&h, src, sizeof(Header));
  const uint64_t actual = region_checksum(src, src_bytes, threads);
  TORCH_CHECK(actual == h.checksum, "fastoffload: corrupted compressed block: checksum ", std::to_string(actual),
              " does not match the stored ", std::to_string(h.checksum),
              "; the host copy was overwritten after it was encoded. Re-enable offload to rebuild it");
}

void decode_block(const uint8_t* src, size_t src_bytes, uint8_t* dst, size_t dst_bytes, bool verify_checksum,
                  unsigned threads) {
  const Summary summary = inspect(src, src_bytes);
  TORCH_CHECK(summary.raw_bytes == dst_bytes, "fastoffload: the compressed block decodes to ",
              std::to_string(summary.raw_bytes), " bytes, but the destination holds ", std::to_string(dst_bytes));
  if (verify_checksum) verify_block(src, src_bytes, threads);
  std::vector<SegmentDesc> segments(summary.num_segments);
  std::memcpy(segments.data(), src + sizeof(Header), segments.size() * sizeof(SegmentDesc));
  const std::vector<Job> jobs = tile_jobs(segments);
  parallel_for(jobs.size(), threads, [&](size_t j) {
    for (uint64_t t = jobs[j].tile_begin; t < jobs[j].tile_end; ++t) decode_tile(src, segments[jobs[j].segment], t, dst);
  });
}

}  // namespace codec
}  // namespace fastoffload
