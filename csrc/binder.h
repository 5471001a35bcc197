// Binder: points a block's parameters at their bytes in a slot, or at zero-size placeholders.
//
// Every view (block x slot) and every placeholder is built once, when a block is added or its slots
// change, so that acquiring or releasing a block on the hot path is one pointer swap per parameter in
// C++ (TensorImpl::shallow_copy_from, which is what `param.data = t` does underneath minus the
// dispatcher and Python), with no tensor created and no list crossing from Python.
//
// A placeholder is rank-preserving and empty (shape (0,)*ndim, (0,) for scalars), of the parameter's
// dtype, on the offload device: code that inspects `p.device`, `p.dtype` or `p.dim()` between steps
// sees what it saw on a resident model, as with FastVideo's offload. A block's placeholders share one
// empty storage.
//
// The hot path does not read the view and placeholder tensors themselves: what a rebind sets (the
// storage, sizes, strides and offset) is kept per block in flat arrays (`Shapes`), read in order, so
// that the only scattered memory a bind or release touches is the parameters' own TensorImpls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "layer_store.h"
#include "slot_ring.h"

namespace fastoffload {

class Binder {
 public:
  explicit Binder(at::Device device) : device_(device) {}

  // Registers (index == number of blocks so far) or re-registers block `index` after a repack.
  void set_block(size_t index, const StoredBlock& block);
  void build_views(size_t index, const StoredBlock& block, const SlotRing& ring);
  void drop_block(size_t index);

  // Call only right after first_unexpected() found nothing: the recorded versions stay as they are.
  void bind_slot(size_t index, size_t slot);
  // Binds the parameters to views of `buffer` (a private copy of the block's packed bytes, laid out
  // as `block.layout` says) instead of a slot.
  void bind_buffer(size_t index, const StoredBlock& block, const at::Tensor& buffer);
  void bind_placeholders(size_t index) const;
  // Binds arbitrary tensors through the full `set_data` (device changes, autograd bookkeeping).
  void bind_values(size_t index, const std::vector<at::Tensor>& values) const;
  // first_foreign and first_written in one pass: the index of the first parameter that either finds, or
  // -1 (the per-step check; the two below say which it was, for the message).
  int64_t first_unexpected(size_t index) const;
  // Index of the first parameter that was rebound by someone else while holding its placeholder,
  // or -1 when all still hold their placeholders.
  int64_t first_foreign(size_t index) const;
  // Whether parameter `j` of block `index`, offloaded, holds anything but its placeholder (someone
  // rebound it, e.g. `param.data = t`).
  bool rebound_by_caller(size_t index, size_t j) const;
  // Index of the first parameter whose version counter moved since the block was last bound (an
  // in-place write, e.g. `weight.mul_(2)` on its placeholder or on its slot), or -1.
  int64_t first_written(size_t index) const;
  // The current versions become the expected ones (after a bind the caller made on purpose).
  void record_versions(size_t index);

  const std::vector<at::Tensor>& placeholders(size_t index) const { return blocks_.at(index).placeholders; }

 private:
  // Per parameter, what a rebind to a view (or a placeholder) sets, and the dispatch keys and dtype the
  // parameter must have for that short rebind (else the full shallow copy from the tensor itself).
  struct Shape {
    int64_t offset = 0;  // storage offset, in elements
    uint32_t dims = 0;   // sizes at dims[dims .. dims + ndim), strides right after
    uint32_t ndim = 0;
    c10::DispatchKeySet keys;
    caffe2::TypeMeta dtype;
    bool operator==(const Shape& other) const {
      return offset == other.offset && dims == other.dims && ndim == other.ndim && keys == other.keys &&
             dtype == other.dtype;
    }
  };
  struct Shapes {
    std::vector<Shape> shape;
    std::vector<int64_t> dims;
    void add(const at::Tensor& tensor);
    bool operator==(const Shapes& other) const { return shape == other.shape && dims == other.dims; }
  };
  struct Bound {
    std::vector<at::Tensor> tensors;
    std::vector<at::Tensor> placeholders;        // views of `placeholder_storage`
    std::vector<std::vector<at::Tensor>> views;  // [slot][tensor]
    std::vector<uint32_t> versions;              // version counters as of the last bind
    c10::Storage placeholder_storage;            // empty, shared by the block's placeholders
    Shapes placeholder_shapes;
    Shapes view_shapes;                          // the same in every slot (each slot's views start at 0)
    std::vector<c10::Storage> slot_storage;      // [slot]
    bool compact_views = false;                  // view_shapes hold for every slot
  };
  static void rebind(c10::TensorImpl* impl, const c10::Storage& storage, const Shape& shape, const int64_t* dims,
                     const at::Tensor& source);
  static void rebind_all(const Bound& bound, const c10::Storage& storage, const Shapes& shapes,
                         const std::vector<at::Tensor>& sources);
  at::Device device_;
  std::vector<Bound> blocks_;
};

}  // namespace fastoffload
