#include "binder.h"

#include <algorithm>

#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

namespace fastoffload {
namespace {

inline void rebind_full(const at::Tensor& param, const at::Tensor& data) {
  c10::TensorImpl* impl = param.unsafeGetTensorImpl();
  const c10::TensorImpl* source = data.unsafeGetTensorImpl();
  if (impl->key_set() == source->key_set() && impl->dtype() == source->dtype() &&
      !impl->has_symbolic_sizes_strides() && !source->has_symbolic_sizes_strides()) {
    impl->set_storage_keep_dtype(source->unsafe_storage());
    impl->set_sizes_and_strides(source->sizes(), source->strides(), source->storage_offset());
    return;
  }
  impl->shallow_copy_from(data.getIntrusivePtr());
}

// After the block's forward (and before it, after the blocks in between) the parameters' TensorImpls and
// their sources' are mostly out of the cache, and each loop below walks a few cache lines per parameter,
// one dependent load after another: measured in a real forward, the loops cost about twice what they
// cost back to back. Asking for the lines a few parameters ahead lets those misses overlap.
constexpr size_t kPrefetchAhead = 4;

inline void prefetch_impl(const at::Tensor& tensor) {
#if defined(__GNUC__)
  // Every field a rebind reads or writes: the whole TensorImpl, three or four cache lines.
  const char* impl = reinterpret_cast<const char*>(tensor.unsafeGetTensorImpl());
  for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) __builtin_prefetch(impl + offset);
  __builtin_prefetch(impl + sizeof(c10::TensorImpl) - 1);
#else
  (void)tensor;
#endif
}

// A parameter's version counter lives in an object of its own, one more scattered line per parameter in
// the per-step check. VariableVersion holds nothing but the pointer to it; a prefetch of whatever that
// pointer is cannot fault, so a layout change in torch would cost the prefetch, never correctness.
constexpr size_t kVersionAhead = 2;
static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is expected to be one pointer");

inline void prefetch_version(const at::Tensor& tensor) {
#if defined(__GNUC__)
  __builtin_prefetch(*reinterpret_cast<const void* const*>(&tensor.unsafeGetTensorImpl()->version_counter()));
#else
  (void)tensor;
#endif
}

// Before parameter j is rebound: the TensorImpl a few parameters ahead (the flat arrays are read in
// order, which the hardware prefetches by itself).
inline void prefetch_ahead(const std::vector<at::Tensor>& tensors, size_t j) {
  if (j + kPrefetchAhead < tensors.size()) prefetch_impl(tensors[j + kPrefetchAhead]);
}

inline uint32_t version_of(const at::Tensor& param) {
  return param.unsafeGetTensorImpl()->version_counter().current_version();
}

}  // namespace

void Binder::Shapes::add(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  Shape entry;
  entry.offset = impl->storage_offset();
  entry.dims = static_cast<uint32_t>(dims.size());
  entry.ndim = static_cast<uint32_t>(impl->dim());
  entry.keys = impl->key_set();
  entry.dtype = impl->dtype();
  dims.insert(dims.end(), impl->sizes().begin(), impl->sizes().end());
  dims.insert(dims.end(), impl->strides().begin(), impl->strides().end());
  shape.push_back(entry);
}

// The whole cost of acquiring and releasing a block with many small parameters is this function,
// twice per parameter per step. shallow_copy_from (what `param.data = t` does underneath) copies every
// metadata field and re-assigns the parameter's own version counter to itself. Between a parameter and
// the views and placeholders built for it only the storage, sizes, strides and offset differ, so when
// the dispatch keys and the dtype already agree those four are set and nothing else, at about half the
// cost, from the block's flat arrays rather than from the source tensor. Anything else (a parameter cast
// or moved by someone, an inference tensor, symbolic shapes) takes the full copy from the source tensor,
// exactly as before.
inline void Binder::rebind(c10::TensorImpl* impl, const c10::Storage& storage, const Shape& shape, const int64_t* dims,
                           const at::Tensor& source) {
  if (impl->key_set() == shape.keys && impl->dtype() == shape.dtype && !impl->has_symbolic_sizes_strides()) {
    impl->set_storage_keep_dtype(storage);
    impl->set_sizes_and_strides(c10::IntArrayRef(dims + shape.dims, shape.ndim),
                                c10::IntArrayRef(dims + shape.dims + shape.ndim, shape.ndim), shape.offset);
    return;
  }
  impl->shallow_copy_from(source.getIntrusivePtr());
}

