#include "layer_store.h"

#include <algorithm>
#include <cstring>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include "digest.h"

namespace fastoffload {
namespace {

size_t align_up(size_t value) {
  constexpr size_t a = PinnedPool::kAlignment;
  return (value + a - 1) / a * a;
}

size_t storage_span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return static_cast<size_t>(last + 1) * t.element_size();
}

// A uint8 tensor over the bytes of `t`'s storage span, on `t`'s device.
at::Tensor span_bytes(const at::Tensor& t, size_t nbytes) {
  at::Tensor bytes = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(t.device()));
  bytes.set_(t.storage(), static_cast<int64_t>(t.storage_offset() * t.element_size()),
             {static_cast<int64_t>(nbytes)}, {1});
  return bytes;
}

std::vector<at::Tensor> resolve_lazy_bits(const std::vector<at::Tensor>& tensors) {
  // A conjugate or negative view stores its values with a lazy bit that raw bytes do not carry:
  // pack the values it means (binding the parameter to the packed bytes then clears the bit).
  std::vector<at::Tensor> resolved;
  resolved.reserve(tensors.size());
  at::NoGradGuard no_grad;
  for (const at::Tensor& t : tensors) {
    const bool lazy = t.defined() && !t.is_meta() && t.layout() == at::kStrided && (t.is_conj() || t.is_neg());
    resolved.push_back(lazy ? t.detach().resolve_conj().resolve_neg() : t);
  }
  return resolved;
}

// The first byte of `t`'s storage span on the host (t must be a CPU tensor).
const void* span_data(const at::Tensor& t) {
  return static_cast<const char*>(t.storage().data()) + t.storage_offset() * t.element_size();
}

