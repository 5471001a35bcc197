"""Where a start-up from a checkpoint spends its time: the build's phases, the reader's first and last
read, the reader's counters when the disk tier's ring starts, and the disk section's summary of them."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from benchmarks.disk import phase_summary
from benchmarks.disk_child import enable_read_bytes, startup_phases
from fastoffload_ext import _C, enable_layerwise_offload
from fastoffload_ext.storage import DiskOptions
from fastoffload_ext.storage.source import PHASES
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import OFFLOAD_DEVICES


def _assert_bit_exact(model: torch.nn.Module, reference: torch.nn.Module, device: str) -> None:
    x = inputs().to(device)
    reference = reference.to(device)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)


def test_build_records_every_phase(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reference = reference_stack(4)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(4)
    with caplog.at_level("INFO", logger="fastoffload_ext.storage.source"):
        group = enable_layerwise_offload(model, device="cpu", weights=path)
    phases = group.checkpoint.phases
    logged = [r.getMessage() for r in caplog.records if "ms per phase" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(f"Start-up from {path}, ms per phase: checkpoint ")
    assert tuple(phases) == PHASES
    ran = {"checkpoint", "match", "reader", "resident", "attach", "finish"}  # no spill file without compression
    assert all(phases[name] > 0 for name in ran) and phases["spill"] == 0.0
    _assert_bit_exact(model, reference, "cpu")


def test_reader_counters_place_its_reads(tmp_path: Path) -> None:
    path = tmp_path / "bytes.bin"
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    reader = _C.DiskReader(2, 1 << 20, "auto")
    file = reader.open(str(path))
    before = reader.stats()
    assert before["first_read_seconds"] == -1.0 and before["last_read_end_seconds"] == -1.0
    dest = torch.empty_like(data)
    reader.read([(file, 0, data.numel(), 0)], dest)
    after = reader.stats()
    assert torch.equal(dest, data)
    assert 0.0 <= after["first_read_seconds"] <= after["last_read_end_seconds"] <= after["wall_seconds"]


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_ring_starts_once_exactly_the_host_tier_was_read(tmp_path: Path, device: str) -> None:
    reference = reference_stack(8)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(8)
    budget = 4 * block_bytes(reference) + 4096
    group = enable_layerwise_offload(model, device=device, weights=path, host_budget=budget,
                                     disk_options=DiskOptions(staging_buffers=2))
    disk = group.engine.disk_stats()
    host_blocks = sum(1 for s in group.states if not s.on_disk)
    assert 0 < host_blocks < 8 and disk["staging_count"] == 2
    # What the start-up bound counts is what the reader had read when the ring's first fill was queued.
    assert disk["start_reader_bytes"] == enable_read_bytes(group.checkpoint)["host_tier_read_bytes"]
    assert 0.0 <= disk["start_reader_last_read_end_seconds"] <= disk["start_reader_wall_seconds"]
    pool = group.engine.pool.stats()
    # Every host region and staging buffer was pinned once (the host device pins nothing).
    assert pool["deferred_pins"] == (host_blocks + 2 if device != "cpu" else 0)
    _assert_bit_exact(model, reference, device)
    assert group.engine.disk_stats()["start_reader_bytes"] == disk["start_reader_bytes"]  # a snapshot, not a counter


@pytest.mark.parametrize("budget", ["all", "half"])
def test_startup_phases_place_the_reads_inside_enable(tmp_path: Path, budget: str) -> None:
    reference = reference_stack(8)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(8)
    host_budget = None if budget == "all" else 4 * block_bytes(reference) + 4096
    started = time.perf_counter()
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=host_budget)
    enable_s = time.perf_counter() - started
    result = startup_phases(group, started, enable_s)
    phases, timeline = result["phases_ms"], result["timeline_ms"]
    assert set(phases) == set(PHASES) | {"other"} and phases["other"] >= 0.0
    assert sum(phases.values()) == pytest.approx(enable_s * 1e3)
    # The reads start once the checkpoint is parsed and matched, and enable returns after the last one.
    assert timeline["head"] >= phases["checkpoint"] + phases["match"]
    assert timeline["reads"] >= 0.0 and timeline["tail"] >= 0.0
    assert sum(timeline.values()) == pytest.approx(enable_s * 1e3)
    assert result["reader_bytes_at_start"] == enable_read_bytes(group.checkpoint)["host_tier_read_bytes"]
    _assert_bit_exact(model, reference, "cpu")


def _run(enable_s: float, reads_ms: float | None) -> dict:
    return {"enable_s": enable_s, "bandwidth": 1e9, "reader_bytes_at_start": 50_000_000,
            "phases_ms": {"checkpoint": 2.0, "attach": 1.0, "finish": 40.0, "other": 3.0},
            "timeline_ms": {"head": 4.0, "reads": reads_ms, "tail": 1.5},
            "pins": {"count": 3, "populate_ms": 7.0, "register_ms": 9.0, "pin_total_ms": 16.0}}


def test_phase_summary_reports_the_median_run() -> None:
    summary = phase_summary([_run(0.09, 80.0), _run(0.05, 60.0), _run(0.07, 75.0)])
    assert summary["phases_ms"] == _run(0, 0)["phases_ms"] and summary["timeline_ms"]["reads"] == 75.0
    assert summary["reads_ideal_ms"] == pytest.approx(50.0) and summary["reads_x"] == pytest.approx(1.5)
    assert summary["head_ms"] == 4.0 and summary["tail_ms"] == 1.5
    assert summary["note"] == ("phases ms (median run): checkpoint 2.0, attach 1.0, finish 40.0, other 3.0; host-tier "
                               "reads 75.0 ms against 50.0 ms at bw, head 4.0, tail 1.5; 3 deferred pins: populate 7.0 "
                               "+ register 9.0 ms (summed over threads)")
    assert [t["reads"] for t in summary["timeline_ms_runs"]] == [80.0, 60.0, 75.0]
    no_reads = phase_summary([_run(0.05, None)])
    assert no_reads["reads_x"] is None and "host-tier reads - ms" in no_reads["note"]
    assert phase_summary([{"enable_s": 0.1}]) == {}  # a child without the figures (an older build) adds nothing


@pytest.mark.cuda
def test_pin_failure_beside_the_reads_leaves_nothing_half_built(tmp_path: Path) -> None:
    import gc
    import os

    from fastoffload_ext import get_offload_group
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(6)
    threads = len(os.listdir("/proc/self/task"))
    # Room for two regions: a later pin fails while the reads into the regions still run.
    with pytest.raises(RuntimeError, match="fastoffload: pinning [0-9.]+ MiB of host memory \\(register\\) failed: "
                                           "the pool's limit of [0-9.]+ MiB would be exceeded"):
        enable_layerwise_offload(model, device="cuda", weights=path, pinned_limit_bytes=2 * block_bytes(reference) + 8192)
    assert all(p.is_meta for p in model.parameters()) and get_offload_group(model) is None
    gc.collect()
    assert len(os.listdir("/proc/self/task")) <= threads  # the reader's and the pins' threads ended
    group = enable_layerwise_offload(model, device="cuda", weights=path)  # and the model builds as before
    assert group.engine.pool.stats()["deferred_pins"] == 6
    _assert_bit_exact(model, reference, "cuda")


_READER_UNDER_LIMIT = """
import resource
from fastoffload_ext import _C
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
_C.DiskReader(4, 1 << 26, "buffered")  # buffered reads need no aligned buffers
print("BUFFERED OK")
try:
    _C.DiskReader(4, 1 << 30, "auto")
