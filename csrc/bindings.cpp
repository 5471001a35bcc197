// Python bindings for fastoffload_ext._C. The only file that includes torch/extension.h.
//
// The per-step methods (acquire, prefetch, release) take an integer handle and keep the GIL: they
// are a few microseconds of host work, and dropping and retaking the GIL would cost more than they
// do. Methods that move whole blocks through host memory release it, always through without_gil().
// Every method that can warn runs under warnings_to_python(), so TORCH_WARN becomes a Python warning.
// Every handle, slot and index from Python is bounds-checked here before it reaches the engine.
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "offload_engine.h"
#include "pinned_pool.h"
#include "shared_segment.h"

namespace py = pybind11;

namespace fastoffload {
namespace {

py::dict pool_stats(const PinnedPool& pool) {
  const PoolStats s = pool.stats();
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["pinned_bytes"] = s.pinned_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["slab_count"] = s.slab_count;
  d["allocation_count"] = s.allocation_count;
  d["fallback_slabs"] = s.fallback_slabs;
  d["shared_bytes"] = s.shared_bytes;
  d["shared_owned_bytes"] = s.shared_owned_bytes;
  d["pin_seconds"] = s.pin_seconds;
  d["backing"] = s.backing;
  return d;
}

// Runs `work` with C++ warnings (TORCH_WARN, e.g. the pageable fallback) collected and raised as
// Python warnings when it returns, instead of only being printed to stderr.
template <typename Work>
auto warnings_to_python(Work&& work) -> decltype(work()) {
  torch::PyWarningHandler warnings;
  try {
    return work();
  } catch (...) {
    warnings.set_in_exception();  // the handler must not raise while an exception is in flight
    throw;
  }
}

// The one way this module releases the GIL: around `work`, with its warnings reaching Python once
// the GIL is back.
template <typename Work>
auto without_gil(Work&& work) -> decltype(work()) {
  return warnings_to_python([&]() -> decltype(work()) {
    py::gil_scoped_release no_gil;
    return work();
  });
}

// Every index that comes from Python is checked here, before it reaches a vector.
size_t checked_block(const OffloadEngine& e, int64_t block) {
  TORCH_CHECK(block >= 0 && static_cast<size_t>(block) < e.num_blocks(), "fastoffload: block handle ",
              std::to_string(block), " is out of range (the engine holds ", std::to_string(e.num_blocks()),
              " blocks); use a handle returned by add_block");
  return static_cast<size_t>(block);
}

size_t checked_slot(const OffloadEngine& e, int64_t slot) {
  TORCH_CHECK(slot >= 0 && static_cast<size_t>(slot) < e.num_slots(), "fastoffload: slot ", std::to_string(slot),
              " is out of range (", std::to_string(e.num_slots()), " slots); slots are numbered from 0");
  return static_cast<size_t>(slot);
}

size_t checked_index(int64_t index) {
  TORCH_CHECK(index >= 0, "fastoffload: a parameter index must be >= 0, got ", std::to_string(index));
  return static_cast<size_t>(index);
}

at::Tensor pool_allocate(const std::shared_ptr<PinnedPool>& pool, size_t nbytes) {
  std::shared_ptr<PoolAllocation> allocation = without_gil([&] { return pool->allocate(nbytes); });
  void* data = allocation->data();
  // The tensor owns the allocation: the memory stays valid however long Python keeps the tensor.
  return at::from_blob(
      data, {static_cast<int64_t>(nbytes)}, [allocation](void*) mutable { allocation.reset(); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

py::dict engine_stats(const OffloadEngine& engine) {
  const EngineStats& s = engine.stats();
  py::dict d;
  d["acquires"] = s.acquires;
  d["prefetches"] = s.prefetches;
  d["prefetch_hits"] = s.prefetch_hits;
  d["cache_hits"] = s.cache_hits;
  d["sync_loads"] = s.sync_loads;
  d["skipped_prefetches"] = s.skipped_prefetches;
  d["copies"] = engine.copy_engine().copies_issued();
  d["bytes_copied"] = engine.copy_engine().bytes_copied();
  d["num_blocks"] = engine.num_blocks();
  d["num_slots"] = engine.num_slots();
  d["slot_bytes"] = engine.slot_bytes();
  d["packed_bytes"] = engine.total_bytes();
  return d;
}

}  // namespace
}  // namespace fastoffload

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastoffload;
  m.doc() = "fastoffload_ext core: pinned pool, packed block store, slot ring, copy engine, binder";
  // Device memory refused (the slot ring) reaches Python as torch.OutOfMemoryError, like torch's own.
  py::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const c10::OutOfMemoryError& oom) {
      py::object type = py::module_::import("torch").attr("OutOfMemoryError");
      PyErr_SetString(type.ptr(), oom.what_without_backtrace());
    }
  });

  m.def("build_info", []() {
    py::dict d;
    d["torch"] = FASTOFFLOAD_TORCH_VERSION;
#ifdef FASTOFFLOAD_WITH_CUDA
    d["cuda"] = true;
    d["cuda_version"] = FASTOFFLOAD_CUDA_VERSION;
#else
    d["cuda"] = false;
    d["cuda_version"] = py::none();
#endif
    d["alignment"] = PinnedPool::kAlignment;
    return d;
  });

  m.attr("SEGMENT_PREFIX") = kSegmentPrefix;
  m.def(
      "sweep_stale_segments", [] { return without_gil([] { return sweep_stale_segments(); }); },
        "Removes /dev/shm/fastoffload-<pid>-* left by owners that died before unlinking them; returns the count.");
  m.def(
      "unlink_shared_segment", [](const std::string& name) { return without_gil([&] { return unlink_segment(name); }); },
      py::arg("name"),
      "Removes the shared segment name `name` if it exists (mappings stay valid); returns whether it did.");

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool",
                                                      "Page-locked host memory in slabs, sub-allocated at exact sizes.")
      .def(py::init([](int device_index, const std::string& backing, size_t limit_bytes, bool allow_pageable_fallback,
                       size_t min_slab_bytes) {
             return warnings_to_python([&] {
               return std::make_shared<PinnedPool>(device_index, parse_backing(backing), limit_bytes,
                                                   allow_pageable_fallback, min_slab_bytes);
             });
           }),
           py::arg("device_index") = -1, py::arg("backing") = "host_alloc", py::arg("limit_bytes") = 0,
           py::arg("allow_pageable_fallback") = false, py::arg("min_slab_bytes") = 0)
      .def("allocate", &pool_allocate, py::arg("nbytes"),
           "A uint8 CPU tensor of `nbytes` in pool memory; the memory returns to the pool when the tensor dies.")
      .def("stats", &pool_stats)
      .def(
          "unlink_shared", [](PinnedPool& p) { return warnings_to_python([&] { return p.unlink_shared(); }); },
           "Unlinks the names of the shared segments this pool created (their mappings stay valid).")
      .def("linked_shared_names", &PinnedPool::linked_shared_names)
      .def_property_readonly("device_index", &PinnedPool::device_index)
      .def_property_readonly("pins", &PinnedPool::pins)
      .def_property_readonly("backing", [](const PinnedPool& p) { return std::string(backing_name(p.backing())); });

  py::class_<OffloadEngine>(m, "OffloadEngine", "One offloaded block list on one device.")
      .def(py::init([](at::Device device, size_t num_slots, std::shared_ptr<PinnedPool> pool) {
             return warnings_to_python([&] { return std::make_unique<OffloadEngine>(device, num_slots, std::move(pool)); });
           }),
           py::arg("device"), py::arg("num_slots"), py::arg("pool"))
      .def(
          "add_block",
          [](OffloadEngine& e, const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
            return without_gil([&] { return e.add_block(names, params); });
          },
          py::arg("names"), py::arg("params"))
      .def(
          "add_block_shared",
          [](OffloadEngine& e, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
             const std::string& segment_name, bool owner) {
            return without_gil([&] { return e.add_block_shared(names, params, segment_name, owner); });
          },
          py::arg("names"), py::arg("params"), py::arg("segment_name"), py::arg("owner"))
      .def(
          "is_shared", [](const OffloadEngine& e, int64_t block) { return e.is_shared(checked_block(e, block)); },
          py::arg("block"))
      // The per-step calls keep the GIL (see the top of this file).
      .def(
          "acquire",
          [](OffloadEngine& e, int64_t block) { warnings_to_python([&] { e.acquire(checked_block(e, block)); }); },
          py::arg("block"))
      .def(
          "prefetch",
          [](OffloadEngine& e, int64_t block) {
            return warnings_to_python([&] { return e.prefetch(checked_block(e, block)); });
          },
          py::arg("block"))
      .def(
          "release",
          [](OffloadEngine& e, int64_t block) {
            return warnings_to_python([&] { return e.release(checked_block(e, block)); });
          },
          py::arg("block"))
      .def(
          "materialize",
          [](OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.materialize(b); });
          },
          py::arg("block"))
      .def(
          "repack",
          [](OffloadEngine& e, int64_t block, const std::vector<std::string>& names,
             const std::vector<at::Tensor>& params) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.repack(b, names, params); });
          },
          py::arg("block"), py::arg("names"), py::arg("params"))
      .def(
          "restore",
          [](OffloadEngine& e, int64_t block, at::Device device) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.restore(b, device); });
          },
          py::arg("block"), py::arg("device"))
      .def("close", [](OffloadEngine& e) { without_gil([&] { e.close(); }); })
      .def("synchronize", [](OffloadEngine& e) { without_gil([&] { e.synchronize(); }); })
      .def(
          "set_slot_assignment",
          [](OffloadEngine& e, const std::vector<int64_t>& assignment, size_t num_slots) {
            warnings_to_python([&] { e.set_slot_assignment(assignment, num_slots); });
          },
          py::arg("assignment"), py::arg("num_slots"))
      .def("begin_capture", [](OffloadEngine& e) { warnings_to_python([&] { e.begin_capture(); }); })
      .def("end_capture", [](OffloadEngine& e) { warnings_to_python([&] { e.end_capture(); }); })
      .def("join_copies", [](OffloadEngine& e) { warnings_to_python([&] { e.join_copies(); }); })
      .def_property_readonly("generation", &OffloadEngine::generation)
      .def_property_readonly("capturing", [](const OffloadEngine& e) { return e.copy_engine().capturing(); })
      .def("stats", &engine_stats)
      .def(
          "block_bytes", [](const OffloadEngine& e, int64_t block) { return e.block_bytes(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "slot_of", [](const OffloadEngine& e, int64_t block) { return e.slot_of(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "slot_state", [](const OffloadEngine& e, int64_t slot) { return e.slot_state(checked_slot(e, slot)); },
          py::arg("slot"))
      .def(
          "slot_block", [](const OffloadEngine& e, int64_t slot) { return e.slot_block(checked_slot(e, slot)); },
          py::arg("slot"))
      .def(
          "slot_address", [](const OffloadEngine& e, int64_t slot) { return e.slot_address(checked_slot(e, slot)); },
          py::arg("slot"))
      .def(
          "is_materialized",
          [](const OffloadEngine& e, int64_t block) { return e.is_materialized(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "is_removed", [](const OffloadEngine& e, int64_t block) { return e.is_removed(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "host_view",
          [](const OffloadEngine& e, int64_t block, int64_t index) {
            return e.host_view(checked_block(e, block), checked_index(index));
          },
          py::arg("block"), py::arg("index"))
      .def_property_readonly("num_blocks", &OffloadEngine::num_blocks)
      .def_property_readonly("num_slots", &OffloadEngine::num_slots)
      .def_property_readonly("slot_bytes", &OffloadEngine::slot_bytes)
      .def_property_readonly("total_bytes", &OffloadEngine::total_bytes)
      .def_property_readonly("device", &OffloadEngine::device)
      .def_property_readonly("pool", &OffloadEngine::pool);
}
