"""Budget strings and the host/device memory probes (cgroup v2 and MemAvailable)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import format_bytes, parse_size
from fastoffload_ext.planning import memory


@pytest.mark.parametrize("text, expected", [
    (None, None), (0, 0), (123, 123), (2.0, 2), ("auto", "auto"), (" AUTO ", "auto"), ("1024", 1024),
    ("20GiB", 20 * 1024**3), ("20 GiB", 20 * 1024**3), ("20g", 20 * 1024**3), ("1.5GB", 1_500_000_000),
    ("512MB", 512_000_000), ("512MiB", 512 * 1024**2), ("64k", 65536), ("2TiB", 2 * 1024**4), ("10b", 10),
    (".5GiB", 512 * 1024**2), ("8.2GB", 8_200_000_000), ("4.35 GB", 4_350_000_000), ("0.3GiB", 322122547),
    ("9007199254740993", 2**53 + 1), ("2.0", 2),
])
def test_parse_size_accepts(text: object, expected: object) -> None:
    assert parse_size(text, "device_budget") == expected


SHAPE = ("fastoffload: device_budget must be None, a number of bytes, or a size such as '20GiB' or '512MB', or "
         "'auto'; got {!r}")
NEGATIVE = "fastoffload: device_budget must not be negative, got {!r}; pass a size such as '20GiB', or None for no limit"


@pytest.mark.parametrize("value, template", [
    ("banana", SHAPE), ("20 GiBs", SHAPE), ("GiB", SHAPE), ("", SHAPE), (True, SHAPE), (2.5, SHAPE),
    (float("inf"), SHAPE), ([1], SHAPE), (-1, NEGATIVE), ("-3GiB", NEGATIVE), (-4.0, NEGATIVE), ("2.5", SHAPE),
    ("1.5 B", SHAPE),
])
def test_parse_size_refuses(value: object, template: str) -> None:
    with pytest.raises(OffloadConfigError) as raised:
        parse_size(value, "device_budget")
    assert str(raised.value) == template.format(value)


def test_parse_size_takes_numpy_numbers() -> None:
    np = pytest.importorskip("numpy")
    sizes = [parse_size(v, "device_budget") for v in (np.int64(3 * 1024**3), np.uint32(512), np.float32(1024.0))]
    assert sizes == [3 * 1024**3, 512, 1024] and all(type(size) is int for size in sizes)
    with pytest.raises(OffloadConfigError) as raised:
        parse_size(np.int64(-1), "device_budget")
    assert str(raised.value) == NEGATIVE.format(np.int64(-1))


def test_auto_where_it_is_not_accepted() -> None:
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: activation_reserve must be None, a number of bytes, or a size such as '20GiB' or '512MB'; "
            "got 'auto'")):
        parse_size("auto", "activation_reserve", allow_auto=False)


def test_format_bytes() -> None:
    assert [format_bytes(v) for v in (None, 512, 2048, 3 * 1024**2, int(3.38 * 1024**3))] == [
        "no limit", "512 B", "2.0 KiB", "3.0 MiB", "3.38 GiB"]


def _cgroup(root: Path, path: str, limit: str, current: str) -> Path:
    directory = root / path
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(limit + "\n")
    (directory / "memory.current").write_text(current + "\n")
    return directory


def test_cgroup_headroom_takes_the_tightest_limit_up_the_tree(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroup(tmp_path, "", "max", "0")
    _cgroup(tmp_path, "pod", str(8 * 1024**3), str(5 * 1024**3))
    leaf = _cgroup(tmp_path, "pod/app", str(16 * 1024**3), str(1024**3))
    monkeypatch.setattr(memory, "_own_cgroup_dir", lambda root: str(leaf))
    headroom, where = memory.cgroup_headroom(str(tmp_path))
    assert headroom == 3 * 1024**3 and where == str(tmp_path / "pod")


def test_no_readable_cgroup_falls_back_to_mem_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_own_cgroup_dir", lambda root: None)
    host = memory.probe_host(str(tmp_path / "missing"))
    assert host.cgroup_headroom is None and host.mem_available > 0
    assert host.usable == max(0, host.mem_available - host.margin)
    assert "no cgroup v2 limit readable" in host.describe()


def test_a_cgroup_below_mem_available_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leaf = _cgroup(tmp_path, "job", str(4 * 1024**3), str(1024**3))
    monkeypatch.setattr(memory, "_own_cgroup_dir", lambda root: str(leaf))
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("VM", (), {"available": 64 * 1024**3})())
    host = memory.probe_host(str(tmp_path))
    assert host.cgroup_headroom == 3 * 1024**3
    assert host.margin == memory.HOST_MARGIN_MIN_BYTES
    assert host.usable == 3 * 1024**3 - memory.HOST_MARGIN_MIN_BYTES


def test_own_cgroup_dir_reads_proc_self_cgroup(tmp_path: Path) -> None:
    found = memory._own_cgroup_dir(str(tmp_path))
    assert found is None or os.path.isdir(found)


def test_host_as_device_free_memory_is_the_host_probe() -> None:
    assert memory.device_free_bytes(torch.device("cpu")) > 0


@pytest.mark.cuda
def test_cuda_free_memory_counts_the_allocator_cache() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    before = memory.device_free_bytes(device)
    block = torch.empty(256 * 1024**2, dtype=torch.uint8, device=device)
    del block  # cached by torch's allocator, still usable by this process
    assert abs(memory.device_free_bytes(device) - before) < 64 * 1024**2


def test_default_host_budget_refusal_names_what_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastoffload_ext as fo
    from fastoffload_ext.planning import layout

    from ._models import make_pair

    model, _ = make_pair(3)
    small = memory.HostMemory(mem_available=1024, cgroup_headroom=None, cgroup_path=None, margin=0)
    monkeypatch.setattr(layout, "probe_host", lambda: small)
    # The blocks' own host bytes would count as free (packing frees them block by block): leave them out.
    monkeypatch.setattr(layout, "_host_credit", lambda blocks: 0)
    with pytest.raises(OffloadConfigError) as raised:
        fo.enable_layerwise_offload(model, device="cpu")
    assert str(raised.value) == (
        "fastoffload: the offloaded blocks need 42.0 KiB of host memory, more than the host memory this process may "
        "use (1.0 KiB); keep more blocks resident (resident_blocks, or a device_budget), free host memory, or raise "
        "host_budget")
    assert fo.get_offload_group(model) is None
    # host_budget=None skips the check.
    group = fo.enable_layerwise_offload(model, device="cpu", host_budget=None)
    assert group is not None
    fo.disable_layerwise_offload(model)


def test_calibration_refusals() -> None:
    from torch import nn

    from fastoffload_ext.planning.calibration import measure_blocks

    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: calibration needs 1 <= repeats <= max_repeats, got repeats=0, max_repeats=15")):
        measure_blocks(blocks, lambda: None, torch.device("cpu"), repeats=0)
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: calibration step never ran block 1; the step must run one full forward of the offloaded "
            "model")):
        measure_blocks(blocks, lambda: blocks[0](torch.ones(2)), torch.device("cpu"), repeats=1, warmup=0)
    # The timing hooks are gone again after a refusal.
    from fastoffload_ext.engine.hooks import ModuleHookManager
    assert all(ModuleHookManager.get_from(block) is None for block in blocks)
