"""The planner with a disk tier: the blocks beyond the host budget are read every step, and the
simulation, the plan and a re-plan account for it (CPU; pure tables, and a checkpoint on the host)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload, get_offload_group
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning import plan_offload, simulate_step
from fastoffload_ext.planning.costs import BlockCosts, DiskCosts
from fastoffload_ext.planning.tiers import PLACE_SLACK as P
from fastoffload_ext.planning.tiers import STAGING_SLACK as S
from fastoffload_ext.planning.tiers import plan_tiers
from tests._checkpoints import block_bytes, inputs, meta_stack, record_reads, reference_stack, write_single

B = 100_000_000


def _table(compute: list[float], disk: DiskCosts | None, h2d: float = 25.0) -> BlockCosts:
    return BlockCosts(compute_ms=compute, block_bytes=[B] * len(compute), h2d_gbps=h2d, disk=disk)


def test_the_disk_blocks_are_where_the_build_puts_them() -> None:
    disk = DiskCosts(read_gbps=1.5, host_budget=4 * B + 3 * S + P, staging_buffers=3)
    costs = _table([2.6] * 8, disk)
    # host budget 4 blocks, 3 of them the staging ring: one block keeps a host copy (each with its slack)
    tiers = plan_tiers([B] * 8, 4 * B + 3 * S + P, 3)
    assert costs.disk_blocks([]) == tiers.disk == (0, 1, 2, 3, 5, 6, 7)
    # resident blocks leave the offloaded list; the tiers are placed over what is left
    remaining = plan_tiers([B] * 6, 4 * B + 3 * S + P, 3).disk
    assert costs.disk_blocks([0, 4]) == tuple([1, 2, 3, 5, 6, 7][p] for p in remaining)
    assert costs.disk_ms([]) == pytest.approx(7 * B / 1.5e6)


def test_a_disk_bound_step_is_the_reads() -> None:
    costs = _table([2.6] * 8, DiskCosts(read_gbps=1.5, host_budget=4 * B + 3 * S + P, staging_buffers=3), h2d=55.0)
    timeline = simulate_step(costs, [], 1)
    assert timeline.step_ms == pytest.approx(7 * B / 1.5e6)
    assert (timeline.disk_reads, timeline.read_bytes) == (7, 7 * B)


def test_a_disk_tier_that_holds_nothing_predicts_as_without_one() -> None:
    compute = [3.0, 0.5, 4.0, 1.0, 2.0, 0.2]
    plain = _table(compute, None)
    roomy = _table(compute, DiskCosts(read_gbps=0.1, host_budget=10 * B))
    assert roomy.disk_blocks([]) == ()
    for resident, depth in (((), 1), ((2,), 2), ((0, 3), 1)):
        assert simulate_step(roomy, resident, depth) == simulate_step(plain, resident, depth)


def test_one_staging_buffer_serialises_each_read_with_the_copy_out_of_it() -> None:
    # Four disk blocks between compute-heavy host blocks; the disk sets the step.
    compute = [60.0, 1.0] * 4
    steps = {}
    for buffers in (1, 2, 3):
        disk = DiskCosts(read_gbps=1.0, host_budget=buffers * (B + S) + 4 * (B + P), staging_buffers=buffers)
        costs = _table(compute, disk)
        assert costs.disk_blocks([]) == (0, 2, 4, 6)
        steps[buffers] = simulate_step(costs, [], 1, steps=6).step_ms
    copy = B / 25e6
    assert steps[1] == pytest.approx(4 * (100.0 + copy))  # read, then the copy, then the next read
    assert steps[2] == steps[3] == pytest.approx(400.0)   # the next read runs while the copy does
    # reads fast enough hide behind compute: the step is the compute and its exposed copies
    fast = _table(compute, DiskCosts(read_gbps=50.0, host_budget=6 * B + 2 * S + 4 * P, staging_buffers=2))
    assert simulate_step(fast, [], 1).step_ms == pytest.approx(simulate_step(_table(compute, None), [], 1).step_ms)


def test_the_planner_keeps_a_block_resident_rather_than_prefetching_deeper() -> None:
    compute = [8.0, 0.2] * 4  # without a disk, depth 2 lets the short windows borrow from the long ones
    without = plan_offload(_table(compute, None), 3 * B)
    assert (without.resident, without.prefetch_depth) == ((), 2)
    disk = DiskCosts(read_gbps=2.0, host_budget=3 * B + 2 * S + P, staging_buffers=2)
    plan = plan_offload(_table(compute, disk), 3 * B)
    # one slot fewer is one block resident, so one read less per step
    assert len(plan.resident) == 1 and plan.prefetch_depth == 1
    assert plan.disk_blocks == 6 and plan.disk_ms == pytest.approx(6 * B / 2e6)
    assert plan.disk_bound and plan.ideal_ms == pytest.approx(plan.disk_ms)
    assert plan.predicted_step_ms == pytest.approx(plan.disk_ms)
    assert "disk-bound: 6 offloaded blocks beyond host_budget" in plan.why
    assert plan.as_dict()["disk_blocks"] == 6 and plan.as_dict()["disk_bound"] is True
    assert "disk: 6 offloaded blocks read every step" in plan.explain()


def test_a_host_budget_below_the_staging_ring_is_refused_with_its_numbers() -> None:
    costs = _table([1.0] * 6, DiskCosts(read_gbps=1.0, host_budget=B, staging_buffers=2))
    with pytest.raises(OffloadConfigError, match="cannot hold even the disk tier's staging ring"):
        plan_offload(costs, 4 * B)


@pytest.mark.parametrize("field, value", [("read_gbps", 0.0), ("host_budget", -1), ("staging_buffers", 0),
                                          ("host_budget", 1.5), ("staging_buffers", True)])
def test_bad_disk_costs_are_refused(field: str, value: object) -> None:
    arguments = {"read_gbps": 1.0, "host_budget": B, "staging_buffers": 2, field: value}
    with pytest.raises(OffloadConfigError, match=f"fastoffload: DiskCosts {field}"):
        DiskCosts(**arguments)  # type: ignore[arg-type]


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, Path, int]:
    import fastoffload_ext.planning.replan as replan
    monkeypatch.setattr(replan, "MIN_MEASURED_READ_BYTES", 1 << 20)  # the test's host tier is a few MiB
    reference = reference_stack(8, d=256)
    return reference, write_single(reference, tmp_path / "model.safetensors"), block_bytes(reference)


def _enable(path: Path, size: int) -> tuple[torch.nn.Module, object]:
    model = meta_stack(8, d=256)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * size + 4096 + 2 * S,
                                     device_budget=5 * size)
    return model, group


def test_enable_from_a_checkpoint_predicts_the_disk_tier_it_built(checkpoint) -> None:
    reference, path, size = checkpoint
    model, group = _enable(path, size)
    plan = group.plan
    on_disk = tuple(i for i, s in zip(group.offloaded_indices, group.states) if s.on_disk)
    assert on_disk and plan.costs.disk is not None
    assert plan.costs.disk_blocks(plan.resident) == on_disk and plan.disk_blocks == len(on_disk)
    assert plan.costs.disk.host_budget == 4 * size + 4096 + 2 * S and plan.disk_ms > 0
    assert "read from disk every step" in plan.why
    x = inputs(d=256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_new_layout_for_a_disk_tier_is_refused_before_anything_changes(checkpoint) -> None:
    reference, path, size = checkpoint
    model, group = _enable(path, size)
    old = group.plan
    # A table under which depth 2 beats the resident blocks (copies slow, reads free): a new layout.
    table = BlockCosts(compute_ms=[8.0, 0.2] * 4, block_bytes=old.costs.block_bytes, h2d_gbps=0.5,
                       disk=DiskCosts(read_gbps=1e6, host_budget=old.costs.disk.host_budget))
    assert not plan_offload(table, old.device_budget).same_layout(old)
    with pytest.raises(OffloadStateError, match="streams 3 blocks from disk .* Nothing was changed"):
        group.replan(table)
    assert get_offload_group(model) is group and group.plan is old
    x = inputs(d=256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        # a calibration's own re-plan keeps the layout and scores it again
        group.calibrate(lambda: model(x))
        assert get_offload_group(model) is group and group.plan.resident == old.resident
        assert group.plan.calibrated and group.plan.costs.disk == old.costs.disk
        assert torch.equal(model(x), reference(x))
    # the way the message gives: back to the meta device, and enable again with the plan
    new = plan_offload(table, old.device_budget)
    disable_layerwise_offload(model, "meta")
    fresh = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * size + 4096 + 2 * S, plan=new)
    assert fresh.resident == new.resident
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_the_plan_made_at_enable_counts_the_disk_tier_from_a_probe(checkpoint, monkeypatch) -> None:
    import fastoffload_ext.storage.disk_costs as disk_costs
    reference, path, size = checkpoint
    calls = []
    real = disk_costs.probe_read_gbps

    def probe(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(disk_costs, "probe_read_gbps", probe)
    monkeypatch.setattr(disk_costs, "_PROBE_CACHE", {})
    monkeypatch.setattr(disk_costs, "PROBE_BYTES", 2 * size)
    plans = []
    import fastoffload_ext.planning.layout as layout
    real_plan = layout.plan_offload

    def recording(costs, *args, **kwargs):
        plans.append(costs)
        return real_plan(costs, *args, **kwargs)
    monkeypatch.setattr(layout, "plan_offload", recording)
    model, group = _enable(path, size)
    assert len(calls) == 1 and plans and plans[0].disk is not None
    assert plans[0].disk.host_budget == 4 * size + 4096 + 2 * S and plans[0].disk.read_gbps > 0
    x = inputs(d=256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    disable_layerwise_offload(model, "meta")
    # The rate is kept per file system; no plan, or blocks that fit, read nothing.
    _enable(path, size)
    fits = enable_layerwise_offload(meta_stack(8, d=256), device="cpu", weights=path, host_budget=None,
                                    device_budget=5 * size)
    unplanned = enable_layerwise_offload(meta_stack(8, d=256), device="cpu", weights=path,
                                         host_budget=4 * size + 4096 + 2 * S)
    assert len(calls) == 2 and fits.plan.costs.disk is None and unplanned.plan is None


def test_the_probe_reads_block_tensors_once_and_keeps_the_rate(checkpoint, monkeypatch) -> None:
    import fastoffload_ext.storage.disk_costs as disk_costs
    from fastoffload_ext.storage import DiskOptions, open_checkpoint
    _, path, size = checkpoint
    monkeypatch.setattr(disk_costs, "_PROBE_CACHE", {})
    monkeypatch.setattr(disk_costs, "PROBE_BYTES", size)
    checkpoint_ = open_checkpoint(path)
    entries = [e for name, e in sorted(checkpoint_.entries.items()) if name.startswith("blocks.")]
    gbps = disk_costs.probe_read_gbps(checkpoint_, entries, DiskOptions())
    assert gbps > 0 and list(disk_costs._PROBE_CACHE.values()) == [gbps]
    assert disk_costs.probe_read_gbps(checkpoint_, entries[:1], DiskOptions()) == gbps  # same file system


def test_the_probe_reads_at_most_its_size_of_a_large_tensor(checkpoint, monkeypatch) -> None:
    import fastoffload_ext.storage.disk_costs as disk_costs
    from fastoffload_ext.storage import DiskOptions, open_checkpoint
    _, path, size = checkpoint
    monkeypatch.setattr(disk_costs, "_PROBE_CACHE", {})
    monkeypatch.setattr(disk_costs, "PROBE_BYTES", 8192)
    reads = record_reads(monkeypatch)
    checkpoint_ = open_checkpoint(path)
    big = max((e for e in checkpoint_.entries.values() if e.name.startswith("blocks.")), key=lambda e: e.nbytes)
    assert big.nbytes > 3 * 8192
    assert disk_costs.probe_read_gbps(checkpoint_, [big], DiskOptions()) > 0
    assert len(reads) == 1 and reads[0][1] <= 8192 + 4096