void Binder::rebind_all(const Bound& bound, const c10::Storage& storage, const Shapes& shapes,
                        const std::vector<at::Tensor>& sources) {
  const int64_t* dims = shapes.dims.data();
  for (size_t j = 0; j < bound.tensors.size(); ++j) {
    prefetch_ahead(bound.tensors, j);
    rebind(bound.tensors[j].unsafeGetTensorImpl(), storage, shapes.shape[j], dims, sources[j]);
  }
}

void Binder::set_block(size_t index, const StoredBlock& block) {
  TORCH_CHECK(index <= blocks_.size(), "fastoffload: internal error: binder block ", std::to_string(index), " out of order");
  if (index == blocks_.size()) blocks_.emplace_back();
  Bound& bound = blocks_[index];
  bound.tensors = block.tensors;
  bound.views.clear();
  bound.slot_storage.clear();
  bound.view_shapes = Shapes();
  bound.compact_views = false;
  bound.placeholders.clear();
  bound.placeholders.reserve(block.layout.size());
  bound.placeholder_shapes = Shapes();
  // Ordinary tensors even when offload is enabled inside inference_mode(): a parameter bound to an
  // inference tensor would lose its version counting (see build_views).
  c10::InferenceMode normal_tensors(false);
  bound.placeholder_storage = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_)).storage();
  for (const auto& entry : block.layout) {
    std::vector<int64_t> shape(std::max<size_t>(entry.sizes.size(), 1), 0);
    at::Tensor placeholder = at::empty(shape, at::TensorOptions().dtype(entry.dtype).device(device_));
    placeholder.unsafeGetTensorImpl()->set_storage_keep_dtype(bound.placeholder_storage);
    bound.placeholder_shapes.add(placeholder);
    bound.placeholders.push_back(std::move(placeholder));
  }
}

void Binder::build_views(size_t index, const StoredBlock& block, const SlotRing& ring) {
  Bound& bound = blocks_.at(index);
  // Slots are often (re)built inside the first forward, under inference_mode(). Views made there would
  // be inference tensors, and rebinding a parameter to one gives it their dispatch keys: it would stop
  // counting versions, so an in-place write to it inside an inference_mode forward would be silently
  // lost, where the resident model keeps it. Ordinary views keep the parameter an ordinary tensor, as on
  // the resident model, and keep the cheap rebind above.
  c10::InferenceMode normal_tensors(false);
  bound.views.assign(ring.size(), {});
  bound.slot_storage.assign(ring.size(), c10::Storage());
  bound.view_shapes = Shapes();
  for (size_t s = 0; s < ring.size(); ++s) {
    const at::Tensor& buffer = ring.slot(s).buffer;
    const auto options = at::TensorOptions().device(buffer.device());
    auto& views = bound.views[s];
    views.reserve(block.layout.size());
    for (const auto& entry : block.layout) views.push_back(view_of(buffer.storage(), options, 0, entry));
    bound.slot_storage[s] = buffer.storage();
  }
  // One set of shapes serves every slot when each slot's views differ only in their storage (they
  // always do; checked rather than assumed, else each rebind reads its view).
  bound.compact_views = !bound.views.empty();
  if (bound.compact_views)
    for (const at::Tensor& view : bound.views[0]) bound.view_shapes.add(view);
  for (size_t s = 1; s < bound.views.size() && bound.compact_views; ++s) {
    Shapes other;
    for (const at::Tensor& view : bound.views[s]) other.add(view);
    bound.compact_views = other == bound.view_shapes;
  }
}

