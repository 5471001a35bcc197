"""The disk benchmark section's start-up bound counts exactly what enable reads (pure parts; the section
itself runs in the suite, on the host when there is no GPU)."""
from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.disk_child import enable_read_bytes
from fastoffload_ext import enable_layerwise_offload
from tests._checkpoints import block_bytes, meta_stack, record_reads, reference_stack, write_single


def _outside(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))


def test_every_block_in_host_memory_counts_every_byte_the_reader_read(tmp_path: Path) -> None:
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=None)
    counted = enable_read_bytes(group.checkpoint)
    assert counted["host_tier_read_bytes"] == 6 * block_bytes(reference)
    # enable has waited for every block read: the reader read those bytes, no more, no fewer
    assert group.engine.reader.stats()["bytes_read"] == counted["host_tier_read_bytes"]
    assert counted["resident_read_bytes"] == _outside(reference)
    data = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert counted["header_bytes"] == path.stat().st_size - data > 0


def test_half_on_disk_counts_only_the_host_tier(tmp_path: Path) -> None:
    reference = reference_stack(8)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * block_bytes(reference) + 4096)
    on_disk = [s for s in group.states if s.on_disk]
    assert on_disk
    counted = enable_read_bytes(group.checkpoint)
    assert counted["host_tier_read_bytes"] == (8 - len(on_disk)) * block_bytes(reference)
    # Beyond them the reader only reads the staging ring's first fill, queued after the host tier.
    staging = group.engine.disk_stats()["staging_count"] * block_bytes(reference)
    assert counted["host_tier_read_bytes"] <= group.engine.reader.stats()["bytes_read"] <= (
        counted["host_tier_read_bytes"] + staging)


class _Recorder:
    def __init__(self) -> None:
        self.skips: list[tuple[str, dict, str]] = []

    def skip(self, table: str, labels: dict, reason: str) -> None:
        self.skips.append((table, labels, reason))


def test_kvikio_row_says_why_it_is_absent(tmp_path: Path, monkeypatch) -> None:
    import sys

    from benchmarks.disk import _kvikio_rows
    monkeypatch.setitem(sys.modules, "kvikio", None)  # what an absent or unloadable package looks like
    ctx = _Recorder()
    _kvikio_rows(ctx, tmp_path / "unused.safetensors", 0)  # type: ignore[arg-type]
    assert len(ctx.skips) == 1
    table, labels, reason = ctx.skips[0]
    assert (table, labels) == ("read", {"reader": "kvikio"})
    assert reason == "kvikio not importable: ModuleNotFoundError: import of kvikio halted; None in sys.modules"


def test_sequential_read_reads_every_piece_once_with_two_in_flight(tmp_path: Path, monkeypatch) -> None:
    import benchmarks.disk as disk
    from fastoffload_ext import _C
    monkeypatch.setattr(disk, "PIECE", 1 << 20)
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * ((5 << 20) // 256) + b"x" * 123)  # five pieces and a short sixth
    reader = _C.DiskReader(1, 1 << 20, "auto")
    direct = reader.direct(reader.open(str(path)))  # whether this file system takes O_DIRECT at all
    for limit in (None, (3 << 20) + 5):
        seconds, all_direct = disk.sequential_read(path, "direct", limit=limit)
        # Every byte read with O_DIRECT exactly once: no piece skipped, none read twice by the two lanes.
        assert seconds > 0 and all_direct == direct
    assert disk.sequential_read(path, "buffered")[1] is False


class _FakeFuture:
    def __init__(self, log: list, buffer: object, offset: int) -> None:
        self.log, self.buffer, self.offset, self.done = log, buffer, offset, False

    def get(self) -> None:
        self.done = True
        self.log.append(("done", self.offset))


class _FakeKvikio:
    """kvikio's surface as the disk section uses it: settings, CuFile and futures, recording the calls."""

    def __init__(self) -> None:
        self.log: list = []
        self.futures: list[_FakeFuture] = []
        kvikio = self

        class Defaults:
            @staticmethod
            def get(name: str) -> object:
                return {"num_threads": 4, "task_size": 8 << 20, "compat_mode": 2}[name]

            @staticmethod
            def set(name: str, value: object) -> None:
                pass

        class CuFile:
            def __init__(self, path: str, mode: str) -> None:
                pass

            def __enter__(self) -> CuFile:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def pread(self, buffer: object, n: int, offset: int) -> _FakeFuture:
                kvikio.log.append(("read", offset, n))
                future = _FakeFuture(kvikio.log, buffer, offset)
                kvikio.futures.append(future)
                return future

        self.defaults, self.CuFile = Defaults, CuFile


def test_kvikio_row_keeps_two_pieces_in_flight_on_two_buffers(tmp_path: Path, monkeypatch) -> None:
    import benchmarks.disk as disk
    monkeypatch.setattr(disk, "PIECE", 1 << 20)
    path = tmp_path / "data.bin"
    size = (5 << 20) + 123
    path.write_bytes(b"\0" * size)
    kvikio = _FakeKvikio()
    row = disk._kvikio_row(kvikio, path, size, "pinned host")
    reads = [entry for entry in kvikio.log if entry[0] == "read"]
    assert [(offset, n) for _, offset, n in reads] == [(o, min(1 << 20, size - o)) for o in range(0, size, 1 << 20)]
    assert all(future.done for future in kvikio.futures)
    # Never more than two outstanding, and a piece reuses a buffer only once the piece before it on that
    # buffer is done.
    outstanding, peak = 0, 0
    for entry in kvikio.log:
        outstanding += 1 if entry[0] == "read" else -1
        peak = max(peak, outstanding)
    assert peak == 2
    for i in range(2, len(reads)):
        assert kvikio.log.index(("done", reads[i - 2][1])) < kvikio.log.index(reads[i])
    assert row["gib"] == size / (1 << 30) and row["threads"] == 4 and row["request_mib"] == 8


def test_merged_spans_widen_to_the_alignment_and_merge_what_touches() -> None:
    from benchmarks.disk import ALIGN, merged_spans
    size = 10 * ALIGN + 100
    ranges = [(3 * ALIGN + 8, 10), (ALIGN + 1, 2 * ALIGN), (10 * ALIGN + 5, 50), (5 * ALIGN, 8)]
    assert merged_spans(ranges, size) == [(ALIGN, 3 * ALIGN), (5 * ALIGN, ALIGN), (10 * ALIGN, 100)]
    assert merged_spans([], size) == []


def test_sequential_read_of_spans_reads_those_bytes_and_no_others(tmp_path: Path, monkeypatch) -> None:
    import benchmarks.disk as disk
    monkeypatch.setattr(disk, "PIECE", 1 << 20)
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (6 << 20))
    calls = record_reads(monkeypatch)
    spans = [(0, 4096), ((2 << 20) - 4096, (1 << 20) + 8192)]
    seconds, _ = disk.sequential_read(path, "direct", spans=spans)
    assert seconds > 0
    # Each span in pieces of at most PIECE, in order within the span, every byte once.
    assert sorted(calls) == [(0, 4096), ((2 << 20) - 4096, 1 << 20), ((3 << 20) - 4096, 8192)]


