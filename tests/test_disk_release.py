"""What an offload from weights= holds beyond its blocks (the reader's files and threads, the disk tier's staging
ring and thread, the spill file) goes when the offload is undone, while the caller still holds the group."""
from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload, get_offload_group
from fastoffload_ext.errors import CheckpointReadError, OffloadStateError
from fastoffload_ext.storage import DiskOptions
from fastoffload_ext.storage.source import CheckpointSource
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import params_equal

N_BLOCKS = 8
READ_THREADS = 3  # the reader runs twice as many workers: a leak of them is plain to see


def _threads() -> int:
    # The reader's and the disk tier's threads are the core's own: threading.enumerate() does not see them.
    return len(os.listdir("/proc/self/task"))


def _open_files(*paths: Path) -> list[str]:
    """The descriptors of this process open on ``paths`` (spill files included, also once they were removed)."""
    wanted = [os.path.realpath(path) for path in paths]
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        if any(target == name or target.startswith(name) for name in wanted):
            found.append(target)
    return found


def _spill_prefix(folder: Path) -> Path:
    return folder / ".fastoffload-spill-"


def _half_in_host_memory(tmp_path: Path) -> tuple[torch.nn.Module, Path, int]:
    reference = reference_stack(N_BLOCKS)
    path = write_single(reference, tmp_path / "model.safetensors")
    return reference, path, N_BLOCKS * block_bytes(reference) // 2 + 4096


def _nothing_left_after_failure(failure: pytest.ExceptionInfo, path: Path, folder: Path, threads: int,
                                model: torch.nn.Module) -> None:
    """An enable that raised: while its traceback (``failure``) still holds the frames, and they the group and its
    engine, no file, spill file or thread of the engine is left, and the model is as it was (meta)."""
    assert failure.traceback is not None
    assert _open_files(path, _spill_prefix(folder)) == []
    assert list(folder.glob(".fastoffload-spill-*")) == []
    assert _threads() <= threads
    assert get_offload_group(model) is None and all(p.is_meta for p in model.parameters())


def _warm_up(reference: torch.nn.Module) -> None:
    """Before the threads are counted: one forward of the resident model, so that torch's own worker threads start
    outside the window, and a collection, so that no offload an earlier test dropped ends inside it."""
    with torch.no_grad():
        reference(inputs())
    gc.collect()


@pytest.mark.parametrize("compress", [False, True])
def test_disable_releases_the_reader_and_the_disk_tier_while_the_group_is_held(tmp_path: Path,
                                                                               compress: bool) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    _warm_up(reference)
    threads = _threads()
    assert _open_files(path, _spill_prefix(tmp_path)) == []
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=compress,
                                     disk_options=DiskOptions(read_threads=READ_THREADS))
    assert group.disk_blocks() >= N_BLOCKS // 2
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
    # What the offload holds while it runs: the files, the threads, the staging ring.
    assert len(_open_files(path)) >= 1
    if compress:
        assert len(_open_files(_spill_prefix(tmp_path))) >= 1
    assert _threads() >= threads + 2 * READ_THREADS
    staging = group.engine.disk_stats()["staging_count"] * group.engine.disk_stats()["staging_bytes"]
    assert staging > 0 and group.engine.pool.stats()["in_use_bytes"] >= staging
    read = group.engine.reader.stats()["bytes_read"]
    reads = group.engine.disk_stats()["reads"]

    disable_layerwise_offload(model, device="cpu")
    assert get_offload_group(model) is None
    # The group is still held, and holds its engine: nothing of the checkpoint is open, no core thread is left,
    # the staging ring went back to the pool with the host tier.
    assert _open_files(path, _spill_prefix(tmp_path)) == []
    assert list(tmp_path.glob(".fastoffload-spill-*")) == []
    assert _threads() <= threads
    assert group.engine.pool.stats()["in_use_bytes"] == 0
    # The values came back whole, and the model runs resident as the reference does.
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    # The figures stay readable: the reader's last ones (the disable read the disk-tier blocks back), the disk
    # tier's reads, and no staging left. The group itself says it is no longer the model's.
    assert group.engine.reader.stats()["bytes_read"] >= read
    after = group.engine.disk_stats()
    assert after["reads"] >= reads and after["staging_count"] * after["staging_bytes"] == 0
    with pytest.raises(OffloadStateError, match="no longer the one on its model"):
        group.stats()
    figures = group._engine_stats()  # what group.stats() reads from the engine and its reader
    assert figures["bytes_read"] >= read and figures["disk_reads"] >= reads and figures["staging_bytes"] == 0
    assert bool(group.engine.spill_path) == compress and not os.path.exists(group.engine.spill_path)