// A CPU uint8 tensor over the `nbytes` of `region`, keeping it alive.
at::Tensor bytes_over(const std::shared_ptr<PoolAllocation>& region, size_t nbytes) {
  std::shared_ptr<PoolAllocation> keep_alive = region;
  return at::from_blob(
      region->data(), {static_cast<int64_t>(nbytes)}, [keep_alive](void*) {},
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

std::vector<codec::TensorSpan> codec_spans(const std::vector<TensorLayout>& layout) {
  std::vector<codec::TensorSpan> spans;
  spans.reserve(layout.size());
  for (const TensorLayout& entry : layout) spans.push_back({entry.offset, entry.nbytes, entry.dtype == at::kBFloat16});
  return spans;
}

// Copies tensor `source`'s span into its place in `host_bytes`; returns the digest of the packed bytes.
uint64_t pack_and_digest(at::Tensor& host_bytes, const TensorLayout& entry, const at::Tensor& source) {
  char* dst = static_cast<char*>(host_bytes.data_ptr()) + entry.offset;
  if (source.device().is_cpu()) return copy_and_digest(dst, span_data(source), entry.nbytes);
  // From a device: the copy is a DMA, so the hash reads the packed bytes back once.
  host_bytes.narrow(0, static_cast<int64_t>(entry.offset), static_cast<int64_t>(entry.nbytes))
      .copy_(span_bytes(source, entry.nbytes));
  return digest_bytes(dst, entry.nbytes);
}

}  // namespace

std::vector<uint64_t> tensor_digests(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
  size_t total = 0;
  const std::vector<TensorLayout> layout = plan_layout(names, tensors, &total);
  at::NoGradGuard no_grad;
  std::vector<uint64_t> digests;
  digests.reserve(tensors.size());
  for (size_t j = 0; j < tensors.size(); ++j) {
    const size_t nbytes = layout[j].nbytes;
    if (nbytes == 0 || tensors[j].device().is_cpu()) {
      digests.push_back(nbytes == 0 ? digest_bytes(nullptr, 0) : digest_bytes(span_data(tensors[j]), nbytes));
      continue;
    }
    const at::Tensor host = span_bytes(tensors[j], nbytes).to(at::kCPU);
    digests.push_back(digest_bytes(host.data_ptr(), nbytes));
  }
  return digests;
}

std::vector<TensorLayout> plan_layout(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                      size_t* total_bytes) {
  TORCH_CHECK(names.size() == tensors.size(), "fastoffload: got ", std::to_string(names.size()), " names for ", std::to_string(tensors.size()),
              " tensors");
  std::vector<TensorLayout> layout;
  layout.reserve(tensors.size());
  size_t offset = 0;
  for (size_t j = 0; j < tensors.size(); ++j) {
    const at::Tensor& t = tensors[j];
    const std::string& name = names[j];
    TORCH_CHECK(t.defined(), "fastoffload: parameter '", name, "' is undefined");
    TORCH_CHECK(!t.is_meta(), "fastoffload: parameter '", name,
                "' is on the meta device and has no values to offload; materialize the model first "
                "(e.g. model.to_empty(device=...) followed by load_state_dict)");
    TORCH_CHECK(t.layout() == at::kStrided, "fastoffload: parameter '", name, "' has layout ", t.layout(),
                "; only dense (strided) tensors can be offloaded. Convert it with .to_dense() first");
    TORCH_CHECK(!t.is_quantized(), "fastoffload: parameter '", name,
                "' is a quantized tensor, which cannot be packed; dequantize it or keep its block resident");
    TORCH_CHECK(t.unsafeGetTensorImpl()->has_storage(), "fastoffload: parameter '", name,
                "' is a tensor subclass without storage of its own (e.g. DTensor or a wrapper subclass); "
                "keep its block resident (resident_blocks) or convert it to a plain tensor");
    TensorLayout entry;
    entry.name = name;
    entry.dtype = t.scalar_type();
    entry.sizes = t.sizes().vec();
    entry.strides = t.strides().vec();
    entry.nbytes = storage_span_bytes(t);
    entry.offset = offset;
    offset = align_up(offset + entry.nbytes);
    layout.push_back(std::move(entry));
  }
  *total_bytes = offset;
  return layout;
}

at::Tensor view_of(const c10::Storage& storage, const at::TensorOptions& options, size_t base_offset,
                   const TensorLayout& layout) {
  at::Tensor view = at::empty({0}, options.dtype(layout.dtype));
  const size_t itemsize = c10::elementSize(layout.dtype);
  view.set_(storage, static_cast<int64_t>((base_offset + layout.offset) / itemsize), layout.sizes, layout.strides);
  return view;
}

at::Tensor clone_with_layout(const at::Tensor& src, const TensorLayout& layout, at::Device target) {
  at::NoGradGuard no_grad;
  TensorLayout at_zero = layout;
  at_zero.offset = 0;
  at::Tensor bytes = at::empty({static_cast<int64_t>(std::max<size_t>(layout.nbytes, 1))},
                               at::TensorOptions().dtype(at::kByte).device(target));
  if (layout.nbytes > 0) bytes.narrow(0, 0, static_cast<int64_t>(layout.nbytes)).copy_(span_bytes(src, layout.nbytes));
  return view_of(bytes.storage(), at::TensorOptions().device(target), 0, at_zero);
}

LayerStore::LayerStore(std::shared_ptr<PinnedPool> pool) : pool_(std::move(pool)) {
  TORCH_CHECK(pool_ != nullptr, "fastoffload: LayerStore needs a PinnedPool");
}

LayerStore::~LayerStore() {
  try {
    finish_pins();
  } catch (...) {
    // Nobody is left to report a failed load to; what mattered was that it ended.
  }
}

StoredBlock LayerStore::pack(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                             const std::string& segment_name, bool owner, bool pin, bool digest) {
  const std::vector<at::Tensor> tensors = resolve_lazy_bits(params);
  StoredBlock block;
  block.layout = plan_layout(names, tensors, &block.bytes);
  const bool shared = !segment_name.empty();
  block.host = shared ? pool_->allocate_shared(segment_name, block.bytes, owner)
                      : pool_->allocate(block.bytes, /*defer_pin=*/true);
  block.shared = shared;
  block.shared_owner = shared && owner;
  std::shared_ptr<PoolAllocation> keep_alive = block.host;
  block.host_bytes = at::from_blob(
      block.host->data(), {static_cast<int64_t>(block.bytes)}, [keep_alive](void*) {},
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  at::NoGradGuard no_grad;
  // A non-owner's segment already holds the owner's bytes, laid out as `block.layout` says.
  for (size_t j = 0; j < tensors.size() && (!shared || owner); ++j) {
    const TensorLayout& entry = block.layout[j];
    if (shared || digest) {
      block.digests.push_back(entry.nbytes == 0 ? digest_bytes(nullptr, 0)
                                                : pack_and_digest(block.host_bytes, entry, tensors[j]));
      continue;
    }
    if (entry.nbytes == 0) continue;
    block.host_bytes.narrow(0, static_cast<int64_t>(entry.offset), static_cast<int64_t>(entry.nbytes))
        .copy_(span_bytes(tensors[j], entry.nbytes));
  }
  if (pin || shared) pool_->pin(*block.host);
  block.tensors = params;
  return block;
}

size_t LayerStore::add(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, bool pin) {
  blocks_.push_back(pack(names, tensors, std::string(), true, pin));
  return blocks_.size() - 1;
}

size_t LayerStore::add_shared(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                              const std::string& segment_name, bool owner) {
  TORCH_CHECK(!segment_name.empty(), "fastoffload: add_shared needs a segment name");
  blocks_.push_back(pack(names, tensors, segment_name, owner));
  return blocks_.size() - 1;
}

size_t LayerStore::add_shared_compressed(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                         const std::string& segment_name, const codec::EncodeOptions& options,
                                         bool* compressed) {
  TORCH_CHECK(!segment_name.empty(), "fastoffload: add_shared_compressed needs a segment name");
  StoredBlock block = pack(names, tensors, std::string(), true, /*pin=*/false, /*digest=*/true);
  const auto* raw = static_cast<const uint8_t*>(block.host->data());
  const codec::Plan plan = codec::plan_block(raw, block.bytes, codec_spans(block.layout), options);
  const bool pays = plan.coded_segments > 0 && plan.total_bytes < block.bytes;
  std::shared_ptr<PoolAllocation> segment =
      pool_->allocate_shared(segment_name, pays ? plan.total_bytes : block.bytes, /*owner=*/true);
  auto* out = static_cast<uint8_t*>(segment->data());
  if (pays) codec::encode_block(raw, plan, out, options.threads);
  else if (block.bytes > 0) std::memcpy(out, raw, block.bytes);
  pool_->pin(*segment);
  block.shared = true;
  block.shared_owner = true;
  if (pays) {
    block.packed_summary = codec::inspect(out, plan.total_bytes);
    block.packed = std::move(segment);
    block.packed_bytes = plan.total_bytes;
    block.host_bytes = at::Tensor();
    block.host.reset();  // the private raw copy: the segment holds the only copy now
  } else {
    block.host_bytes = bytes_over(segment, block.bytes);
    block.host = std::move(segment);
  }
  *compressed = pays;
  blocks_.push_back(std::move(block));
  return blocks_.size() - 1;
}

size_t LayerStore::attach_shared_compressed(const std::vector<std::string>& names,
                                            const std::vector<at::Tensor>& tensors, const std::string& segment_name,
                                            size_t packed_bytes, uint64_t checksum) {
  TORCH_CHECK(!segment_name.empty(), "fastoffload: attach_shared_compressed needs a segment name");
  StoredBlock block;
  block.layout = plan_layout(names, resolve_lazy_bits(tensors), &block.bytes);
  std::shared_ptr<PoolAllocation> segment = pool_->allocate_shared(segment_name, packed_bytes, /*owner=*/false);
  const auto* data = static_cast<const uint8_t*>(segment->data());
  const codec::Summary summary = codec::inspect(data, packed_bytes);
  TORCH_CHECK(summary.raw_bytes == block.bytes, "fastoffload: the shared segment '", segment_name, "' decodes to ",
              std::to_string(summary.raw_bytes), " bytes but this rank's block packs to ", std::to_string(block.bytes),
              " bytes: the ranks of this host built different parameters");
  const uint64_t stored = reinterpret_cast<const codec::Header*>(data)->checksum;
  TORCH_CHECK(stored == checksum, "fastoffload: the shared segment '", segment_name, "' holds compressed bytes "
              "with checksum ", std::to_string(stored), " but the owner encoded ", std::to_string(checksum),
              ": the segment changed after the owner wrote it; enable offload again on every rank");
  codec::verify_block(data, packed_bytes);  // the bytes themselves, not only the header's claim
  pool_->pin(*segment);
  block.packed_summary = summary;
  block.packed = std::move(segment);
  block.packed_bytes = packed_bytes;
  block.shared = true;
  block.tensors = tensors;
  blocks_.push_back(std::move(block));
  return blocks_.size() - 1;
}

StoredBlock LayerStore::plan_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                       const std::vector<std::vector<int64_t>>& shapes,
                                       const std::vector<FileSpan>& spans, const DiskReader& reader) const {
  TORCH_CHECK(names.size() == tensors.size() && shapes.size() == tensors.size() && spans.size() == tensors.size(),
              "fastoffload: got ", std::to_string(names.size()), " names, ", std::to_string(shapes.size()),
              " shapes and ", std::to_string(spans.size()), " file ranges for ", std::to_string(tensors.size()),
              " tensors");
  StoredBlock block;
  size_t offset = 0;
  for (size_t j = 0; j < tensors.size(); ++j) {
    TORCH_CHECK(tensors[j].defined(), "fastoffload: parameter '", names[j], "' is undefined");
    TensorLayout entry;
    entry.name = names[j];
    entry.dtype = tensors[j].scalar_type();
    entry.sizes = shapes[j];
    entry.strides.assign(shapes[j].size(), 1);
    int64_t numel = 1;
    for (size_t d = shapes[j].size(); d-- > 0;) {
      TORCH_CHECK(shapes[j][d] >= 0, "fastoffload: tensor '", names[j], "' has a negative size");
      entry.strides[d] = std::max<int64_t>(numel, 1);
      numel *= shapes[j][d];
    }
    entry.nbytes = static_cast<size_t>(numel) * c10::elementSize(entry.dtype);
    const auto& [file, file_offset, nbytes] = spans[j];
    TORCH_CHECK(nbytes == entry.nbytes, "fastoffload: tensor '", names[j], "' in ", reader.path(file), " holds ",
                std::to_string(nbytes), " bytes, but the model's parameter needs ", std::to_string(entry.nbytes),
                " (", c10::toString(entry.dtype), "); the checkpoint does not match the model");
    FileRange range;
    range.file = file;
    range.offset = file_offset;
    range.nbytes = nbytes;
    range.name = names[j];
    block.ranges.push_back(std::move(range));
    block.layout.push_back(std::move(entry));
  }
  // Packed in the file's order: where the file holds the tensors back to back at aligned sizes (as a
  // safetensors file does a block's, its names sorted), the packed layout mirrors the file and the
  // block's reads can land in place (DestWindow). Each parameter keeps its own offset, whatever order.
  std::vector<size_t> order(tensors.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const FileRange& x = block.ranges[a];
    const FileRange& y = block.ranges[b];
    return x.file != y.file ? x.file < y.file : x.offset < y.offset;
  });
  for (size_t j : order) {
    block.layout[j].offset = offset;
    block.ranges[j].dest_offset = offset;
    offset = align_up(offset + block.layout[j].nbytes);
  }
  block.bytes = offset;
  block.tensors = tensors;
  return block;
}