except RuntimeError as error:
    print("REFUSED", error)
"""


def test_reader_buffers_that_cannot_be_allocated_are_refused() -> None:
    import subprocess
    import sys
    # In a child: its address space is capped below the eight 1 GiB buffers the reader would reserve.
    done = subprocess.run([sys.executable, "-c", _READER_UNDER_LIMIT], capture_output=True, text=True, timeout=300)
    assert "BUFFERED OK" in done.stdout, done.stderr
    assert ("REFUSED fastoffload: cannot allocate the reader's 8 read buffers of 1073741824 bytes; lower "
            "DiskOptions.read_threads or chunk_bytes") in done.stdout, done.stdout + done.stderr


def test_header_prefetch_leaves_refusals_to_open_checkpoint(tmp_path: Path) -> None:
    from fastoffload_ext.errors import CheckpointError
    from fastoffload_ext.storage.checkpoint import prefetch_headers
    (tmp_path / "bad.safetensors.index.json").write_text("not json")
    for weights in (tmp_path / "missing.safetensors", tmp_path / "bad.safetensors.index.json", tmp_path):
        prefetch_headers(weights)  # best effort: nothing raised here
    model = meta_stack(2)
    with pytest.raises(CheckpointError, match="fastoffload: checkpoint .*missing.safetensors does not exist; pass "
                                              "weights= a .safetensors file"):
        enable_layerwise_offload(model, device="cpu", weights=tmp_path / "missing.safetensors")
    assert all(p.is_meta for p in model.parameters())


def test_resident_tensors_are_read_while_the_blocks_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.storage.source import CheckpointSource
    reference = reference_stack(4)
    for i, block in enumerate(reference.blocks):  # a buffer inside each offloaded block, from the checkpoint
        block.register_buffer("scale", torch.full((3,), float(i + 1), dtype=torch.bfloat16))
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(4)
    for block in model.blocks:
        block.register_buffer("scale", torch.empty(3, dtype=torch.bfloat16, device="meta"))
    jobs_then: list[int] = []
    load = CheckpointSource.load_resident

    def recording(self: CheckpointSource, *args: object) -> None:
        jobs_then.append(self.reader.stats()["jobs"])
        load(self, *args)

    monkeypatch.setattr(CheckpointSource, "load_resident", recording)
    enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=1)
    assert jobs_then == [3]  # the three offloaded blocks' reads were queued before proj_in, proj_out, block 0
    for block, expected in zip(model.blocks, reference.blocks):  # the blocks' buffers were read before attaching
        assert torch.equal(block.scale, expected.scale)
    _assert_bit_exact(model, reference, "cpu")
