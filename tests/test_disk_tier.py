"""The disk tier: blocks beyond host_budget read every step through pinned staging, bit-exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.tiers import STAGING_SLACK
from fastoffload_ext.storage import DiskOptions, plan_tiers
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import OFFLOAD_DEVICES, params_equal


def test_plan_keeps_everything_in_host_memory_when_it_fits() -> None:
    plan = plan_tiers([100] * 4, 400, 2)
    assert plan.host == (0, 1, 2, 3) and plan.disk == () and plan.staging_bytes == 0
    assert plan_tiers([100] * 4, None, 2).disk == ()


def test_plan_spreads_the_disk_blocks_and_stays_under_budget() -> None:
    b = 100_000
    staging = 2 * (b + STAGING_SLACK)  # each buffer: the largest block and the slack that places it in place
    plan = plan_tiers([b] * 8, 4 * b + staging, 2)  # 2 staging + 4 host blocks
    assert len(plan.host) == 4 and len(plan.disk) == 4
    assert plan.host == (1, 3, 5, 7) and plan.disk == (0, 2, 4, 6)
    assert plan.host_bytes == 4 * b + staging and plan.staging_buffers == 2 and plan.staging_bytes == staging
    for budget in range(staging, staging + 9 * b, b // 2):
        assert plan_tiers([b] * 8, budget, 2).host_bytes <= budget
    # one staging buffer of the largest block, nothing else fits
    assert plan_tiers([b, 3 * b, b], 3 * b + STAGING_SLACK, 1).disk == (0, 1, 2)


def test_plan_refuses_a_budget_below_the_staging_ring() -> None:
    each = 100 + STAGING_SLACK
    with pytest.raises(OffloadConfigError, match="host_budget=150 bytes cannot hold even the disk tier's staging ring "
                                                 f"\\(2 buffer\\(s\\) of the largest block, {each} bytes each = "
                                                 f"{2 * each}\\)"):
        plan_tiers([100] * 4, 150, 2)


def _twice_the_budget(tmp_path: Path, n_blocks: int = 8):
    reference = reference_stack(n_blocks)
    path = write_single(reference, tmp_path / "model.safetensors")
    total = n_blocks * block_bytes(reference)
    return reference, path, total // 2 + 4096 + 3 * STAGING_SLACK


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth,staging,cyclic", [(1, 1, True), (1, 2, True), (2, 3, True), (3, 2, False)])
def test_model_twice_the_host_budget_is_bit_exact(tmp_path: Path, device: str, depth: int, staging: int,
                                                  cyclic: bool) -> None:
    reference, path, budget = _twice_the_budget(tmp_path)
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device=device, weights=path, host_budget=budget, prefetch_depth=depth,
                                     cyclic=cyclic, disk_options=DiskOptions(staging_buffers=staging))
    disk = [s for s in group.states if s.on_disk]
    assert len(disk) >= 4  # at least half the model stays on disk
    stats = group.engine.pool.stats()
    assert stats["in_use_bytes"] <= budget  # host tier + staging, nothing more pinned
    if device != "cpu":  # the staging ring was pinned beside the host tier's reads, and finished with them
        assert stats["pinned_bytes"] >= stats["in_use_bytes"] > 0
    x = inputs().to(device)
    reference = reference.to(device)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(4):
            assert torch.equal(model(x), expected)
    disk_stats = group.engine.disk_stats()
    assert disk_stats["reads"] >= 4 * len(disk) and disk_stats["staging_count"] == min(staging, len(disk))
    # In forward order every read but the on-demand ones was handed to the tier's thread, which
    # submitted it once the copy out of its buffer was done.
    assert disk_stats["out_of_order"] == 0 and disk_stats["handoffs"] >= disk_stats["reads"]
    assert 0 <= disk_stats["idle_in_waits_seconds"] <= disk_stats["wait_seconds"]
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


def test_blocks_run_out_of_order(tmp_path: Path) -> None:
    reference, path, budget = _twice_the_budget(tmp_path)
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    x = inputs()
    with torch.no_grad():
        for i in (5, 0, 6, 6, 2, 7, 1):
            assert torch.equal(model.blocks[i](x), reference.blocks[i](x))
        assert torch.equal(model(x), reference(x))
    assert group.engine.disk_stats()["out_of_order"] > 0


def test_disk_tier_through_the_page_cache(tmp_path: Path) -> None:
    reference, path, budget = _twice_the_budget(tmp_path)
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget,
                                     disk_options=DiskOptions(read_mode="buffered", read_threads=1, chunk_bytes=4096))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(inputs()), reference(inputs()))
    assert group.engine.reader.stats()["direct_bytes"] == 0


def test_disk_blocks_report_no_host_bytes(tmp_path: Path) -> None:
    reference, path, budget = _twice_the_budget(tmp_path)
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    for state in group.states:
        assert (state.host_bytes() == 0) == state.on_disk
        assert state.weight_bytes() == block_bytes(reference)
    # The seed's dict of host tensors still works for a disk block: read from the file on demand.
    disk = next(s for s in group.states if s.on_disk)
    index = group.states.index(disk)
    for name, tensor in disk.cpu_named_parameters.items():
        assert torch.equal(tensor, reference.blocks[index].get_parameter(name))


def _host_memory(usable: int):
    from fastoffload_ext.planning import memory
    return memory.HostMemory(mem_available=usable, cgroup_headroom=None, cgroup_path=None, margin=0)


def _outside_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))


def test_auto_host_budget_keeps_what_does_not_fit_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning import memory
    reference, path, half = _twice_the_budget(tmp_path)
    # On the host device the weights outside the blocks land in host memory too: "auto" leaves them room.
    usable = half + _outside_bytes(reference)
    monkeypatch.setattr(memory, "probe_host", lambda: _host_memory(usable))
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path)  # host_budget="auto", the default
    disk = [s for s in group.states if s.on_disk]
    assert len(disk) >= 4
    assert group.engine.pool.stats()["in_use_bytes"] <= half
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


def test_auto_host_budget_with_room_keeps_every_block_in_host_memory(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning import memory
    reference, path, half = _twice_the_budget(tmp_path)
    monkeypatch.setattr(memory, "probe_host", lambda: _host_memory(4 * half + _outside_bytes(reference)))
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path)
    assert not any(s.on_disk for s in group.states)
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))


def test_auto_host_budget_below_the_staging_ring_names_the_measured_memory(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning import memory
    reference, path, _ = _twice_the_budget(tmp_path)
    monkeypatch.setattr(memory, "probe_host", lambda: _host_memory(1000 + _outside_bytes(reference)))
    model = meta_stack(8)
    with pytest.raises(OffloadConfigError, match="fastoffload: the host memory this process may use \\(1000 B: "
                                                 "MemAvailable .* B, no cgroup v2 limit readable, margin 0 B, less "
                                                 ".* for the weights kept on the host\\) cannot hold even the disk "
                                                 "tier's staging ring .*raise host_budget \\(or free host memory\\)"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    assert all(p.is_meta for p in model.parameters())


def test_host_budget_none_keeps_every_block_in_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning import memory
    reference, path, _ = _twice_the_budget(tmp_path)
    monkeypatch.setattr(memory, "probe_host", lambda: _host_memory(0))  # not consulted
    model = meta_stack(8)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=None)
    assert not any(s.on_disk for s in group.states)
