// Python bindings for fastoffload_ext._C. The only file that includes torch/extension.h.
//
// The per-step methods (acquire, prefetch, release) take an integer handle and keep the GIL: they
// are a few microseconds of host work, and dropping and retaking the GIL would cost more than they
// do. Methods that move whole blocks through host memory release it, always through without_gil().
// Every method that can warn runs under warnings_to_python(), so TORCH_WARN becomes a Python warning.
// Every handle, slot and index from Python is bounds-checked here before it reaches the engine.
#include <typeinfo>

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "codec.h"
#include "codec_launch.h"
#include "disk_reader.h"
#include "offload_engine.h"
#include "pinned_pool.h"
#include "shared_segment.h"
#include "thread_gate.h"

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
  d["populate_seconds"] = s.populate_seconds;
  d["register_seconds"] = s.register_seconds;
  d["deferred_pins"] = s.deferred_pins;
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
  d["slots_replaced"] = s.slots_replaced;
  d["copies"] = engine.copy_engine().copies_issued();
  d["bytes_copied"] = engine.copy_engine().bytes_copied();
  d["num_blocks"] = engine.num_blocks();
  d["num_slots"] = engine.num_slots();
  d["slot_bytes"] = engine.slot_bytes();
  d["packed_bytes"] = engine.total_bytes();
  d["decodes"] = s.decodes;
  d["pipelined_encodes"] = s.pipelined_encodes;
  d["pipelined_spills"] = s.pipelined_spills;
  return d;
}

py::dict codec_info_dict(const OffloadEngine& engine, size_t block) {
  const BlockCodecInfo info = engine.codec_info(block);
  py::dict d;
  d["mode"] = travel_name(info.travel);
  d["raw_bytes"] = info.raw_bytes;
  d["compressed_bytes"] = info.compressed_bytes;
  d["host_bytes"] = info.host_bytes;
  d["ratio"] = info.compressed_bytes > 0 && info.raw_bytes > 0
                   ? static_cast<double>(info.compressed_bytes) / static_cast<double>(info.raw_bytes)
                   : 1.0;
  d["segments"] = info.segments;
  d["coded_segments"] = info.coded_segments;
  d["exceptions"] = info.exceptions;
  d["checksum"] = info.checksum;
  return d;
}

std::string compress_mode_name(CompressMode mode) {
  switch (mode) {
    case CompressMode::kOn:
      return "on";
    case CompressMode::kAuto:
      return "auto";
    case CompressMode::kOff:
      break;
  }
  return "off";
}

codec::EncodeOptions encode_options(double max_ratio, size_t min_bytes, unsigned threads) {
  TORCH_CHECK(max_ratio > 0.0, "fastoffload: max_ratio must be > 0, got ", std::to_string(max_ratio));
  codec::EncodeOptions options;
  options.max_ratio = max_ratio;
  options.min_bytes = min_bytes;
  options.threads = threads;
  return options;
}

const uint8_t* byte_data(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous(), "fastoffload: ", what,
              " must be a contiguous CPU uint8 tensor, got ", t.toString());
  return t.data_ptr<uint8_t>();
}

// spans: (offset, nbytes, is_bf16) of each tensor inside `raw`.
at::Tensor codec_encode(const at::Tensor& raw, const std::vector<std::tuple<size_t, size_t, bool>>& spans,
                        double max_ratio, size_t min_bytes, unsigned threads) {
  const uint8_t* data = byte_data(raw, "the block to encode");
  std::vector<codec::TensorSpan> list;
  for (const auto& [offset, nbytes, bf16] : spans) list.push_back({offset, nbytes, bf16});
  const codec::EncodeOptions options = encode_options(max_ratio, min_bytes, threads);
  codec::Plan plan = codec::plan_block(data, static_cast<size_t>(raw.numel()), list, options);
  at::Tensor out = at::empty({static_cast<int64_t>(plan.total_bytes)}, at::TensorOptions().dtype(at::kByte));
  codec::encode_block(data, plan, out.data_ptr<uint8_t>(), threads);
  return out;
}