size_t LayerStore::add_from_file(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                                 const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans,
                                 const std::shared_ptr<DiskReader>& reader, bool pin) {
  TORCH_CHECK(reader != nullptr, "fastoffload: add_from_file needs a DiskReader");
  StoredBlock block = plan_from_file(names, tensors, shapes, spans, *reader);
  // A large block's region is placed at its file offsets' page alignment (a few pages more), so that a
  // layout that mirrors the file is read in place; a small one's extra pages would cost more than the
  // copy they save.
  DestWindow window;
  if (block.bytes >= kPlacedMinBytes) {
    block.host = pool_->allocate_placed(block.bytes, page_phase(block.ranges), /*defer_pin=*/true);
    window = DestWindow{block.host->begin(), block.host->begin() + block.host->size()};
  } else {
    block.host = pool_->allocate(block.bytes, /*defer_pin=*/true);
  }
  std::shared_ptr<PoolAllocation> keep_alive = block.host;
  block.host_bytes = at::from_blob(
      block.host->data(), {static_cast<int64_t>(block.bytes)}, [keep_alive](void*) {},
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  uint8_t* dest = static_cast<uint8_t*>(block.host->data());
  const bool pins = pin && pool_->pins();
  if (pins && pool_->allows_pageable_fallback()) {
    // A pageable fallback warns, which must happen on the caller's thread to reach Python: read and
    // pin here, one block at a time.
    reader->read(block.ranges, dest, window);
    pool_->pin(*block.host);
  } else {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    PendingLoad load;
    load.block = blocks_.size();
    // The read starts at once, whatever the pin: the disk never waits for a registration. The pin runs
    // beside it on a pin lane; its page faults and the reader's copies land in the same pages, in
    // whichever order, and the bytes the reader wrote stay where they are.
    load.read = reader->submit(block.ranges, dest, nullptr, window);
    if (pins) load.pin = queue_pin(keep_alive);
    pending_.push_back(std::move(load));
  }
  blocks_.push_back(std::move(block));
  return blocks_.size() - 1;
}

std::shared_future<void> LayerStore::queue_pin(std::shared_ptr<PoolAllocation> host) {
  std::shared_future<void>& lane = pin_lanes_[next_lane_];
  next_lane_ = (next_lane_ + 1) % kPinLanes;
  std::shared_future<void> previous = lane;
  std::shared_ptr<PinnedPool> pool = pool_;
  lane = std::async(std::launch::async, [pool, host, previous] {
           if (previous.valid()) previous.wait();  // its failure is its own load's to report
           pool->pin(*host);
         }).share();
  return lane;
}

std::shared_ptr<PoolAllocation> LayerStore::allocate_pinned_later(size_t nbytes) {
  if (!pool_->pins() || pool_->allows_pageable_fallback()) return pool_->allocate(nbytes);  // pinned (or not) now
  std::shared_ptr<PoolAllocation> memory = pool_->allocate(nbytes, /*defer_pin=*/true);
  std::lock_guard<std::mutex> lock(pending_mutex_);
  PendingLoad load;
  load.pin = queue_pin(memory);
  pending_.push_back(std::move(load));
  return memory;
}

std::exception_ptr LayerStore::wait_load(const PendingLoad& load) {
  std::exception_ptr failure;
  try {
    if (load.pin.valid()) load.pin.get();
  } catch (...) {
    failure = std::current_exception();
  }
  // Waited for even when the pin failed: the read writes into the region until it ends, and the
  // caller may free the region once this returns.
  try {
    if (load.read != nullptr) DiskReader::wait(*load.read);
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  return failure;
}

void LayerStore::finish_pins() const {
  std::lock_guard<std::mutex> lock(pending_mutex_);
  std::vector<PendingLoad> pending;
  pending.swap(pending_);
  std::exception_ptr first;
  for (auto& load : pending) {
    std::exception_ptr failed = wait_load(load);  // every other load is still waited for
    if (failed && !first) first = failed;
  }
  if (first) std::rethrow_exception(first);
}

void LayerStore::finish_load(size_t index) const {
  std::lock_guard<std::mutex> lock(pending_mutex_);
  std::exception_ptr first;
  for (size_t k = 0; k < pending_.size();) {
    if (pending_[k].block != index) {
      ++k;
      continue;
    }
    const PendingLoad load = pending_[k];
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
    std::exception_ptr failed = wait_load(load);
    if (failed && !first) first = failed;
  }
  if (first) std::rethrow_exception(first);
}

size_t LayerStore::add_on_disk(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                               const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans,
                               const DiskReader& reader) {
  StoredBlock block = plan_from_file(names, tensors, shapes, spans, reader);
  block.on_disk = true;
  blocks_.push_back(std::move(block));
  return blocks_.size() - 1;
}

LayerStore::SpillRead LayerStore::start_spill(size_t index, DiskReader& reader) const {
  TORCH_CHECK(index < blocks_.size() && !blocks_[index].removed && blocks_[index].on_disk,
              "fastoffload: internal error: block ", std::to_string(index), " is not in the disk tier");
  const StoredBlock& stored = blocks_[index];
  SpillRead read;
  read.index = index;
  // Zeroed: the padding between tensors is encoded too, and must not be whatever the heap held.
  read.raw = at::zeros({static_cast<int64_t>(std::max<size_t>(stored.bytes, 1))},
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  read.job = reader.submit(stored.ranges, read.raw.data_ptr<uint8_t>());
  return read;
}

void LayerStore::wait_spill_read(const SpillRead& read) {
  if (read.job == nullptr) return;
  try {
    DiskReader::wait(*read.job);
  } catch (const c10::Error&) {
  }
}

bool LayerStore::finish_spill(const SpillRead& read, SpillFile& spill, const codec::EncodeOptions& options) {
  DiskReader::wait(*read.job);
  StoredBlock& stored = blocks_.at(read.index);
  const auto* data = read.raw.data_ptr<uint8_t>();
  const codec::Plan plan = codec::plan_block(data, stored.bytes, codec_spans(stored.layout), options);
  if (plan.coded_segments == 0 || plan.total_bytes >= stored.bytes) return false;
  std::vector<uint8_t> out(plan.total_bytes);
  codec::encode_block(data, plan, out.data(), options.threads);
  const codec::Summary summary = codec::inspect(out.data(), plan.total_bytes);
  stored.spill_offset = spill.append(out.data(), plan.total_bytes);  // assigned only once written
  stored.spilled = true;
  stored.packed_bytes = plan.total_bytes;
  stored.packed_summary = summary;
  return true;
}

at::Tensor LayerStore::read_block(size_t index, DiskReader& reader) const {
  const StoredBlock& stored = block(index);
  at::Tensor bytes = at::zeros({static_cast<int64_t>(std::max<size_t>(stored.bytes, 1))},
                               at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  reader.read(stored.ranges, bytes.data_ptr<uint8_t>());
  return bytes;
}

at::Tensor LayerStore::read_tensor(size_t index, size_t j, DiskReader& reader) const {
  const StoredBlock& stored = block(index);
  TORCH_CHECK(j < stored.layout.size(), "fastoffload: block ", std::to_string(index), " has no tensor ", std::to_string(j));
  TensorLayout at_zero = stored.layout[j];
  at_zero.offset = 0;
  at::Tensor bytes = at::empty({static_cast<int64_t>(std::max<size_t>(at_zero.nbytes, 1))},
                               at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  FileRange range = stored.ranges.at(j);
  range.dest_offset = 0;
  reader.read({range}, bytes.data_ptr<uint8_t>());
  return view_of(bytes.storage(), at::TensorOptions().device(at::kCPU), 0, at_zero);
}

void LayerStore::replace(size_t index, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                         bool pin) {
  TORCH_CHECK(index < blocks_.size() && !blocks_[index].removed, "fastoffload: no stored block ", std::to_string(index));
  // Pack first: if packing fails the old copy stays intact.
  StoredBlock fresh = pack(names, tensors, std::string(), true, pin);
  blocks_[index] = std::move(fresh);
}

void LayerStore::make_private(size_t index) {
  TORCH_CHECK(index < blocks_.size() && !blocks_[index].removed, "fastoffload: no stored block ", std::to_string(index));
  StoredBlock& stored = blocks_[index];
  if (!stored.shared) return;
  if (stored.has_packed()) {
    std::shared_ptr<PoolAllocation> packed = pool_->allocate(stored.packed_bytes, /*defer_pin=*/true);
    std::memcpy(packed->data(), stored.packed->data(), stored.packed_bytes);
    pool_->pin(*packed);
    stored.packed = std::move(packed);
    stored.shared = false;
    stored.shared_owner = false;
    stored.digests.clear();
    return;
  }
  std::shared_ptr<PoolAllocation> host = pool_->allocate(stored.bytes, /*defer_pin=*/true);
  if (stored.bytes > 0) std::memcpy(host->data(), stored.host->data(), stored.bytes);
  pool_->pin(*host);
  std::shared_ptr<PoolAllocation> keep_alive = host;
  // Assigned last: until here a failure leaves the block as it was.
  stored.host_bytes = at::from_blob(
      host->data(), {static_cast<int64_t>(stored.bytes)}, [keep_alive](void*) {},
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  stored.host = std::move(host);
  stored.shared = false;
  stored.shared_owner = false;
  stored.digests.clear();
}

void LayerStore::discard_last(size_t index) {
  TORCH_CHECK(index + 1 == blocks_.size(), "fastoffload: internal error: block ", std::to_string(index),
              " is not the last one added");
  blocks_.pop_back();
}

void LayerStore::remove(size_t index) {
  TORCH_CHECK(index < blocks_.size(), "fastoffload: no stored block ", std::to_string(index));
  blocks_[index] = StoredBlock();
  blocks_[index].removed = true;
}

at::Tensor LayerStore::host_view(size_t index, size_t j) const {
  const StoredBlock& stored = block(index);
  TORCH_CHECK(!stored.on_disk, "fastoffload: block ", std::to_string(index),
              " is in the disk tier and has no host copy; read its tensors with read_tensor()");
  TORCH_CHECK(j < stored.layout.size(), "fastoffload: block ", std::to_string(index), " has no tensor ", std::to_string(j));
  const at::Tensor bytes = raw_bytes(index, false);
  return view_of(bytes.storage(), at::TensorOptions().device(at::kCPU), 0, stored.layout[j]);
}

std::vector<at::Tensor> LayerStore::host_views(size_t index) const {
  const StoredBlock& stored = block(index);
  const at::Tensor bytes = raw_bytes(index, false);
  std::vector<at::Tensor> views;
  views.reserve(stored.layout.size());
  for (const TensorLayout& entry : stored.layout)
    views.push_back(view_of(bytes.storage(), at::TensorOptions().device(at::kCPU), 0, entry));
  return views;
}

bool LayerStore::compress(size_t index, const codec::EncodeOptions& options, bool keep_raw) {
  TORCH_CHECK(index < blocks_.size() && !blocks_[index].removed, "fastoffload: no stored block ", std::to_string(index));
  StoredBlock& stored = blocks_[index];
  TORCH_CHECK(!stored.shared, "fastoffload: internal error: a shared host copy cannot be compressed");
  TORCH_CHECK(stored.has_raw(), "fastoffload: internal error: block ", std::to_string(index), " has no raw copy to encode");
  std::vector<codec::TensorSpan> spans;
  spans.reserve(stored.layout.size());
  for (const TensorLayout& entry : stored.layout)
    spans.push_back({entry.offset, entry.nbytes, entry.dtype == at::kBFloat16});
  const auto* raw = static_cast<const uint8_t*>(stored.host->data());
  const codec::Plan plan = codec::plan_block(raw, stored.bytes, spans, options);
  if (plan.coded_segments == 0 || plan.total_bytes >= stored.bytes) {
    pool_->pin(*stored.host);
    return false;
  }
  std::shared_ptr<PoolAllocation> packed = pool_->allocate(plan.total_bytes, /*defer_pin=*/true);
  auto* out = static_cast<uint8_t*>(packed->data());
  codec::encode_block(raw, plan, out, options.threads);
  pool_->pin(*packed);
  stored.packed_summary = codec::inspect(out, plan.total_bytes);
  stored.packed = std::move(packed);
  stored.packed_bytes = plan.total_bytes;
  if (keep_raw) pool_->pin(*stored.host);
  else drop_raw(index);
  return true;
}

void LayerStore::drop_raw(size_t index) {
  StoredBlock& stored = blocks_.at(index);
  if (!stored.has_packed()) return;  // the raw copy is the only one
  stored.host_bytes = at::Tensor();
  stored.host.reset();
}

void LayerStore::drop_packed(size_t index) {
  StoredBlock& stored = blocks_.at(index);
  if (!stored.has_raw()) return;
  stored.packed.reset();
  stored.packed_bytes = 0;
  stored.packed_summary = codec::Summary();
}

at::Tensor LayerStore::raw_bytes(size_t index, bool verify) const {
  const StoredBlock& stored = block(index);
  TORCH_CHECK(!stored.on_disk, "fastoffload: block ", std::to_string(index),
              " is in the disk tier and has no host copy; its bytes are read from the checkpoint");
  if (stored.has_raw()) return stored.host_bytes;
  at::Tensor bytes = at::empty({static_cast<int64_t>(stored.bytes)}, at::TensorOptions().dtype(at::kByte));
  codec::decode_block(static_cast<const uint8_t*>(stored.packed->data()), stored.packed_bytes, bytes.data_ptr<uint8_t>(),
                      stored.bytes, verify);
  return bytes;
}

const StoredBlock& LayerStore::block(size_t index) const {
  TORCH_CHECK(index < blocks_.size(), "fastoffload: no stored block ", std::to_string(index), " (the store holds ",
              std::to_string(blocks_.size()), ")");
  TORCH_CHECK(!blocks_[index].removed, "fastoffload: block ", std::to_string(index), " was removed from the store (detached)");
  return blocks_[index];
}

size_t LayerStore::max_block_bytes() const {
  size_t result = 0;
  for (const auto& b : blocks_) result = std::max(result, b.bytes);
  return result;
}

size_t LayerStore::max_disk_block_bytes() const {
  size_t result = 0;
  for (const auto& b : blocks_)
    if (b.on_disk) result = std::max(result, b.bytes);
  return result;
}

size_t LayerStore::max_packed_bytes() const {
  size_t result = 0;
  for (const auto& b : blocks_) result = std::max(result, b.packed_bytes);
  return result;
}

size_t LayerStore::total_bytes() const {
  size_t result = 0;
  for (const auto& b : blocks_) result += b.bytes;
  return result;
}

}  // namespace fastoffload