void Binder::drop_block(size_t index) {
  Bound& bound = blocks_.at(index);
  bound = Bound();
}

void Binder::bind_slot(size_t index, size_t slot) {
  Bound& bound = blocks_[index];
  const auto& views = bound.views[slot];
  // No record_versions: rebinding keeps a parameter's version counter and its value, and the caller
  // has just checked (first_unexpected) that every version is the recorded one.
  if (bound.compact_views) {
    rebind_all(bound, bound.slot_storage[slot], bound.view_shapes, views);
    return;
  }
  for (size_t j = 0; j < bound.tensors.size(); ++j) {
    prefetch_ahead(bound.tensors, j);
    rebind_full(bound.tensors[j], views[j]);
  }
}

void Binder::bind_buffer(size_t index, const StoredBlock& block, const at::Tensor& buffer) {
  Bound& bound = blocks_.at(index);
  const auto options = at::TensorOptions().device(buffer.device());
  for (size_t j = 0; j < bound.tensors.size(); ++j)
    rebind_full(bound.tensors[j], view_of(buffer.storage(), options, 0, block.layout[j]));
  record_versions(index);
}

void Binder::record_versions(size_t index) {
  Bound& bound = blocks_.at(index);
  bound.versions.resize(bound.tensors.size());
  for (size_t j = 0; j < bound.tensors.size(); ++j) bound.versions[j] = version_of(bound.tensors[j]);
}

int64_t Binder::first_written(size_t index) const {
  const Bound& bound = blocks_[index];
  for (size_t j = 0; j < bound.tensors.size() && j < bound.versions.size(); ++j)
    if (version_of(bound.tensors[j]) != bound.versions[j]) return static_cast<int64_t>(j);
  return -1;
}

void Binder::bind_placeholders(size_t index) const {
  const Bound& bound = blocks_[index];
  rebind_all(bound, bound.placeholder_storage, bound.placeholder_shapes, bound.placeholders);
}

void Binder::bind_values(size_t index, const std::vector<at::Tensor>& values) const {
  const Bound& bound = blocks_.at(index);
  TORCH_CHECK(values.size() == bound.tensors.size(), "fastoffload: internal error: ", std::to_string(values.size()),
              " values for ", std::to_string(bound.tensors.size()), " parameters");
  for (size_t j = 0; j < bound.tensors.size(); ++j) bound.tensors[j].set_data(values[j]);
}

int64_t Binder::first_unexpected(size_t index) const {
  const Bound& bound = blocks_[index];
  const size_t versions = bound.versions.size();
  const c10::StorageImpl* placeholder = bound.placeholder_storage.unsafeGetStorageImpl();
  for (size_t j = 0; j < bound.tensors.size(); ++j) {
    prefetch_ahead(bound.tensors, j);
    // Its TensorImpl was asked for kPrefetchAhead - kVersionAhead parameters ago.
    if (j + kVersionAhead < bound.tensors.size()) prefetch_version(bound.tensors[j + kVersionAhead]);
    const c10::TensorImpl* impl = bound.tensors[j].unsafeGetTensorImpl();
    if (impl->unsafe_storage().unsafeGetStorageImpl() != placeholder ||
        (j < versions && impl->version_counter().current_version() != bound.versions[j]))
      return static_cast<int64_t>(j);
  }
  return -1;
}

int64_t Binder::first_foreign(size_t index) const {
  const Bound& bound = blocks_[index];
  const c10::StorageImpl* placeholder = bound.placeholder_storage.unsafeGetStorageImpl();
  for (size_t j = 0; j < bound.tensors.size(); ++j)
    if (bound.tensors[j].unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() != placeholder)
      return static_cast<int64_t>(j);
  return -1;
}

bool Binder::rebound_by_caller(size_t index, size_t j) const {
  const Bound& bound = blocks_.at(index);
  return bound.tensors.at(j).unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() !=
         bound.placeholder_storage.unsafeGetStorageImpl();
}

}  // namespace fastoffload
