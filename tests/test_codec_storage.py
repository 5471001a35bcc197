"""Compression with weights=: the host tier holds compressed bytes, the disk tier a compressed spill file."""
from __future__ import annotations

import errno
import gc
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload, get_offload_group
from fastoffload_ext.engine.hooks import ModuleHookManager
from fastoffload_ext.errors import CheckpointReadError, OffloadConfigError
from fastoffload_ext.storage.source import CheckpointSource
from fastoffload_ext.storage import DiskOptions
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import OFFLOAD_DEVICES, params_equal

N_BLOCKS = 8


def _spills(folder: Path) -> list[Path]:
    return sorted(folder.glob(".fastoffload-spill-*"))


def _run_exact(model, reference, device: str, steps: int = 4) -> bool:
    x = inputs().to(device)
    with torch.no_grad():
        expected = reference.to(device)(x)
        return all(torch.equal(model(x), expected) for _ in range(steps))


def _half_in_host_memory(tmp_path: Path) -> tuple[torch.nn.Module, Path, int]:
    """The reference model, its checkpoint, and a host budget that holds about half of its blocks."""
    reference = reference_stack(N_BLOCKS)
    path = write_single(reference, tmp_path / "model.safetensors")
    return reference, path, N_BLOCKS * block_bytes(reference) // 2 + 4096


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("compress", [True, "auto"])
def test_host_tier_from_a_checkpoint_holds_the_compressed_bytes(tmp_path: Path, device: str, compress) -> None:
    reference = reference_stack(N_BLOCKS)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device=device, weights=path, compress=compress)
    assert not any(s.on_disk for s in group.states) and _spills(tmp_path) == []
    raw = sum(b["raw_bytes"] for b in group.stats()["codec"])
    if compress == "auto":
        # Both copies while measuring, then the engine decides for every block.
        assert [b["mode"] for b in group.stats()["codec"]] == ["measuring"] * N_BLOCKS
    assert _run_exact(model, reference, device)
    stats = group.stats()
    modes = {b["mode"] for b in stats["codec"]}
    assert modes <= {"compressed", "raw"} and len(modes) == 1, modes
    if compress is True:
        compressed = sum(b["compressed_bytes"] for b in stats["codec"])
        assert modes == {"compressed"} and stats["host_bytes"] == compressed < 0.85 * raw, (compressed, raw)
        # What stays allocated in the pool is the compressed regions (raw copies freed once encoded).
        assert group.engine.pool.stats()["in_use_bytes"] < 0.9 * raw
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_compressed_start_up_encodes_while_the_next_reads_run(tmp_path: Path, device: str) -> None:
    reference = reference_stack(N_BLOCKS)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device=device, weights=path, compress=True)
    # Every block but the last was encoded while the reads of later blocks were still queued.
    assert group.engine.stats()["pipelined_encodes"] == N_BLOCKS - 1
    assert [b["mode"] for b in group.stats()["codec"]] == ["compressed"] * N_BLOCKS
    # Each block was read exactly once, and every raw region was freed once encoded.
    assert group.engine.reader.stats()["bytes_read"] == N_BLOCKS * block_bytes(reference)
    host = group.stats()["host_bytes"]  # the compressed regions; the pool rounds each allocation up a little
    assert host <= group.engine.pool.stats()["in_use_bytes"] < host + block_bytes(reference)
    assert _run_exact(model, reference, device)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("half", [False, True])
