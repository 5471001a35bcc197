// Python bindings for fastoffload_ext._C. The only file that includes torch/extension.h.
//
// The per-step methods (acquire, prefetch, release) take an integer handle and keep the GIL: they
// are a few microseconds of host work, and dropping and retaking the GIL would cost more than they
// do. Methods that move whole blocks through host memory release it.
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "disk_reader.h"
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

// Runs `work` without the GIL; warnings raised by C++ (TORCH_WARN, e.g. the pageable fallback)
// reach Python as warnings once the GIL is back, instead of only being printed to stderr.
template <typename Work>
auto without_gil(Work&& work) -> decltype(work()) {
  torch::PyWarningHandler warnings;
  try {
    py::gil_scoped_release no_gil;
    return work();
  } catch (...) {
    warnings.set_in_exception();  // the handler must not raise while an exception is in flight
    throw;
  }
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

py::dict reader_stats(const DiskReader& reader) {
  const ReaderStats s = reader.stats();
  py::dict d;
  d["jobs"] = s.jobs;
  d["chunks"] = s.chunks;
  d["bytes_read"] = s.bytes_read;
  d["direct_bytes"] = s.direct_bytes;
  d["buffered_bytes"] = s.buffered_bytes;
  d["busy_seconds"] = s.busy_seconds;
  d["threads"] = reader.threads();
  d["chunk_bytes"] = reader.chunk_bytes();
  return d;
}

py::dict disk_stats(const OffloadEngine& engine) {
  const DiskTierStats s = engine.disk_stats();
  py::dict d;
  d["reads"] = s.reads;
  d["waits"] = s.waits;
  d["wait_seconds"] = s.wait_seconds;
  d["out_of_order"] = s.out_of_order;
  d["staging_count"] = s.staging_count;
  d["staging_bytes"] = s.staging_bytes;
  return d;
}

// (file, offset, nbytes, dest_offset) tuples read into the uint8 CPU tensor `dest`, without the GIL.
void reader_read(DiskReader& reader, const std::vector<std::tuple<size_t, uint64_t, size_t, size_t>>& spans,
                 const at::Tensor& dest) {
  TORCH_CHECK(dest.device().is_cpu() && dest.scalar_type() == at::kByte && dest.is_contiguous(),
              "fastoffload: read() needs a contiguous uint8 CPU tensor as its destination, got ", dest.toString());
  std::vector<FileRange> ranges;
  ranges.reserve(spans.size());
  for (const auto& [file, offset, nbytes, dest_offset] : spans) {
    TORCH_CHECK(dest_offset + nbytes <= static_cast<size_t>(dest.numel()), "fastoffload: read() range of ",
                std::to_string(nbytes), " bytes at ", std::to_string(dest_offset), " does not fit the ",
                std::to_string(dest.numel()), "-byte destination");
    FileRange range;
    range.file = file;
    range.offset = offset;
    range.nbytes = nbytes;
    range.dest_offset = dest_offset;
    range.name = "<bytes>";
    ranges.push_back(std::move(range));
  }
  uint8_t* data = dest.data_ptr<uint8_t>();
  without_gil([&] { reader.read(std::move(ranges), data); });
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

  m.def("sweep_stale_segments", &sweep_stale_segments,
        "Removes /dev/shm/fastoffload-<pid>-* left by owners that died before unlinking them; returns the count.");
  m.def(
      "unlink_shared_segment", [](const std::string& name) { return unlink_segment(name); }, py::arg("name"),
      "Removes the shared segment name `name` if it exists (mappings stay valid); returns whether it did.");

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool",
                                                      "Page-locked host memory in slabs, sub-allocated at exact sizes.")
      .def(py::init([](int device_index, const std::string& backing, size_t limit_bytes, bool allow_pageable_fallback,
                       size_t min_slab_bytes) {
             return std::make_shared<PinnedPool>(device_index, parse_backing(backing), limit_bytes,
                                                 allow_pageable_fallback, min_slab_bytes);
           }),
           py::arg("device_index") = -1, py::arg("backing") = "host_alloc", py::arg("limit_bytes") = 0,
           py::arg("allow_pageable_fallback") = false, py::arg("min_slab_bytes") = 0)
      .def("allocate", &pool_allocate, py::arg("nbytes"),
           "A uint8 CPU tensor of `nbytes` in pool memory; the memory returns to the pool when the tensor dies.")
      .def("stats", &pool_stats)
      .def("unlink_shared", &PinnedPool::unlink_shared,
           "Unlinks the names of the shared segments this pool created (their mappings stay valid).")
      .def("linked_shared_names", &PinnedPool::linked_shared_names)
      .def_property_readonly("device_index", &PinnedPool::device_index)
      .def_property_readonly("pins", &PinnedPool::pins)
      .def_property_readonly("backing", [](const PinnedPool& p) { return std::string(backing_name(p.backing())); });

  py::class_<DiskReader, std::shared_ptr<DiskReader>>(
      m, "DiskReader", "Reads checkpoint byte ranges on threads of its own (O_DIRECT where allowed).")
      .def(py::init([](size_t threads, size_t chunk_bytes, const std::string& mode) {
             return std::make_shared<DiskReader>(threads, chunk_bytes, parse_read_mode(mode));
           }),
           py::arg("threads") = 4, py::arg("chunk_bytes") = 8 << 20, py::arg("mode") = "auto")
      .def("open", &DiskReader::open, py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def("path", &DiskReader::path, py::arg("file"))
      .def("file_size", &DiskReader::file_size, py::arg("file"))
      .def("direct", &DiskReader::direct, py::arg("file"))
      .def("check_unchanged", &DiskReader::check_unchanged, py::arg("file"))
      .def("read", &reader_read, py::arg("spans"), py::arg("dest"))
      .def("stats", &reader_stats)
      .def("_inject_errors", &DiskReader::inject_errors, py::arg("after"), py::arg("count"), py::arg("error_number"))
      .def("_set_delay_us", &DiskReader::set_delay_us, py::arg("micros"))
      .def_property_readonly("threads", &DiskReader::threads)
      .def_property_readonly("chunk_bytes", &DiskReader::chunk_bytes);

  py::class_<OffloadEngine>(m, "OffloadEngine", "One offloaded block list on one device.")
      .def(py::init<at::Device, size_t, std::shared_ptr<PinnedPool>>(), py::arg("device"), py::arg("num_slots"),
           py::arg("pool"))
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
      .def("is_shared", &OffloadEngine::is_shared, py::arg("block"))
      .def("set_reader", &OffloadEngine::set_reader, py::arg("reader"))
      .def(
          "add_block_from_file",
          [](OffloadEngine& e, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
             const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans) {
            return without_gil([&] { return e.add_block_from_file(names, params, shapes, spans); });
          },
          py::arg("names"), py::arg("params"), py::arg("shapes"), py::arg("spans"))
      .def(
          "add_block_on_disk",
          [](OffloadEngine& e, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
             const std::vector<std::vector<int64_t>>& shapes, const std::vector<FileSpan>& spans) {
            return without_gil([&] { return e.add_block_on_disk(names, params, shapes, spans); });
          },
          py::arg("names"), py::arg("params"), py::arg("shapes"), py::arg("spans"))
      .def("start_disk_tier", &OffloadEngine::start_disk_tier, py::arg("count"),
           py::call_guard<py::gil_scoped_release>())
      .def("is_on_disk", &OffloadEngine::is_on_disk, py::arg("block"))
      .def("disk_stats", &disk_stats)
      .def_property_readonly("reader", &OffloadEngine::reader)
      .def(
          "acquire",
          [](OffloadEngine& e, size_t block) {
            // Only a disk-tier block whose read has not finished can make acquire wait; the GIL is
            // dropped for that case alone, since doing it on every call would cost more than the call.
            if (e.acquire_may_wait(block)) without_gil([&] { e.acquire(block); });
            else e.acquire(block);
          },
          py::arg("block"))
      .def("prefetch", &OffloadEngine::prefetch, py::arg("block"))
      .def("release", &OffloadEngine::release, py::arg("block"))
      .def("materialize", &OffloadEngine::materialize, py::arg("block"), py::call_guard<py::gil_scoped_release>())
      .def(
          "repack",
          [](OffloadEngine& e, size_t block, const std::vector<std::string>& names,
             const std::vector<at::Tensor>& params) { without_gil([&] { e.repack(block, names, params); }); },
          py::arg("block"), py::arg("names"), py::arg("params"))
      .def("restore", &OffloadEngine::restore, py::arg("block"), py::arg("device"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &OffloadEngine::close, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &OffloadEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("set_slot_assignment", &OffloadEngine::set_slot_assignment, py::arg("assignment"), py::arg("num_slots"))
      .def("begin_capture", &OffloadEngine::begin_capture)
      .def("end_capture", &OffloadEngine::end_capture)
      .def("join_copies", &OffloadEngine::join_copies)
      .def_property_readonly("generation", &OffloadEngine::generation)
      .def_property_readonly("capturing", [](const OffloadEngine& e) { return e.copy_engine().capturing(); })
      .def("stats", &engine_stats)
      .def("block_bytes", &OffloadEngine::block_bytes, py::arg("block"))
      .def("slot_of", &OffloadEngine::slot_of, py::arg("block"))
      .def("slot_state", &OffloadEngine::slot_state, py::arg("slot"))
      .def("slot_block", &OffloadEngine::slot_block, py::arg("slot"))
      .def("slot_address", &OffloadEngine::slot_address, py::arg("slot"))
      .def("is_materialized", &OffloadEngine::is_materialized, py::arg("block"))
      .def("is_removed", &OffloadEngine::is_removed, py::arg("block"))
      .def("host_view", &OffloadEngine::host_view, py::arg("block"), py::arg("index"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_blocks", &OffloadEngine::num_blocks)
      .def_property_readonly("num_slots", &OffloadEngine::num_slots)
      .def_property_readonly("slot_bytes", &OffloadEngine::slot_bytes)
      .def_property_readonly("total_bytes", &OffloadEngine::total_bytes)
      .def_property_readonly("device", &OffloadEngine::device)
      .def_property_readonly("pool", &OffloadEngine::pool);
}