at::Tensor codec_decode(const at::Tensor& src, bool verify, unsigned threads) {
  const uint8_t* data = byte_data(src, "the compressed block");
  const codec::Summary summary = codec::inspect(data, static_cast<size_t>(src.numel()));
  at::Tensor out = at::empty({static_cast<int64_t>(summary.raw_bytes)}, at::TensorOptions().dtype(at::kByte));
  codec::decode_block(data, static_cast<size_t>(src.numel()), out.data_ptr<uint8_t>(), summary.raw_bytes, verify,
                      threads);
  return out;
}

py::dict codec_inspect(const at::Tensor& src) {
  const codec::Summary s = codec::inspect(byte_data(src, "the compressed block"), static_cast<size_t>(src.numel()));
  py::dict d;
  d["raw_bytes"] = s.raw_bytes;
  d["compressed_bytes"] = s.total_bytes;
  d["segments"] = s.num_segments;
  d["tiles"] = s.num_tiles;
  d["coded_segments"] = s.coded_segments;
  d["exceptions"] = s.exceptions;
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
  d["read_seconds"] = s.read_seconds;
  d["idle_seconds"] = s.idle_seconds;
  d["wall_seconds"] = s.wall_seconds;
  d["max_in_flight"] = s.max_in_flight;
  d["bounce_bytes"] = s.bounce_bytes;
  d["in_place_bytes"] = s.in_place_bytes;
  d["first_read_seconds"] = s.first_read_seconds;
  d["last_read_end_seconds"] = s.last_read_end_seconds;
  d["threads"] = reader.threads();
  d["workers"] = reader.workers();
  d["chunk_bytes"] = reader.chunk_bytes();
  return d;
}

py::dict disk_stats(const OffloadEngine& engine) {
  const DiskTierStats s = engine.disk_stats();
  py::dict d;
  d["reads"] = s.reads;
  d["waits"] = s.waits;
  d["wait_seconds"] = s.wait_seconds;
  d["idle_in_waits_seconds"] = s.idle_in_waits_seconds;
  d["out_of_order"] = s.out_of_order;
  d["handoffs"] = s.handoffs;
  d["copy_wait_seconds"] = s.copy_wait_seconds;
  d["staging_count"] = s.staging_count;
  d["staging_bytes"] = s.staging_bytes;
  d["start_reader_bytes"] = s.start_reader_bytes;
  d["start_reader_wall_seconds"] = s.start_reader_wall_seconds;
  d["start_reader_last_read_end_seconds"] = s.start_reader_last_read_end_seconds;
  return d;
}

// (file, offset, nbytes, dest_offset) tuples read into the uint8 CPU tensor `dest`, without the GIL.
void reader_read(DiskReader& reader, const std::vector<std::tuple<size_t, uint64_t, size_t, size_t>>& spans,
                 const at::Tensor& dest, bool scratch) {
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
  const DestWindow window = scratch ? DestWindow{data, data + dest.numel()} : DestWindow{};
  without_gil([&] { reader.read(std::move(ranges), data, window); });
}

void* drop_gil_if_held() { return PyGILState_Check() ? static_cast<void*>(PyEval_SaveThread()) : nullptr; }