def test_read_error_in_the_middle_of_a_compressed_start_up_rolls_back(tmp_path: Path, half: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    opened = CheckpointSource.open_files

    def failing(self: CheckpointSource, engine: object) -> None:
        opened(self, engine)
        # One request per block of this small model: the fifth block's read fails, while the encoder
        # still trails the reads queued after it.
        self.reader._inject_errors(4, 1, errno.EIO)

    monkeypatch.setattr(CheckpointSource, "open_files", failing)
    before = _threads()
    model = meta_stack(N_BLOCKS)
    with pytest.raises(CheckpointReadError, match=f"fastoffload: reading tensor 'blocks\\.4\\.[a-z0-9_.]+' \\(bytes "
                                                  f"\\d+\\.\\.\\d+ of {path}\\) failed: Input/output error\\. "
                                                  "Check the disk; nothing was changed"):
        enable_layerwise_offload(model, device="cpu", weights=path, compress=True,
                                 host_budget=budget if half else None)
    # Nothing half-built: the meta model as it was, no hook, no spill file, the reader's threads gone.
    assert all(p.is_meta for p in model.parameters())
    assert get_offload_group(model) is None
    assert all(ModuleHookManager.get_from(m) is None for m in model.modules())
    assert _spills(tmp_path) == []
    gc.collect()
    assert _threads() <= before
    # The same checkpoint, read without the fault, gives the resident model's outputs.
    monkeypatch.setattr(CheckpointSource, "open_files", opened)
    enable_layerwise_offload(model, device="cpu", weights=path, compress=True, host_budget=budget if half else None)
    assert _run_exact(model, reference, "cpu", steps=2)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("compress", [True, "auto"])
def test_model_twice_the_host_budget_streams_compressed_bytes_from_a_spill_file(tmp_path: Path, device: str,
                                                                               compress) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device=device, weights=path, host_budget=budget, compress=compress)
    disk = [s for s in group.states if s.on_disk]
    assert len(disk) >= N_BLOCKS // 2
    spills = _spills(tmp_path)
    assert [str(p) for p in spills] == [group.engine.spill_path]
    # Every disk block but the last was encoded and written while the next one was being read.
    assert group.engine.stats()["pipelined_spills"] == len(disk) - 1
    infos = [group.engine.codec_info(s.handle) for s in disk]
    # A disk read costs far more than a decode: disk blocks travel compressed under "auto" too.
    assert [i["mode"] for i in infos] == ["compressed"] * len(disk) and all(i == infos[0] for i in infos)
    info = infos[0]
    assert info["compressed_bytes"] < 0.85 * info["raw_bytes"] and info["host_bytes"] == 0
    # The spill file holds the disk blocks' compressed regions, each padded to 4 KiB for O_DIRECT.
    padded = -(-info["compressed_bytes"] // 4096) * 4096
    assert spills[0].stat().st_size == group.engine.spill_bytes == len(disk) * padded
    if compress is True:
        # Host tier blocks hold their compressed bytes; disk blocks none. The pool holds those and the
        # staging ring, nothing more.
        host_tier = (N_BLOCKS - len(disk)) * info["compressed_bytes"]
        assert group.stats()["host_bytes"] == host_tier
        staging = group.engine.disk_stats()["staging_count"] * group.engine.disk_stats()["staging_bytes"]
        assert group.engine.pool.stats()["in_use_bytes"] <= host_tier + staging + 256 * N_BLOCKS <= budget
    before = group.engine.reader.stats()["bytes_read"]
    assert _run_exact(model, reference, device)
    read = group.engine.reader.stats()["bytes_read"] - before
    # Each step reads the compressed bytes of every disk block (not the checkpoint's raw tensors). The
    # staging ring's reads ahead blur the window's start: its first fill, queued at enable, may have
    # landed before `before` (and its refill for a fifth step may add to the count).
    ring = group.engine.disk_stats()["staging_count"]
    assert read >= (4 * len(disk) - ring) * info["compressed_bytes"] and read % info["compressed_bytes"] == 0
    assert group.engine.disk_stats()["reads"] >= 4 * len(disk)
    disable_layerwise_offload(model, device="cpu")
    assert _spills(tmp_path) == []
    assert params_equal(model, reference.cpu())


def test_compressed_host_blocks_leave_room_for_more_blocks_in_the_host_budget(tmp_path: Path) -> None:
    reference = reference_stack(N_BLOCKS)
    path = write_single(reference, tmp_path / "model.safetensors")
    raw = block_bytes(reference)
    budget = 5 * raw + 4096  # raw: about 4 host blocks beside one staging buffer, the rest on disk
    options = DiskOptions(staging_buffers=1)
    on_disk = {}
    for compress in (False, True):
        model = meta_stack(N_BLOCKS)
        group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=compress,
                                         disk_options=options)
        on_disk[compress] = sum(s.on_disk for s in group.states)
        assert group.engine.pool.stats()["in_use_bytes"] <= budget
        assert _run_exact(model, reference, "cpu", steps=3)
        disable_layerwise_offload(model, device="cpu")
        assert params_equal(model, reference.cpu()) and _spills(tmp_path) == []
    assert on_disk[False] >= 4 and 0 < on_disk[True] < on_disk[False], on_disk