def test_the_stream_brackets_read_the_disk_tier_blocks_tensors(tmp_path: Path) -> None:
    from benchmarks.disk import merged_spans
    from benchmarks.disk_child import _disk_tier_spans
    reference = reference_stack(8)
    path = write_single(reference, tmp_path / "model.safetensors")
    group = enable_layerwise_offload(meta_stack(8), device="cpu", weights=path,
                                     host_budget=4 * block_bytes(reference) + 4096)
    on_disk = [s for s in group.states if s.on_disk]
    assert on_disk
    read_path, spans = _disk_tier_spans(group, path, on_disk)
    assert read_path == path
    covered = sum(length for _, length in spans)
    # Every disk-tier byte is read, and at most the alignment padding beyond them per tensor.
    tensors = [e for s in on_disk for e in s.block.entries]
    assert len(on_disk) * block_bytes(reference) <= covered <= len(on_disk) * block_bytes(reference) + 2 * 4096 * len(tensors)
    for entry in tensors:
        assert any(o <= entry.offset and entry.offset + entry.nbytes <= o + n for o, n in spans)
    assert spans == merged_spans(spans, path.stat().st_size)


def test_the_stream_row_is_also_judged_against_the_read_table(monkeypatch) -> None:
    import benchmarks.disk as disk
    child = {"step_ms": 1100.0, "compute_ms": 20.0, "h2d_ms": 60.0, "disk_bytes_per_step": 2_000_000_000,
             "note": "compress=True: ..."}
    monkeypatch.setattr(disk, "_spawn", lambda config, timeout: dict(child))
    row = disk._stream_row({}, 1.0, 2e9)
    assert row["note"] == "compress=True: ...; against the read table's 2.00 GB/s: x max(...) 1.100, stream/bw 0.909"
    child.pop("note")
    assert disk._stream_row({}, 1.0, 2e9)["note"].startswith("against the read table's 2.00 GB/s")


def test_the_stream_row_checks_a_step_after_the_timed_ones_too(tmp_path: Path, monkeypatch) -> None:
    import benchmarks.disk as disk
    import benchmarks.disk_child as child
    from benchmarks.workloads import StackSpec, build_stack_on_host
    from safetensors.torch import save_file

    spec = StackSpec("tiny", d=64, blocks=8, tokens=4, n_norms=2, character="")
    path = tmp_path / "tiny.safetensors"
    model = build_stack_on_host(spec, seed=3, init_device="cpu")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    monkeypatch.setattr(disk, "_spec", lambda cuda, quick: spec)
    monkeypatch.setattr(child, "_h2d_bytes_per_s", lambda torch, device: 1e9)
    keys = ("bytes", "in_place", "wall", "idle", "read", "waits", "wait_s", "idle_waits_s", "out_of_order",
            "copy_wait_s")

    def rounds(torch, device, group, step, bracket_read, count, timed, *, spoil):
        step()
        if spoil:  # a later step that no longer matches, as a race in the streaming ring would give
            group.model_ref.forward = lambda x: x
        return [1.0] * count, [1e9] * count, {key: 1.0 for key in keys}

    config = {"mode": "stream", "path": str(path), "cuda": False, "quick": True, "compress": False}
    for spoil in (False, True):
        monkeypatch.setattr(child, "_rounds", lambda *args, spoil=spoil: rounds(*args, spoil=spoil))
        result = child._stream(dict(config))
        assert result["disk_blocks"] > 0 and result["exact_first"] is True
        assert result["exact_last"] is (not spoil) and result["exact"] is (not spoil)