void take_gil_back(void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }

}  // namespace
}  // namespace fastoffload

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastoffload;
  m.doc() = "fastoffload_ext core: pinned pool, packed block store, slot ring, copy engine, binder";
  // A thread that has to wait for an engine drops the GIL for the wait (see thread_gate.h).
  set_wait_hooks(WaitHooks{&drop_gil_if_held, &take_gil_back});
  // The core's own refusals (a TORCH_CHECK whose message is the package's: a forward from another thread, a block
  // that requires grad, a parameter rebound or written while offloaded, a refused load) reach Python as
  // OffloadStateError, a RuntimeError, as the python backend raises them; torch's own errors and the typed ones
  // (ValueError, IndexError, ...) keep their types. Registered first, so the translators below are tried before it.
  py::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const c10::Error& failure) {
      const std::string message = failure.what_without_backtrace();
      if (typeid(failure) != typeid(c10::Error) || message.rfind("fastoffload:", 0) != 0) throw;
      py::object type = py::module_::import("fastoffload_ext.errors").attr("OffloadStateError");
      PyErr_SetString(type.ptr(), message.c_str());
    }
  });
  // Device memory refused (the slot ring) reaches Python as torch.OutOfMemoryError, like torch's own.
  py::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const c10::OutOfMemoryError& oom) {
      py::object type = py::module_::import("torch").attr("OutOfMemoryError");
      PyErr_SetString(type.ptr(), oom.what_without_backtrace());
    }
  });
  // A checkpoint read that failed (I/O error, short read, file changed) reaches Python as the package's
  // CheckpointReadError (a CheckpointError and an OffloadStateError, so also a RuntimeError).
  py::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const CheckpointReadFailure& failure) {
      py::object type = py::module_::import("fastoffload_ext.errors").attr("CheckpointReadError");
      PyErr_SetString(type.ptr(), failure.what_without_backtrace());
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
  m.attr("CODEC_VERSION") = codec::kVersion;
  m.def(
      "sweep_stale_segments", [] { return without_gil([] { return sweep_stale_segments(); }); },
      "Removes the shared segment names of this user's jobs whose owner died (its flock'ed job lock is free); "
      "returns how many segment names it removed.");
  m.def(
      "tensor_digests",
      [](const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
        return without_gil([&] { return tensor_digests(names, tensors); });
      },
      py::arg("names"), py::arg("tensors"),
      "64-bit digests of each tensor's bytes: what an owner's OffloadEngine.block_digests gives for the same values.");
  m.def(
      "packed_bytes",
      [](const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
        size_t total = 0;
        plan_layout(names, tensors, &total);
        return total;
      },
      py::arg("names"), py::arg("tensors"), "Bytes a block of these tensors packs to (validating them like add_block).");
  py::class_<JobLock>(m, "JobLock", "The owner's liveness lock of a shared host copy (flock'ed while held).")
      .def(py::init([](const std::string& job_token) { return without_gil([&] { return new JobLock(job_token); }); }),
           py::arg("job_token"))
      .def("release", [](JobLock& lock) { without_gil([&] { lock.release(); }); })
      .def_property_readonly("held", &JobLock::held)
      .def_property_readonly("name", &JobLock::name);
  m.def(
      "unlink_shared_segment", [](const std::string& name) { return without_gil([&] { return unlink_segment(name); }); },
      py::arg("name"),
      "Removes the shared segment name `name` if it exists (mappings stay valid); returns whether it did.");

  m.def(
      "codec_encode",
      [](const at::Tensor& raw, const std::vector<std::tuple<size_t, size_t, bool>>& spans, double max_ratio,
         size_t min_bytes, unsigned threads) {
        return without_gil([&] { return codec_encode(raw, spans, max_ratio, min_bytes, threads); });
      },
      py::arg("raw"), py::arg("spans"), py::arg("max_ratio") = 0.9, py::arg("min_bytes") = 4096,
      py::arg("threads") = 0,
      "Compressed form (uint8 CPU tensor) of the packed bytes `raw`; spans: (offset, nbytes, is_bf16) per tensor.");
  m.def(
      "codec_decode",
      [](const at::Tensor& src, bool verify, unsigned threads) {
        return without_gil([&] { return codec_decode(src, verify, threads); });
      },
      py::arg("src"), py::arg("verify") = false, py::arg("threads") = 0,
      "Host decoder: the raw bytes of a compressed block (verify: check its checksum first).");
  m.def("codec_inspect", &codec_inspect, py::arg("src"), "Validates a compressed block's header and segment table.");
  m.def(
      "codec_decode_device",
      [](const at::Tensor& host, const at::Tensor& device_src, at::Tensor dst) {
        codec::decode_on_device(host, device_src, dst);
      },
      py::arg("host"), py::arg("device_src"), py::arg("dst"),
      "Device decoder on the current stream: `device_src` (the bytes of `host` on the GPU) into `dst`.");

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
      .def("reserve_shared", &PinnedPool::reserve_shared, py::arg("name"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "Owner: creates the shared segment `name` now, for the block that packs to `nbytes` (see packed_bytes).")
      .def("drop_reserved", &PinnedPool::drop_reserved, py::call_guard<py::gil_scoped_release>(),
           "Destroys (and unlinks) the reserved segments no block has used yet; returns how many.")
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
      .def("read", &reader_read, py::arg("spans"), py::arg("dest"), py::arg("scratch") = false,
           "Reads (file, offset, nbytes, dest_offset) spans into `dest`. scratch=True: every byte of `dest` may "
           "be overwritten, so a span layout that mirrors the file is read with O_DIRECT straight into place.")
      .def("stats", &reader_stats)
      .def("_inject_errors", &DiskReader::inject_errors, py::arg("after"), py::arg("count"), py::arg("error_number"))
      .def("_set_delay_us", &DiskReader::set_delay_us, py::arg("micros"))
      .def_property_readonly("threads", &DiskReader::threads)
      .def_property_readonly("chunk_bytes", &DiskReader::chunk_bytes);

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
             const std::string& segment_name, bool owner, size_t packed_bytes, uint64_t checksum) {
            return without_gil(
                [&] { return e.add_block_shared(names, params, segment_name, owner, packed_bytes, checksum); });
          },
          py::arg("names"), py::arg("params"), py::arg("segment_name"), py::arg("owner"), py::arg("packed_bytes") = 0,
          py::arg("checksum") = 0)
      .def(
          "is_shared", [](const OffloadEngine& e, int64_t block) { return e.is_shared(checked_block(e, block)); },
          py::arg("block"))
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
      .def("set_spill_file", &OffloadEngine::set_spill_file, py::arg("path"))
      .def_property_readonly("spill_path", &OffloadEngine::spill_path)
      .def_property_readonly("spill_bytes", &OffloadEngine::spill_bytes)
      .def("start_disk_tier", [](OffloadEngine& e, size_t count) { without_gil([&] { e.start_disk_tier(count); }); },
           py::arg("count"))
      .def("set_disk_order",
           [](OffloadEngine& e, const std::vector<size_t>& blocks) { without_gil([&] { e.set_disk_order(blocks); }); },
           py::arg("blocks"))
      .def(
          "is_on_disk", [](const OffloadEngine& e, int64_t block) { return e.is_on_disk(checked_block(e, block)); },
          py::arg("block"))
      .def("disk_stats", &disk_stats)
      .def("finish_loading", [](OffloadEngine& e) { without_gil([&] { e.finish_loading(); }); })
      .def_property_readonly("reader", &OffloadEngine::reader)
      .def(
          "block_digests",
          [](const OffloadEngine& e, int64_t block) { return e.block_digests(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "host_copy_address",
          [](const OffloadEngine& e, int64_t block) { return e.host_copy_address(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "host_written",
          [](OffloadEngine& e, int64_t block, uint64_t address) {
            const size_t b = checked_block(e, block);
            return without_gil([&] { return e.host_written(b, address); });
          },
          py::arg("block"), py::arg("address"))
      .def(
          "make_private",
          [](OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.make_private(b); });
          },
          py::arg("block"))
      // The per-step calls keep the GIL (see the top of this file).
      .def(
          "acquire",
          [](OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            // Only a disk-tier block whose read has not finished can make acquire wait; the GIL is
            // dropped for that case alone, since doing it on every call would cost more than the call.
            if (e.acquire_may_wait(b)) without_gil([&] { e.acquire(b); });
            else warnings_to_python([&] { e.acquire(b); });
          },
          py::arg("block"))
      .def(
          "acquire_and_prefetch",
          [](OffloadEngine& e, int64_t block, const py::tuple& targets) {
            const size_t b = checked_block(e, block);
            c10::SmallVector<size_t, 4> checked;
            for (const py::handle target : targets) checked.push_back(checked_block(e, target.cast<int64_t>()));
            // As acquire: the GIL is dropped only when a disk read may make it wait.
            if (e.acquire_may_wait(b)) without_gil([&] { e.acquire_and_prefetch(b, checked.data(), checked.size()); });
            else warnings_to_python([&] { e.acquire_and_prefetch(b, checked.data(), checked.size()); });
          },
          py::arg("block"), py::arg("targets"))
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
          "set_compression",
          [](OffloadEngine& e, const std::string& mode, bool verify, double max_ratio, size_t min_bytes,
             unsigned threads) {
            e.set_compression(parse_compress_mode(mode), verify, encode_options(max_ratio, min_bytes, threads));
          },
          py::arg("mode"), py::arg("verify") = false, py::arg("max_ratio") = 0.9, py::arg("min_bytes") = 4096,
          py::arg("threads") = 0)
      .def(
          "choose_travel",
          [](OffloadEngine& e, int64_t block, bool compressed) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.choose_travel(b, compressed); });
          },
          py::arg("block"), py::arg("compressed"))
      .def(
          "codec_info", [](const OffloadEngine& e, int64_t block) { return codec_info_dict(e, checked_block(e, block)); },
          py::arg("block"))
      .def_property_readonly("verify_checksums", &OffloadEngine::verify_checksums)
      .def("settle_travel", [](OffloadEngine& e) { without_gil([&] { e.settle_travel(); }); })
      .def("set_auto_threshold", &OffloadEngine::set_auto_threshold, py::arg("threshold"))
      .def_property_readonly("compress_mode", [](const OffloadEngine& e) { return compress_mode_name(e.compress_mode()); })
      .def("auto_timings",
           [](const OffloadEngine& e) {
             py::dict d;
             d["copy_ms"] = e.chooser().last_copy_ms();
             d["compute_ms"] = e.chooser().last_compute_ms();
             d["threshold"] = e.chooser().threshold();
             return d;
           })
      .def(
          "raw_host_bytes",
          [](const OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            return without_gil([&] { return e.raw_host_bytes(b); });
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
      .def(
          "drop",
          [](OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            without_gil([&] { e.drop(b); });
          },
          py::arg("block"))
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
      .def_property_readonly("layout_generation", &OffloadEngine::layout_generation)
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
          "edited_in_place",
          [](const OffloadEngine& e, int64_t block) -> std::optional<std::string> {
            std::string name = e.edited_in_place(checked_block(e, block));
            if (name.empty()) return std::nullopt;
            return name;
          },
          py::arg("block"))
      .def(
          "check_offloaded_bindings",
          [](const OffloadEngine& e, int64_t block) { e.check_offloaded_bindings(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "is_removed", [](const OffloadEngine& e, int64_t block) { return e.is_removed(checked_block(e, block)); },
          py::arg("block"))
      .def(
          "host_view",
          [](const OffloadEngine& e, int64_t block, int64_t index) {
            const size_t b = checked_block(e, block);
            const size_t j = checked_index(index);
            // A disk-tier block's tensor is read from the checkpoint.
            return without_gil([&] { return e.host_view(b, j); });
          },
          py::arg("block"), py::arg("index"))
      .def(
          "host_views",
          [](const OffloadEngine& e, int64_t block) {
            const size_t b = checked_block(e, block);
            return without_gil([&] { return e.host_views(b); });
          },
          py::arg("block"))
      .def(
          "weight_bytes", [](const OffloadEngine& e, int64_t block) { return e.weight_bytes(checked_block(e, block)); },
          py::arg("block"))
      .def_property_readonly("num_blocks", &OffloadEngine::num_blocks)
      .def_property_readonly("num_slots", &OffloadEngine::num_slots)
      .def_property_readonly("slot_bytes", &OffloadEngine::slot_bytes)
      .def_property_readonly("total_bytes", &OffloadEngine::total_bytes)
      .def_property_readonly("device", &OffloadEngine::device)
      .def_property_readonly("pool", &OffloadEngine::pool);
}