def test_a_closed_engine_refuses_what_needs_its_reader_or_disk_tier(tmp_path: Path) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    engine = group.engine
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    disk = next(state.handle for state in group.states if state.on_disk)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    # Each says why, instead of waiting for threads that are gone or reading through a closed file.
    with pytest.raises(RuntimeError, match="reader was closed"):
        engine.reader.open(str(path))
    with pytest.raises(RuntimeError, match="reader was closed"):
        engine.reader.read([(0, 0, 4096, 0)], torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="detached from the offload engine"):
        engine.raw_host_bytes(disk)
    with pytest.raises(RuntimeError):
        engine.start_disk_tier(2)
    with pytest.raises(RuntimeError, match="no disk tier running"):
        engine.set_disk_order([disk])
    assert engine.reader.stats()["jobs"] > 0
    engine.close()  # a second close is a no-op
    assert _open_files(path) == []


def test_a_closed_engine_with_blocks_left_raises_instead_of_crashing(tmp_path: Path) -> None:
    """close() before every block was restored (the way to drop everything): a disk-tier block left in the engine
    can no longer be read, and says so; a disable to the meta device still takes the offload off."""
    reference, path, budget = _half_in_host_memory(tmp_path)
    model = meta_stack(N_BLOCKS)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    engine = group.engine
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    disk = next(state.handle for state in group.states if state.on_disk)
    engine.close()
    assert _open_files(path) == []
    with pytest.raises(RuntimeError, match="reader was closed"):
        engine.host_view(disk, 0)
    with pytest.raises(RuntimeError, match="disk tier"):
        with torch.no_grad():
            model(inputs())
    disable_layerwise_offload(model, device="meta")
    assert get_offload_group(model) is None and all(p.is_meta for p in model.blocks.parameters())


@pytest.mark.parametrize("compress", [False, True])
def test_a_failed_enable_releases_the_reader_while_its_traceback_is_held(tmp_path: Path, compress: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    _warm_up(reference)
    opened = CheckpointSource.open_files

    def failing(self: CheckpointSource, engine: object) -> None:
        opened(self, engine)
        self.reader._inject_errors(0, 1, errno.EIO)  # the first block read at enable fails

    monkeypatch.setattr(CheckpointSource, "open_files", failing)
    threads = _threads()
    model = meta_stack(N_BLOCKS)
    with pytest.raises(CheckpointReadError, match="Input/output error") as failure:
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=compress,
                                 disk_options=DiskOptions(read_threads=READ_THREADS))
    # The traceback holds the frames, and they the group and its engine; what the engine held is gone anyway.
    _nothing_left_after_failure(failure, path, tmp_path, threads, model)
    # The same checkpoint, read without the fault, runs bit-exact.
    monkeypatch.setattr(CheckpointSource, "open_files", opened)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=compress)
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


def test_a_failed_spill_file_releases_the_reader_while_its_traceback_is_held(tmp_path: Path) -> None:
    reference, path, budget = _half_in_host_memory(tmp_path)
    _warm_up(reference)
    threads = _threads()
    model = meta_stack(N_BLOCKS)
    with pytest.raises(RuntimeError, match="cannot create the spill file") as failure:
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True,
                                 disk_options=DiskOptions(spill_dir=tmp_path / "missing", read_threads=READ_THREADS))
    assert failure.traceback is not None
    assert _open_files(path) == []
    assert _threads() <= threads
    assert get_offload_group(model) is None and all(p.is_meta for p in model.parameters())


def test_an_enable_that_fails_after_the_engine_is_built_releases_its_files(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure between the engine's build (its files and spill file open) and the first attached block, as a
    sharing negotiation's, closes the engine before the error propagates."""
    from fastoffload_ext.engine import layerwise

    reference, path, budget = _half_in_host_memory(tmp_path)
    _warm_up(reference)

    def failing(*_: object) -> None:
        raise OffloadStateError("fastoffload: injected failure of the negotiation")

    monkeypatch.setattr(layerwise, "_negotiate_sharing", failing)
    threads = _threads()
    model = meta_stack(N_BLOCKS)
    with pytest.raises(OffloadStateError, match="injected") as failure:
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, compress=True,
                                 disk_options=DiskOptions(read_threads=READ_THREADS))
    _nothing_left_after_failure(failure, path, tmp_path, threads, model)
