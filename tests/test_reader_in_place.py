"""Reads that land in place: a job whose layout mirrors the file is read with O_DIRECT straight into its
destination (no bounce buffer, no copy), and only where the caller lets the reads overwrite the bytes
around the ranges. Every other job lands exactly its ranges' bytes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastoffload_ext import enable_layerwise_offload
from fastoffload_ext._backend import require_ext
from fastoffload_ext.planning.tiers import PLACE_SLACK, PLACED_MIN_BYTES, region_bytes
from fastoffload_ext.storage import DiskOptions, plan_tiers
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single

PAGE = 4096
SENTINEL = 0xAB


def _file(tmp_path: Path, nbytes: int = 3 * (1 << 20) + 123) -> tuple[Path, torch.Tensor]:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


def _aligned(nbytes: int, shift: int = 0) -> torch.Tensor:
    """A sentinel-filled uint8 tensor of ``nbytes`` whose first byte lies ``shift`` bytes past a page."""
    backing = torch.full((nbytes + 2 * PAGE,), SENTINEL, dtype=torch.uint8)
    start = (-backing.data_ptr()) % PAGE + shift
    return backing[start:start + nbytes]


def _reader(path: Path):
    reader = require_ext().DiskReader(2, 1 << 20, "auto")
    return reader, reader.open(str(path))


def test_a_mirrored_job_into_scratch_is_read_in_place(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    reader, f = _reader(path)
    # Two ranges, 8 KiB apart in the file and in the destination (one distance), at a page offset.
    spans = [(f, PAGE, 1 << 20, 0), (f, PAGE + (1 << 20) + 8192, 1 << 20, (1 << 20) + 8192)]
    dest = _aligned(3 << 20)
    reader.read(spans, dest, scratch=True)
    for offset, n, at in [(s[1], s[2], s[3]) for s in spans]:
        assert torch.equal(dest[at:at + n], data[offset:offset + n])
    stats = reader.stats()
    if reader.direct(f):
        assert stats["in_place_bytes"] == 2 << 20 and stats["bounce_bytes"] == 0  # no bounce buffer was touched
    else:  # a file system without O_DIRECT: buffered reads land exactly
        assert stats["in_place_bytes"] == 0


def test_the_file_end_lands_in_place_when_the_tail_page_fits(tmp_path: Path) -> None:
    path, data = _file(tmp_path)
    reader, f = _reader(path)
    start = (len(data) - 5000) // PAGE * PAGE
    n = len(data) - start  # the file's last bytes: the read's tail page runs past the end of the file
    dest = _aligned(n + PAGE)
    reader.read([(f, start, n, 0)], dest, scratch=True)
    assert torch.equal(dest[:n], data[start:])
    assert reader.stats()["in_place_bytes"] == (n if reader.direct(f) else 0)


@pytest.mark.parametrize("case", ["not scratch", "distance off the page", "tail outside", "two distances"])
def test_other_jobs_land_exactly_their_ranges(tmp_path: Path, case: str) -> None:
    path, data = _file(tmp_path)
    reader, f = _reader(path)
    offset, n = PAGE + 100, (1 << 20) + 7  # neither end on a page
    spans = [(f, offset, n, PAGE + 100)]
    size = n + 3 * PAGE + 6000
    dest = _aligned(size, shift=8 if case == "distance off the page" else 0)
    if case == "tail outside":
        size = PAGE + 100 + n  # the range ends at the destination's end: its tail page would not fit
        dest = dest[:size]
    if case == "two distances":
        spans.append((f, offset + n + 1000, 5000, PAGE + 100 + n + 8))
    reader.read(spans, dest, scratch=case != "not scratch")
    assert reader.stats()["in_place_bytes"] == 0
    written = torch.zeros(len(dest), dtype=torch.bool)
    for _, o, k, at in spans:
        assert torch.equal(dest[at:at + k], data[o:o + k])
        written[at:at + k] = True
    assert bool((dest[~written] == SENTINEL).all())  # not one byte outside the ranges was touched


def test_the_disk_tier_reads_its_blocks_in_place_bit_exact(tmp_path: Path) -> None:
    # d=128 bf16: every tensor a multiple of 256 bytes, so the packed layout (in the file's order, not the
    # parameters' own) mirrors the file; the block's parameters are declared out of that order.
    reference = reference_stack(6, d=128)
    path = write_single(reference, tmp_path / "model.safetensors")
    budget = 6 * block_bytes(reference) // 2 + 4096 + 3 * (1 << 14)
    model = meta_stack(6, d=128)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget,
                                     disk_options=DiskOptions(staging_buffers=2))
    assert any(state.on_disk for state in group.states)
    x = inputs(d=128)
    reader = group.engine.reader
    before = reader.stats()
    with torch.no_grad():
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)
    after = reader.stats()
    read = after["bytes_read"] - before["bytes_read"]
    assert read > 0
    file = reader.open(str(path))
    assert after["in_place_bytes"] - before["in_place_bytes"] == (read if reader.direct(file) else 0)


def test_a_large_host_tier_block_is_read_in_place_at_enable(tmp_path: Path) -> None:
    # d=512 bf16: 6 MiB blocks, above PLACED_MIN_BYTES, so each region is placed at its file offsets'
    # page alignment and read in place; the host budget counts the region's slack.
    reference = reference_stack(3, d=512)
    path = write_single(reference, tmp_path / "model.safetensors")
    size = block_bytes(reference)
    assert size >= PLACED_MIN_BYTES and region_bytes(size) == size + PLACE_SLACK
    model = meta_stack(3, d=512)
    group = enable_layerwise_offload(model, device="cpu", weights=path)
    stats = group.engine.reader.stats()
    file = group.engine.reader.open(str(path))
    assert stats["in_place_bytes"] == (3 * size if group.engine.reader.direct(file) else 0)
    x = inputs(d=512)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert plan_tiers([size] * 3, None, 2).host_bytes == 3 * (size + PLACE_SLACK)
    assert plan_tiers([size // 4] * 3, None, 2).host_bytes == 3 * (size // 4)  # small blocks: exact regions
