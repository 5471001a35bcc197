"""Checkpoint faults: each a clear error naming the file and the tensor, nothing half-built, nothing leaked."""
from __future__ import annotations

import errno
import gc
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload, get_offload_group
from fastoffload_ext.engine.hooks import ModuleHookManager
from fastoffload_ext.errors import CheckpointError, CheckpointReadError, OffloadConfigError, OffloadStateError
from fastoffload_ext.planning.tiers import STAGING_SLACK
from fastoffload_ext.storage import DiskOptions
from fastoffload_ext.storage.checkpoint import open_checkpoint
from fastoffload_ext.storage.source import CheckpointSource
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_sharded, write_single
from tests._models import params_equal


def _budget(blocks: int, reference: torch.nn.Module, buffers: int = 2) -> int:
    """A host budget of ``blocks`` blocks beside a staging ring of ``buffers`` (each with its slack)."""
    return blocks * block_bytes(reference) + 8192 + buffers * STAGING_SLACK


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _untouched(model: torch.nn.Module) -> None:
    """The failed enable left the meta model exactly as it was."""
    assert all(p.is_meta for p in model.parameters())
    assert get_offload_group(model) is None
    assert all(ModuleHookManager.get_from(m) is None for m in model.modules())


@pytest.fixture()
def checkpoint(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    reference = reference_stack(6)
    return reference, write_single(reference, tmp_path / "model.safetensors")


def test_missing_file(tmp_path: Path) -> None:
    model = meta_stack(2)
    with pytest.raises(CheckpointError, match=f"fastoffload: checkpoint {tmp_path}/nope.safetensors does not exist"):
        enable_layerwise_offload(model, device="cpu", weights=tmp_path / "nope.safetensors")
    _untouched(model)


def test_missing_shard(tmp_path: Path) -> None:
    from tests._checkpoints import write_sharded
    index = write_sharded(reference_stack(3), tmp_path / "ckpt", shards=2)
    shard = sorted((tmp_path / "ckpt").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint file {shard} does not exist"):
        enable_layerwise_offload(meta_stack(3), device="cpu", weights=index)


def test_missing_tensor(tmp_path: Path) -> None:
    state = reference_stack(3).state_dict()
    del state["blocks.1.up.weight"]
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    model = meta_stack(3)
    with pytest.raises(CheckpointError, match=f"parameter 'blocks.1.up.weight' is not in checkpoint {path}"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    _untouched(model)


def test_a_checkpoint_of_more_blocks_than_the_model_says_what_it_leaves_unread(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    # A model built with fewer blocks than its checkpoint (another config) finds every tensor it needs, and ran
    # the shorter network without a word, where load_state_dict refuses the checkpoint's other tensors.
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    with caplog.at_level("WARNING", logger="fastoffload_ext.storage.source"):
        enable_layerwise_offload(meta_stack(6), device="cpu", weights=path)
    assert "has no parameter or buffer" not in caplog.text  # the matching model reads the whole checkpoint
    with pytest.raises(RuntimeError, match="Unexpected key"):
        reference_stack(4).load_state_dict(reference.state_dict())
    caplog.clear()
    model = meta_stack(4)
    with caplog.at_level("WARNING", logger="fastoffload_ext.storage.source"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    unused = sorted(name for name in reference.state_dict() if name.startswith(("blocks.4.", "blocks.5.")))
    assert f"fastoffload: checkpoint {path} holds {len(unused)} tensor(s) that the model has no parameter or " \
           f"buffer for (e.g. {', '.join(unused[:3])}); they are not read" in caplog.text


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests._checkpoints import write_sharded
    reference = reference_stack(3)
    index = write_sharded(reference, tmp_path / "ckpt", shards=2)
    shards = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    name = "blocks.1.up.weight"
    # A stale copy, with other values, left in the shard that the index does not name for the tensor.
    other = next(shard for shard in shards if name not in open_checkpoint(shard).entries)
    save_file({**load_file(str(other)), name: torch.zeros_like(reference.state_dict()[name])}, str(other))
    model = meta_stack(3)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is in both {re.escape(str(shards[0]))} and "
                                              f"{re.escape(str(shards[1]))}; the checkpoint's shards overlap"):
        enable_layerwise_offload(model, device="cpu", weights=index)
    _untouched(model)


@pytest.mark.parametrize("resident_blocks", [None, 3])
def test_a_parameter_outside_the_offloaded_blocks_missing_from_the_checkpoint_is_refused_on_a_real_model(
        tmp_path: Path, resident_blocks: int | None) -> None:
    reference = reference_stack(3)
    missing = "proj_out.weight" if resident_blocks is None else "blocks.1.up.weight"
    state = {k: v for k, v in reference.state_dict().items() if k != missing}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    # Built with real weights (its own random init): the parameter the checkpoint lacks was kept, and the
    # model ran with it, silently other than the checkpoint's model.
    model = reference_stack(3, seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"parameter '{re.escape(missing)}' is not in checkpoint {path}"):
        enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=resident_blocks)
    assert get_offload_group(model) is None
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_truncated_file(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    _, path = checkpoint
    os.truncate(path, path.stat().st_size - 100)
    model = meta_stack(6)
    with pytest.raises(CheckpointError, match=f"fastoffload: {path} is not a readable safetensors file .*truncated"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    _untouched(model)


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_shape_or_dtype_differs(tmp_path: Path, change: str) -> None:
    state = reference_stack(3).state_dict()
    state["blocks.2.o.weight"] = (state["blocks.2.o.weight"][:, :16].contiguous() if change == "shape"
                                  else state["blocks.2.o.weight"].float())
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    model = meta_stack(3)
    expected = "\\[32, 16\\] and dtype torch.bfloat16" if change == "shape" else "\\[32, 32\\] and dtype torch.float32"
    with pytest.raises(CheckpointError, match=f"tensor 'blocks.2.o.weight' in {path} has shape {expected}, but the "
                                              "model's parameter has shape \\[32, 32\\] and dtype torch.bfloat16"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    _untouched(model)


def test_meta_buffer_without_values(tmp_path: Path) -> None:
    reference = reference_stack(2)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(2)
    model.register_buffer("table", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(CheckpointError, match="buffer 'table' is on the meta device and not in checkpoint"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    _untouched(model)


def _fail_reads(monkeypatch: pytest.MonkeyPatch, after: int, count: int) -> None:
    """Once enable has opened the checkpoint: ``after`` read requests succeed, the next ``count`` fail (EIO)."""
    opened = CheckpointSource.open_files

    def failing(self: CheckpointSource, engine: object) -> None:
        opened(self, engine)
        self.reader._inject_errors(after, count, errno.EIO)

    monkeypatch.setattr(CheckpointSource, "open_files", failing)


def test_read_error_while_packing_rolls_back(checkpoint: tuple[torch.nn.Module, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = checkpoint
    _fail_reads(monkeypatch, after=3, count=1)  # the fourth read request of the enable fails
    before = _threads()
    model = meta_stack(6)
    with pytest.raises(CheckpointReadError, match=f"fastoffload: reading tensor 'blocks\\.\\d\\.[a-z.]+' \\(bytes "
                                                  f"\\d+\\.\\.\\d+ of {path}\\) failed: Input/output error"):
        enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=1)
    _untouched(model)
    gc.collect()
    assert _threads() <= before  # the reader's threads ended with the engine (others may have ended too)


def test_a_read_error_at_enable_of_a_real_model_leaves_no_block_half_read(checkpoint: tuple[torch.nn.Module, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = checkpoint
    _fail_reads(monkeypatch, after=3, count=1)  # the fourth read request of the enable fails
    model = reference_stack(6, seed=7)  # real weights, not the checkpoint's
    outside = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    with pytest.raises(CheckpointReadError) as raised:
        enable_layerwise_offload(model, device="cpu", weights=path)
    # The blocks' old values went as their host copies were read, and one copy was never read in full:
    # they are on the meta device now, and the error says so, rather than a mix of old, new and unread bytes.
    assert all(p.is_meta for p in model.blocks.parameters())
    assert "6 offloaded block(s) that held real weights before" in "".join(getattr(raised.value, "__notes__", []))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in outside.items())
    assert get_offload_group(model) is None and all(ModuleHookManager.get_from(m) is None for m in model.modules())
    monkeypatch.undo()
    enable_layerwise_offload(model, device="cpu", weights=path)  # the way the note gives: all from the checkpoint
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))


READ_ERROR = ("fastoffload: reading tensor 'blocks\\.\\d\\.[a-z0-9_.]+' \\(bytes \\d+\\.\\.\\d+ of {path}\\) failed: "
              "Input/output error\\. Check the disk; nothing was changed, and a later read tries again")


def _fail_mid_step(group: object, model: torch.nn.Module, x: torch.Tensor, path: Path, count: int) -> str:
    """Makes the next ``count`` chunk reads fail and runs steps until one raises; returns its message."""
    group.engine.reader._inject_errors(0, count, errno.EIO)
    with pytest.raises(CheckpointReadError, match=READ_ERROR.format(path=path)) as raised:
        for _ in range(3):
            model(x)
    return str(raised.value)


def _first_good_step(model: torch.nn.Module, x: torch.Tensor, path: Path, tries: int) -> torch.Tensor:
    for _ in range(tries - 1):
        try:
            return model(x)
        except CheckpointReadError as error:
            assert re.match(READ_ERROR.format(path=path), str(error))
    return model(x)


def test_read_error_mid_step_then_detach_keeps_every_value(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    with torch.no_grad():
        _fail_mid_step(group, model, inputs(), path, 1)
    disable_layerwise_offload(model)  # straight after the failed step: the disk blocks are read back
    assert get_offload_group(model) is None
    assert params_equal(model, reference)


def test_persistent_read_error_repeats_the_same_error(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):  # each retry raises the same error again; nothing is left half-read
            _fail_mid_step(group, model, x, path, 10**6)
        # Detach needs the disk blocks' bytes too: it refuses with the same error and changes nothing, so
        # that it can be retried once the disk reads again.
        with pytest.raises(CheckpointReadError, match=READ_ERROR.format(path=path)):
            disable_layerwise_offload(model)
        group.engine.reader._inject_errors(0, 0, 0)
        assert get_offload_group(model) is group
        # The blocks before the failing one were detached, the rest are still offloaded: both run. A
        # read-ahead that failed while the disk did raises once more when its block is needed, then
        # that block is read anew.
        assert torch.equal(_first_good_step(model, x, path, tries=4), expected)
        disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("budget_blocks", [3])
def test_read_error_mid_step_then_recovers(checkpoint: tuple[torch.nn.Module, Path], budget_blocks: int) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(budget_blocks, reference))
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        group.engine.reader._inject_errors(2, 1, errno.EIO)
        with pytest.raises(CheckpointReadError, match=READ_ERROR.format(path=path)) as raised:
            for _ in range(3):
                model(x)
        # Both what a build-time checkpoint fault is and what a runtime state error is.
        assert isinstance(raised.value, CheckpointError) and isinstance(raised.value, OffloadStateError)
        for _ in range(2):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_file_changed_after_enable(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    x = inputs()
    stat = path.stat()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        with pytest.raises(CheckpointReadError, match=f"fastoffload: checkpoint file {path} changed after offload was "
                                                      "enabled .*disable offload and enable it again"):
            for _ in range(2):
                model(x)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert torch.equal(model(x), expected)
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_a_read_ahead_that_saw_the_file_change_is_read_again_once_the_file_is_back(
        checkpoint: tuple[torch.nn.Module, Path]) -> None:
    """A disk-tier read that was queued before the file changed and finished after it fails (what it read may mix
    two versions). The block's acquire reads it again: with the file put back, the step runs bit-exact."""
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    reader = group.checkpoint.reader
    x = inputs()
    stat = path.stat()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        reader._set_delay_us(300_000)  # the reads ahead that this step's last blocks queue start late
        assert torch.equal(model(x), expected)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        time.sleep(1.5)  # they read while the file is changed, and fail when they end
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        reader._set_delay_us(0)
        for _ in range(2):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("window", ["before the reader opens it", "while the resident tensors are read",
                                    "while an all-resident model is read"])
def test_file_changed_during_enable(checkpoint: tuple[torch.nn.Module, Path], monkeypatch: pytest.MonkeyPatch,
                                    window: str) -> None:
    reference, path = checkpoint
    stat = path.stat()

    def touch() -> None:  # what a writer still saving the file does: a new modification time
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    step = CheckpointSource.open_files if window == "before the reader opens it" else CheckpointSource._load

    def changing(self: CheckpointSource, *args: object) -> None:
        touch()
        step(self, *args)

    monkeypatch.setattr(CheckpointSource, step.__name__, changing)
    model = meta_stack(6)
    budget = {"resident_blocks": 6} if window == "while an all-resident model is read" else {}
    # The reader, once open, refuses a changed file with its own message (its reads of the blocks may come first).
    with pytest.raises(CheckpointError, match=f"fastoffload: checkpoint file {path} changed (while enable read it .*"
                                              "Wait until the file is fully written|after offload was enabled)"):
        enable_layerwise_offload(model, device="cpu", weights=path, **budget)
    _untouched(model)
    monkeypatch.undo()
    enable_layerwise_offload(model, device="cpu", weights=path, **budget)  # the file as it is now
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_file_rewritten_while_the_host_tier_blocks_are_read_is_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         layout: str) -> None:
    # A writer that preallocates the file (same size) rewrites a block's bytes after the resident tensors were
    # read and checked, while the blocks' reads, queued before it, still wait: their host copies would hold the
    # new bytes beside the old resident tensors, and a host-tier model never reads the file again to notice.
    reference = reference_stack(6)
    path = (write_single(reference, tmp_path / "model.safetensors") if layout == "single"
            else write_sharded(reference, tmp_path / "sharded"))
    entries = [entry for name, entry in open_checkpoint(path).entries.items() if name.startswith("blocks.3.")]
    open_files, load_resident = CheckpointSource.open_files, CheckpointSource.load_resident

    def slow_reads(self: CheckpointSource, engine: object) -> None:
        open_files(self, engine)
        self.reader._set_delay_us(200_000)  # the blocks' reads run after the rewrite below

    def then_rewritten(self: CheckpointSource, *args: object) -> None:
        load_resident(self, *args)
        for entry in entries:
            stat = os.stat(entry.path)
            with open(entry.path, "r+b") as file:
                file.seek(entry.offset)
                file.write(b"\0" * entry.nbytes)
            os.utime(entry.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    monkeypatch.setattr(CheckpointSource, "open_files", slow_reads)
    monkeypatch.setattr(CheckpointSource, "load_resident", then_rewritten)
    model = meta_stack(6)
    with pytest.raises(CheckpointError, match=f"fastoffload: checkpoint file {re.escape(entries[0].path)} changed "
                                              "while enable read it .*Wait until the file is fully written"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    _untouched(model)
    monkeypatch.undo()
    enable_layerwise_offload(model, device="cpu", weights=path)  # the file as it is now: one version throughout
    disable_layerwise_offload(model, device="cpu")
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.blocks[3].parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.blocks[2].parameters(), reference.blocks[2].parameters()))


def test_file_replaced_after_enable(checkpoint: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    shutil.copy(path, tmp_path / "copy.safetensors")
    os.replace(tmp_path / "copy.safetensors", path)  # another file (inode) under the same name
    with torch.no_grad(), pytest.raises(CheckpointReadError, match=f"checkpoint file {path} changed after offload"):
        for _ in range(2):
            model(inputs())


def test_slow_disk_slows_but_stays_exact(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    group.engine.reader._set_delay_us(20_000)
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        # enable's reads, and read-ahead it started, ran undelayed: count from the second step on
        assert torch.equal(model(x), expected)
        before = group.engine.reader.stats()
        for _ in range(3):
            assert torch.equal(model(x), expected)
    after = group.engine.reader.stats()
    chunks = after["chunks"] - before["chunks"]
    assert chunks > 0
    # every read of the steps above was slowed
    assert after["busy_seconds"] - before["busy_seconds"] >= 0.02 * chunks


def test_budget_below_the_staging_ring(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    with pytest.raises(OffloadConfigError, match="host_budget=1000 bytes cannot hold even the disk tier's staging ring"):
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=1000)
    _untouched(model)


def test_mutation_of_a_disk_block_is_refused(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    hooks = [ModuleHookManager.get_from(b).get_forward_hook("LayerwiseOffloadHook") for b in model.blocks]
    on_disk = [h for h, s in zip(hooks, group.states) if s.on_disk]
    with pytest.raises(OffloadStateError, match="fastoffload: this block is in the disk tier"):
        with on_disk[0].mutate_params_scope():
            pass
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))


def test_a_load_that_reaches_a_disk_block_changes_nothing(checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    size = block_bytes(reference)
    model = meta_stack(6)
    # Block 0 resident, and a host-tier block comes before the first disk-tier one: a load that reached
    # the disk block only after loading those would leave the model half new.
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * size + 8192 + STAGING_SLACK,
                                     resident_blocks=[0], disk_options=DiskOptions(staging_buffers=1))
    tiers = [s.on_disk for s in group.states]
    assert not tiers[0] and any(tiers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bumped = {k: v + 1 for k, v in reference.state_dict().items()}
    with pytest.raises(OffloadStateError, match="fastoffload: this block is in the disk tier: .* no host copy to load "
                                                "new values into. Nothing was loaded"):
        model.load_state_dict(bumped)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    # A load that names no disk-tier block loads as usual.
    host = [i for i, s in zip(group.offloaded_indices, group.states) if not s.on_disk]
    subset = {k: v for k, v in bumped.items() if k.startswith(tuple(f"blocks.{i}." for i in [0, *host]))}
    model.load_state_dict(subset, strict=False)
    expected = reference_stack(6)
    expected.load_state_dict(subset, strict=False)
    with torch.no_grad():
        assert torch.equal(model(inputs()), expected(inputs()))
    # Once offload is gone the guard is too.
    disable_layerwise_offload(model, device="cpu")
    model.load_state_dict(bumped)
    loaded = reference_stack(6)
    loaded.load_state_dict(bumped)
    assert params_equal(model, loaded)


def test_disable_after_the_file_changed_changes_nothing_and_meta_is_the_way_out(
        checkpoint: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    # A host-tier block before the first disk-tier one: a disable that detached blocks in order and only
    # then met the changed file would leave the model half detached.
    group = enable_layerwise_offload(model, device="cpu", weights=path,
                                     host_budget=_budget(5, reference, buffers=1),
                                     disk_options=DiskOptions(staging_buffers=1))
    tiers = [s.on_disk for s in group.states]
    assert not tiers[0] and any(tiers)
    newer = reference_stack(6, seed=5)
    os.replace(write_single(newer, tmp_path / "newer.safetensors"), path)
    for device in (None, "cpu"):
        with pytest.raises(CheckpointReadError, match=f"checkpoint file {path} changed after offload was enabled .*"
                                                      "disable_layerwise_offload\\(model, device='meta'\\)"):
            disable_layerwise_offload(model, device=device)
        assert get_offload_group(model) is group
        assert all(ModuleHookManager.get_from(b).get_forward_hook("LayerwiseOffloadHook") for b in model.blocks)
        assert all(p.numel() == 0 for p in model.blocks.parameters())  # every block still offloaded
    # The way out the error names reads nothing; enabled again, the model runs the new file's weights.
    disable_layerwise_offload(model, device="meta")
    assert get_offload_group(model) is None and all(p.is_meta for p in model.blocks.parameters())
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(5, reference, buffers=1),
                             disk_options=DiskOptions(staging_buffers=1))
    with torch.no_grad():
        assert torch.equal(model(inputs()), newer(inputs()))
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, newer)


def test_a_persistent_read_error_at_enable_with_a_disk_tier_leaves_the_model_untouched(
        checkpoint: tuple[torch.nn.Module, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reference, path = checkpoint
    _fail_reads(monkeypatch, after=0, count=10**6)  # every read fails, the roll-back's too
    model = meta_stack(6)
    with pytest.raises(CheckpointReadError, match=READ_ERROR.format(path=path)):
        enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    _untouched(model)
    monkeypatch.undo()
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(3, reference))
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))


def test_a_load_into_the_block_list_that_reaches_a_disk_block_changes_nothing(
        checkpoint: tuple[torch.nn.Module, Path]) -> None:
    reference, path = checkpoint
    model = meta_stack(6)
    # Block 0 in the host tier, a disk-tier block after it: the block list's own load_state_dict loads
    # its blocks in order, so without a guard on the list block 0 took the new values before the refusal.
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=_budget(5, reference, buffers=1),
                                     disk_options=DiskOptions(staging_buffers=1))
    tiers = [s.on_disk for s in group.states]
    assert not tiers[0] and any(tiers)
    bumped = {k[len("blocks."):]: v + 1 for k, v in reference.state_dict().items() if k.startswith("blocks.")}
    with pytest.raises(OffloadStateError, match="fastoffload: this block is in the disk tier"):
        model.blocks.load_state_dict(bumped)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in reference.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    # Naming host-tier blocks only, the list loads them.
    host = tuple(f"{i}." for i, on_disk in zip(group.offloaded_indices, tiers) if not on_disk)
    subset = {k: v for k, v in bumped.items() if k.startswith(host)}
    model.blocks.load_state_dict(subset, strict=False)
    expected = reference_stack(6)
    expected.blocks.load_state_dict(subset, strict=False)
    with torch.no_grad():
        assert torch.equal(model(inputs()), expected(inputs()))
    disable_layerwise_offload(model, device="cpu")  # the guards go with offload
    model.blocks.load_state_dict(bumped)
    expected.blocks.load_state_dict(bumped)
    assert params_equal(model, expected)
