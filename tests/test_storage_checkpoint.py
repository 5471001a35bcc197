"""Building an offload straight from a safetensors checkpoint: layouts, bit-exact forwards, argument errors."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext._backend import require_ext
from fastoffload_ext.errors import CheckpointError, CheckpointReadError, OffloadConfigError
from fastoffload_ext.planning.tiers import STAGING_SLACK, region_bytes
from fastoffload_ext.storage import DiskOptions, open_checkpoint
from tests._checkpoints import inputs, meta_stack, reference_stack, write_sharded, write_single
from tests._models import OFFLOAD_DEVICES, Stack, params_equal



def _run_equal(model: torch.nn.Module, reference: torch.nn.Module, device: str, steps: int = 2) -> None:
    x = inputs()
    reference = reference.to(device)
    with torch.no_grad():
        expected = reference(x.to(device))
        for _ in range(steps):
            assert torch.equal(model(x.to(device)), expected)


def test_offsets_are_the_bytes_of_each_tensor(tmp_path: Path) -> None:
    reference = reference_stack(3)
    path = write_single(reference, tmp_path / "model.safetensors")
    checkpoint = open_checkpoint(path)
    raw = path.read_bytes()
    state = reference.state_dict()
    assert set(checkpoint.entries) == set(state)
    for name, tensor in state.items():
        entry = checkpoint.entries[name]
        expected = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert raw[entry.offset:entry.offset + entry.nbytes] == expected
        assert entry.dtype == tensor.dtype and entry.shape == tuple(tensor.shape)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1), (3, 0)])
def test_meta_model_from_single_file_is_bit_exact(tmp_path: Path, device: str, depth: int, resident: int) -> None:
    reference = reference_stack(5)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(5)
    group = enable_layerwise_offload(model, device=device, weights=path, prefetch_depth=depth, resident_blocks=resident)
    assert not any(p.is_meta for p in model.parameters())
    assert model.proj_in.weight.device.type == device and model.blocks[0].qkv.weight.device.type == device
    _run_equal(model, reference, device)
    assert group.stats()["offloaded_blocks"] == 5 - resident
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("how", ["resident_blocks", "device_budget"])
def test_every_block_resident_still_reads_the_checkpoint(tmp_path: Path, device: str, how: str) -> None:
    # A plan (or resident_blocks) that keeps every block on the device offloads nothing: the checkpoint
    # must still be read, or the model stays on the meta device.
    reference = reference_stack(5)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(5)
    keep = {"resident_blocks": 5} if how == "resident_blocks" else {"device_budget": 1 << 40, "host_budget": None}
    group = enable_layerwise_offload(model, device=device, weights=path, **keep)
    assert group.stats()["offloaded_blocks"] == 0
    assert not any(p.is_meta for p in model.parameters())
    assert all(p.device.type == device for p in model.parameters())
    _run_equal(model, reference, device)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


@pytest.mark.parametrize("layout", ["index", "folder_index", "folder_file"])
def test_sharded_and_folder_checkpoints(tmp_path: Path, layout: str) -> None:
    reference = reference_stack(4)
    if layout == "index":
        weights: Path = write_sharded(reference, tmp_path / "ckpt", stem="model")
    elif layout == "folder_index":
        write_sharded(reference, tmp_path / "transformer")
        weights = tmp_path / "transformer"
    else:
        (tmp_path / "transformer").mkdir()
        write_single(reference, tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
        weights = tmp_path / "transformer"
    model = meta_stack(4)
    enable_layerwise_offload(model, device="cpu", weights=weights)
    _run_equal(model, reference, "cpu")
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_model_with_empty_weights_is_filled(tmp_path: Path) -> None:
    reference = reference_stack(3)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = Stack(3, 32).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    enable_layerwise_offload(model, device="cpu", weights=path)
    _run_equal(model, reference, "cpu")


@pytest.mark.parametrize("mode", ["buffered", "direct", "auto"])
def test_read_modes_give_the_same_bytes(tmp_path: Path, mode: str) -> None:
    reference = reference_stack(3)
    path = write_single(reference, tmp_path / "model.safetensors")
    core = require_ext()
    probe = core.DiskReader(1, 4096, "auto")
    if mode == "direct" and not probe.direct(probe.open(str(path))):
        pytest.skip("this file system refuses O_DIRECT")  # said, not silent: the auto case still runs
    model = meta_stack(3)
    options = DiskOptions(read_mode=mode, chunk_bytes=4096, read_threads=3)
    group = enable_layerwise_offload(model, device="cpu", weights=path, disk_options=options)
    _run_equal(model, reference, "cpu")
    stats = group.engine.reader.stats()
    assert stats["bytes_read"] > 0
    if mode == "buffered":
        assert stats["direct_bytes"] == 0


def test_reader_splits_and_merges_ranges(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    core = require_ext()
    for mode in ("auto", "buffered"):
        reader = core.DiskReader(3, 8192, mode)
        f = reader.open(str(path))
        assert reader.open(str(path)) == f
        spans = [(f, 5, 20_000, 0), (f, 20_010, 7, 20_001), (f, 250_001, 49_999, 30_000), (f, 100_000, 0, 0)]
        dest = torch.zeros(80_000, dtype=torch.uint8)
        reader.read(spans, dest)
        assert torch.equal(dest[:20_000], data[5:20_005])
        assert torch.equal(dest[20_001:20_008], data[20_010:20_017])
        assert torch.equal(dest[30_000:79_999], data[250_001:300_000])
        assert reader.stats()["bytes_read"] == 20_000 + 7 + 49_999


def test_a_file_rewritten_while_a_read_runs_fails_the_read(tmp_path: Path) -> None:
    """The reader checks a job's files when it is queued and again when its last chunk is read: bytes written in
    place in between (a writer that preallocates the file) fail the read instead of mixing two versions."""
    import threading

    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (64 * 8192,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    reader = require_ext().DiskReader(1, 8192, "buffered")
    f = reader.open(str(path))
    reader._set_delay_us(20_000)  # 64 chunks one after another: about 1.3 s of reading
    dest = torch.zeros_like(data)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            reader.read([(f, 0, data.numel(), 0)], dest)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(0.3)
    stat = path.stat()
    with open(path, "r+b") as file:
        file.write(bytes(8192))  # the first chunk, read already
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointReadError), errors
    assert f"checkpoint file {path} changed" in str(errors[0])
    reader._set_delay_us(0)
    with pytest.raises(CheckpointReadError, match="changed"):  # and every later read, until the file is restored
        reader.read([(f, 0, 8192, 0)], dest)


def test_reader_requests_end_at_aligned_offsets_whatever_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (3_000_000,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    core = require_ext()
    mib = 1 << 20
    for mode in ("auto", "buffered"):
        reader = core.DiskReader(2, mib, mode)
        f = reader.open(str(path))
        # A large tensor, a small one right after it, another large one: one extent of ~2.9 MiB.
        spans = [(f, 4000, 1_500_000, 0), (f, 1_504_000, 8, 1_500_160), (f, 1_504_008, 1_495_992, 1_500_416)]
        dest = torch.zeros(3_000_000, dtype=torch.uint8)
        reader.read(spans, dest)
        assert torch.equal(dest[:1_500_000], data[4000:1_504_000])
        assert torch.equal(dest[1_500_160:1_500_168], data[1_504_000:1_504_008])
        assert torch.equal(dest[1_500_416:2_996_408], data[1_504_008:3_000_000])
        stats = reader.stats()
        # Cut at 1 MiB file boundaries, not per tensor: [4000, 1 MiB), [1 MiB, 2 MiB), [2 MiB, end).
        assert stats["chunks"] == 3 and stats["bytes_read"] == 3_000_000 - 4000
        # Two request slots, four workers; the counters describe what happened.
        assert stats["threads"] == 2 and stats["workers"] == 4
        assert 1 <= stats["max_in_flight"] <= 2
        assert 0 < stats["read_seconds"] <= 2 * stats["wall_seconds"]
        assert 0 <= stats["idle_seconds"] <= stats["wall_seconds"]
        assert stats["bounce_bytes"] <= 4 * (mib + 8192)
        assert (stats["bounce_bytes"] > 0) == (stats["direct_bytes"] > 0)


def test_argument_errors() -> None:
    model = meta_stack(2)
    with pytest.raises(OffloadConfigError, match="fastoffload: disk_options needs weights="):
        enable_layerwise_offload(model, device="cpu", disk_options=DiskOptions())
    with pytest.raises(OffloadConfigError, match="fastoffload: weights= needs the compiled core"):
        enable_layerwise_offload(model, device="cpu", backend="python", weights="x.safetensors")
    with pytest.raises(OffloadConfigError, match="DiskOptions.staging_buffers must be an integer between 1 and 64"):
        DiskOptions(staging_buffers=0)
    with pytest.raises(OffloadConfigError, match="DiskOptions.read_mode must be one of"):
        DiskOptions(read_mode="mmap")
    with pytest.raises(OffloadConfigError, match="host_budget"):
        enable_layerwise_offload(model, device="cpu", weights="x.safetensors", host_budget=-1)
    with pytest.raises(RuntimeError, match="fastoffload: read mode must be 'auto', 'direct' or 'buffered'"):
        require_ext().DiskReader(1, 4096, "mmap")


def test_folder_with_several_checkpoints_is_refused(tmp_path: Path) -> None:
    reference = reference_stack(2)
    write_single(reference, tmp_path / "a.safetensors")
    write_single(reference, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="holds several checkpoints \\(a.safetensors, b.safetensors\\)"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="holds no .safetensors file"):
        open_checkpoint(_empty(tmp_path))


def test_folder_with_an_index_and_a_whole_model_file_it_does_not_name_is_refused(tmp_path: Path) -> None:
    """diffusers reads the index of such a folder and transformers the single file: which one is meant is refused
    as unclear, and either one passed by name opens."""
    reference = reference_stack(2)
    index = write_sharded(reference, tmp_path, stem="model")
    single = write_single(reference_stack(2, seed=7), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="holds both the sharded checkpoint model.safetensors.index.json and "
                                              "model.safetensors, which that index does not name"):
        open_checkpoint(tmp_path)
    for path, source in ((index, reference), (single, reference_stack(2, seed=7))):
        model = meta_stack(2)
        enable_layerwise_offload(model, device="cpu", weights=path)
        x = inputs()
        with torch.no_grad():
            assert torch.equal(model(x), source(x))
        disable_layerwise_offload(model, device="cpu")
        assert params_equal(model, source)


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_disable_to_meta_after_a_submodule_was_wrapped(tmp_path: Path) -> None:
    """The checkpoint names the parameters as they were at enable; a wrapper (a LoRA layer around a Linear) renames
    them since, and the disable to meta goes by object."""
    class Wrap(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x)

    path = write_single(reference_stack(3), tmp_path / "model.safetensors")
    model, reference = meta_stack(3), reference_stack(3)
    enable_layerwise_offload(model, device="cpu", weights=path)
    for m in (model, reference):
        for block in m.blocks:
            block.qkv = Wrap(block.qkv)
    _run_equal(model, reference, "cpu")
    disable_layerwise_offload(model, device="meta")
    got, want = dict(model.blocks.named_parameters()), dict(reference.blocks.named_parameters())
    assert got.keys() == want.keys()
    assert all(got[k].is_meta and got[k].shape == want[k].shape and got[k].dtype == want[k].dtype for k in want)


def test_a_diffusers_transformer_saved_with_save_pretrained_streams_from_its_folder(tmp_path: Path) -> None:
    """The path a user takes with a real DiT: save_pretrained's folder, a model built without memory
    (accelerate's init_empty_weights; buffers stay on the CPU), part of it on disk. Bit-exact against the
    loaded model, and freed with its last reference (Wan keeps scale_shift_table on the model itself)."""
    import gc
    import weakref

    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    config = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
                  text_dim=32, freq_dim=256, ffn_dim=512, num_layers=4, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    torch.manual_seed(0)
    reference = diffusers.WanTransformer3DModel(**config).eval()
    reference.save_pretrained(tmp_path / "transformer")
    with accelerate.init_empty_weights(include_buffers=False):
        model = diffusers.WanTransformer3DModel(**config).eval()
    block = sum(p.numel() * p.element_size() for p in reference.blocks[0].parameters())
    # Room for the staging ring's two buffers and one block: the other three stay on disk.
    budget = 2 * (block + STAGING_SLACK) + region_bytes(block)
    group = enable_layerwise_offload(model, device="cpu", weights=tmp_path / "transformer", host_budget=budget)
    assert group.disk_blocks() == 3
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 16, 32, generator=g))
    with torch.inference_mode():
        want = reference(*args, return_dict=False)[0]
        for _ in range(2):
            assert torch.equal(model(*args, return_dict=False)[0], want)
    # Saved again while offloaded, three blocks read back from the disk tier: the same weights.
    model.save_pretrained(tmp_path / "again")
    saved, expected = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "again").state_dict(), reference.state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    gc.collect()
    gc.disable()
    try:
        refs = [weakref.ref(model), weakref.ref(group)]
        del model, group
        assert [ref() is None for ref in refs] == [True, True]
    finally:
        gc.enable()