def test_spill_dir_holds_the_spill_file_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    elsewhere = tmp_path / "spill"
    elsewhere.mkdir()
    model = meta_stack(N_BLOCKS)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True,
                             disk_options=DiskOptions(spill_dir=elsewhere))
    assert len(_spills(elsewhere)) == 1 and _spills(tmp_path) == []
    assert _run_exact(model, reference, "cpu", steps=2)
    disable_layerwise_offload(model, device="cpu")
    assert _spills(elsewhere) == []
    model = meta_stack(N_BLOCKS)
    with pytest.raises(RuntimeError, match=r"fastoffload: cannot create the spill file '.*/missing/\.fastoffload-spill-"
                                           r".*' of the compressed disk tier: No such file or directory; pass "
                                           r"DiskOptions\(spill_dir=\.\.\.\) a writable directory"):
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True,
                                 disk_options=DiskOptions(spill_dir=tmp_path / "missing"))
    assert get_offload_group(model) is None and all(p.is_meta for p in model.blocks.parameters())


def test_a_relative_spill_dir_keeps_working_after_the_process_changes_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    (tmp_path / "spill").mkdir()
    monkeypatch.chdir(tmp_path)
    model = meta_stack(N_BLOCKS)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True,
                             disk_options=DiskOptions(spill_dir="spill"))
    assert len(_spills(tmp_path / "spill")) == 1
    # The spill file is checked by name before every read (and removed by name at detach).
    monkeypatch.chdir(tmp_path.parent)
    assert _run_exact(model, reference, "cpu", steps=2)
    disable_layerwise_offload(model, device="cpu")
    assert _spills(tmp_path / "spill") == [] and params_equal(model, reference)


def test_a_full_disk_while_spilling_fails_cleanly(tmp_path: Path) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    model = meta_stack(N_BLOCKS)
    # A file-size limit makes the spill's second block fail as a full disk would (EFBIG instead of ENOSPC).
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, limits[1]))
    try:
        with pytest.raises(RuntimeError, match=r"fastoffload: writing \d+ bytes to the spill file '.*' of the compressed "
                                               r"disk tier failed: File too large \(the disk is full or a limit was "
                                               r"reached\); free space there, or pass DiskOptions\(spill_dir=\.\.\.\)"):
            enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert _spills(tmp_path) == []
    assert get_offload_group(model) is None and all(p.is_meta for p in model.blocks.parameters())


def test_a_spill_file_changed_after_enable_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True)
    spill = Path(group.engine.spill_path)
    assert _run_exact(model, reference, "cpu", steps=1)
    # One byte flipped in place: a rewrite from the start would truncate the file first, and a read-ahead
    # landing in that moment sees a short file instead of changed bytes.
    with spill.open("r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)[0]
        handle.seek(100)
        handle.write(bytes([byte ^ 0xFF]))
    x = inputs()
    with pytest.raises(RuntimeError, match=r"fastoffload: checkpoint file .*\.fastoffload-spill-.* changed after offload "
                                           r"was enabled"):
        with torch.no_grad():
            for _ in range(2):  # the read-ahead of the first step may already hold the old bytes
                model(x)
    disable_layerwise_offload(model, device="cpu")
    assert _spills(tmp_path) == [] and params_equal(model, reference.cpu())


def test_bad_spill_dir_is_refused() -> None:
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: DiskOptions.spill_dir must be a directory path or "
                                                 r"None, got int$"):
        DiskOptions(spill_dir=3)
