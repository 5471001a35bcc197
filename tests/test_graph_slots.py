"""A CUDA graph's fixed slots against the plan and the device budget (docs/DESIGN.md, "CUDA-graph capture").

``cyclic_slot_assignment`` can need more slots than the ``prefetch_depth + 1`` that the planner and enable
count (5 offloaded blocks at depth 1 take 3). Under a device budget that the extra slots would pass, the
capture is refused before anything changes (``check_graph_slots``, what ``OffloadedCUDAGraph`` runs before it
fixes the slots); ``plan_offload(..., cuda_graph=True)`` plans for them; without a budget the graph takes
them and ``group.stats()`` says so. Real groups on the host-as-device engine (CI), one capture on a GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine.graphs import OffloadedCUDAGraph, check_graph_slots, cyclic_slot_assignment
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, format_bytes, module_packed_bytes, plan_offload
from fastoffload_ext.planning.slots import cyclic_slot_count

from ._models import Block, make_pair, params_equal, place_outside_blocks

BLOCK_BYTES = module_packed_bytes(Block(16, 2))  # 14.0 KiB


def _setup(n: int, device: str = "cpu"):
    model, reference = make_pair(n)
    model.requires_grad_(False)
    reference.requires_grad_(False).to(device)
    place_outside_blocks(model, device)
    return model, reference, torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(device)


def _run_exactly(model, reference, x, steps: int = 3) -> None:
    with torch.inference_mode():
        want = reference(x)
        for _ in range(steps):
            assert torch.equal(model(x), want)


def _graph_slots(group) -> tuple[list[int], int]:
    return cyclic_slot_assignment(len(group.states), group.prefetch_depth)


def _fix_slots(group) -> int:
    """What OffloadedCUDAGraph does before it captures (the capture itself needs CUDA): check, then fix."""
    assignment, num_slots = _graph_slots(group)
    check_graph_slots(group, num_slots)
    group.engine.set_slot_assignment(assignment, num_slots)
    return num_slots


def _held_bytes(group, model) -> int:
    """Device bytes the engine's slots and the resident blocks hold now."""
    stats = group.stats()
    return stats["num_slots"] * stats["slot_bytes"] + sum(module_packed_bytes(model.blocks[i]) for i in group.resident)


def _finish(model, reference) -> None:
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


# The planner and the assignment, on tables alone.

@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 4, 5, 6, 7, 9, 12])
def test_graph_slots_against_the_plan(n_blocks: int, depth: int) -> None:
    costs = BlockCosts([0.1] * n_blocks, [1000] * n_blocks, 1.0)
    plan = plan_offload(costs, resident=(), prefetch_depth=depth)
    run = plan.prefetch_depth  # clamped to the offloaded blocks
    assignment, graph = cyclic_slot_assignment(n_blocks, run)
    assert graph == cyclic_slot_count(n_blocks, run) and len(assignment) == n_blocks
    # An eager plan counts depth + 1 slots; the graph needs more exactly when depth + 1 does not divide
    # the offloaded blocks (and they are more than a window).
    assert plan.num_slots == run + 1 and plan.device_bytes == (run + 1) * 1000 and not plan.cuda_graph
    assert (graph > plan.num_slots) == (n_blocks > run + 1 and n_blocks % (run + 1) != 0)
    counted = plan_offload(costs, resident=(), prefetch_depth=depth, cuda_graph=True)
    assert counted.cuda_graph and counted.num_slots == max(run + 1, graph) >= graph
    assert counted.device_bytes == counted.num_slots * 1000
    # Only the memory differs: the step is predicted as eager offload runs it either way.
    assert counted.predicted_step_ms == plan.predicted_step_ms and counted.resident == plan.resident


def test_five_blocks_at_depth_one_take_three_slots() -> None:
    assert cyclic_slot_assignment(5, 1) == ([0, 1, 2, 0, 1], 3)
    assert [cyclic_slot_count(n, 1) for n in range(8)] == [0, 1, 2, 3, 2, 3, 2, 3]


def test_a_plan_that_counts_the_graph_slots_is_refused_where_they_do_not_fit() -> None:
    costs = BlockCosts([0.1] * 5, [1024] * 5, 1.0)
    # Eager offload fits two slots; the graph's three fit no layout of five blocks in two slots' room.
    assert plan_offload(costs, 2048).num_slots == 2
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: device_budget 2.0 KiB is smaller than what offload needs at least: 3 slots (with a CUDA "
            "graph's fixed slots) x 1.0 KiB (the largest block) + 0 B activation reserve = 3.0 KiB.")):
        plan_offload(costs, 2048, cuda_graph=True)
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: device_budget 2.0 KiB is too small for 0 resident blocks (0 B) + 3 slots (with a CUDA "
            "graph's fixed slots) x 1.0 KiB + 0 B activation reserve = 3.0 KiB;")):
        plan_offload(costs, 2048, resident=(), prefetch_depth=1, cuda_graph=True)
    plan = plan_offload(costs, 3072, cuda_graph=True)
    offloaded = len(plan.offloaded)
    assert plan.num_slots >= cyclic_slot_count(offloaded, plan.prefetch_depth) and plan.device_bytes <= 3072
    assert plan.as_dict()["cuda_graph"] is True and "counting a CUDA graph's fixed slots" in plan.explain()
    with pytest.raises(OffloadConfigError, match="plan_offload's cuda_graph must be True or False, got 'yes'"):
        plan_offload(costs, 3072, cuda_graph="yes")  # type: ignore[arg-type]


# Real groups on the host-as-device engine.

def test_a_capture_beyond_the_device_budget_is_refused_before_anything_changes() -> None:
    model, reference, x = _setup(6)
    budget = 3 * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", device_budget=budget)
    # One block resident, five offloaded at depth 1: the plan counts 2 slots, the graph needs 3.
    assert group.plan.resident == (0,) and group.prefetch_depth == 1 and group.plan.num_slots == 2
    assert group.plan.device_bytes == budget
    _, num_slots = _graph_slots(group)
    assert num_slots == 3
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: OffloadedCUDAGraph needs 3 fixed device slots for the 5 offloaded blocks at prefetch_depth 1 "
            "(any 2 blocks in a row must use different slots, and 2 does not divide 5), 1 more than the 2 the plan "
            "counts: 42.0 KiB + 1 x 14.0 KiB = 56.0 KiB, above device_budget 42.0 KiB. Nothing was changed. Plan for "
            "the capture: enable with plan=plan_offload(costs, device_budget, cuda_graph=True), whose slots and device "
            "bytes count the graph's (costs: group.plan.costs, or group.costs after group.calibrate(step)); or keep "
            "this layout with a device_budget of at least 56.0 KiB (plan=group.plan); or enable with a prefetch_depth "
            "or resident set that leaves a multiple of prefetch_depth + 1 blocks offloaded")):
        _fix_slots(group)
    assert group.engine.num_slots == 2 and group.stats()["num_slots"] == 2
    _run_exactly(model, reference, x)
    assert _held_bytes(group, model) <= budget
    _finish(model, reference)


def test_a_plan_that_counts_the_graph_slots_captures_within_the_budget() -> None:
    model, reference, x = _setup(6)
    budget = 3 * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", device_budget=budget)
    costs = group.plan.costs
    fo.disable_layerwise_offload(model)
    plan = plan_offload(costs, budget, cuda_graph=True)  # what the refusal advises
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, device_budget=budget)
    assert group.plan is plan and plan.device_bytes <= budget
    num_slots = _fix_slots(group)
    assert num_slots <= plan.num_slots and group.stats()["num_slots"] == num_slots
    assert group.stats()["plan"]["cuda_graph"] is True
    _run_exactly(model, reference, x)
    assert _held_bytes(group, model) <= budget
    _finish(model, reference)


def test_a_budget_with_room_for_the_extra_slot_captures() -> None:
    model, reference, x = _setup(6)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", device_budget=3 * BLOCK_BYTES)
    plan = group.plan
    fo.disable_layerwise_offload(model)
    # The refusal's other way out: the same layout, applied within the bytes the graph needs.
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, device_budget=4 * BLOCK_BYTES)
    assert _fix_slots(group) == 3 and group.stats()["num_slots"] == 3
    _run_exactly(model, reference, x)
    assert _held_bytes(group, model) <= 4 * BLOCK_BYTES
    fo.disable_layerwise_offload(model)
    # A fixed layout under a budget with a slot to spare: eager holds 1 + 2 blocks, the graph 1 + 3.
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", resident_blocks=[0], prefetch_depth=1,
                                        device_budget=4 * BLOCK_BYTES)
    assert group.plan.num_slots == 2 and _fix_slots(group) == 3
    _run_exactly(model, reference, x)
    assert _held_bytes(group, model) <= 4 * BLOCK_BYTES
    _finish(model, reference)


def test_a_plan_without_a_budget_is_held_to_the_budget_enable_applied_it_within() -> None:
    model, reference, x = _setup(6)
    plan = plan_offload(BlockCosts([0.1] * 6, [BLOCK_BYTES] * 6, 1.0), None, resident=[0], prefetch_depth=1)
    assert plan.device_budget is None and plan.device_bytes == 3 * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, device_budget=3 * BLOCK_BYTES)
    with pytest.raises(OffloadConfigError, match=r"1 more than the 2 the plan counts: .* above device_budget 42.0 KiB"):
        _fix_slots(group)
    assert group.engine.num_slots == 2
    fo.disable_layerwise_offload(model)
    # Applied without one, nothing bounds it: the graph takes its third slot, and the stats say so.
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan)
    assert _fix_slots(group) == 3 and group.stats()["num_slots"] == 3 > group.stats()["plan"]["num_slots"]
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_an_auto_budget_is_checked_as_enable_resolved_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning import layout

    free = 10 * BLOCK_BYTES // 3  # "auto": this much free, a tenth of it kept for activations
    monkeypatch.setattr(layout, "device_free_bytes", lambda device: free)
    # The blocks on the host count as already on the host-as-device: as if they were elsewhere.
    monkeypatch.setattr(layout, "module_device_bytes", lambda block, device: 0)
    model, reference, x = _setup(6)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", device_budget="auto")
    assert group.plan.device_budget == free and group.plan.resident == (0,) and group.plan.num_slots == 2
    with pytest.raises(OffloadConfigError, match=re.escape(f"above device_budget {format_bytes(free)}")):
        _fix_slots(group)
    assert group.engine.num_slots == 2
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("n_blocks, slots", [(1, 1), (2, 2), (3, 3), (4, 2), (5, 3), (7, 3)])
def test_without_a_budget_the_graph_takes_its_slots_and_reports_them(n_blocks: int, slots: int) -> None:
    model, reference, x = _setup(n_blocks)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    assert group.plan is None and group.stats()["num_slots"] == 2
    assert _fix_slots(group) == slots and group.stats()["num_slots"] == slots
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_a_replan_keeps_counting_the_graph_slots() -> None:
    model, reference, x = _setup(6)
    budget = 3 * BLOCK_BYTES
    plan = plan_offload(BlockCosts([0.0] * 6, [BLOCK_BYTES] * 6, 1.0, calibrated=False), budget, cuda_graph=True)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, device_budget=budget)
    # Measured costs: a transfer-bound table (the eager planner would keep a block resident and leave five).
    fresh = group.replan(BlockCosts([1.0, 0.1, 1.0, 0.1, 1.0, 0.1], [BLOCK_BYTES] * 6, 1e-3))
    assert fresh.plan.cuda_graph and fresh.plan.device_bytes <= budget
    _, num_slots = _graph_slots(fresh)
    assert num_slots <= fresh.plan.num_slots
    _fix_slots(fresh)
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_a_plan_scored_again_for_compressed_copies_keeps_counting_the_graph_slots() -> None:
    model, reference, x = _setup(5)
    plan = plan_offload(BlockCosts([0.1] * 5, [BLOCK_BYTES] * 5, 1.0), None, resident=(), prefetch_depth=1,
                        cuda_graph=True)
    assert plan.num_slots == 3
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, compress=True)
    # Scored again for coded copies (random weights barely compress: the sizes stay raw).
    assert group.plan is not plan and group.plan.cuda_graph and group.plan.num_slots == 3
    _run_exactly(model, reference, x)
    _finish(model, reference)


# On a GPU: the capture itself.

@pytest.mark.cuda
def test_cuda_a_capture_stays_within_the_budget_or_is_refused() -> None:
    model, reference, x = _setup(6, "cuda")
    reserve = 1 << 20
    budget = 3 * BLOCK_BYTES + reserve
    group = fo.enable_layerwise_offload(model, device="cuda", backend="ext", device_budget=budget,
                                        activation_reserve=reserve)
    assert len(group.states) == 5 and group.plan.num_slots == 2
    with pytest.raises(OffloadConfigError, match="OffloadedCUDAGraph needs 3 fixed device slots for the 5 offloaded"):
        OffloadedCUDAGraph(model, x)
    assert group.engine.num_slots == 2  # refused before the slots changed: eager offload runs on as it was
    _run_exactly(model, reference, x)
    costs = group.plan.costs
    fo.disable_layerwise_offload(model, device="cpu")
    plan = plan_offload(costs, budget, cuda_graph=True)
    group = fo.enable_layerwise_offload(model, device="cuda", backend="ext", plan=plan, device_budget=budget)
    graph = OffloadedCUDAGraph(model, x)
    assert graph.num_slots <= plan.num_slots and group.stats()["num_slots"] == graph.num_slots
    # What offload holds on the device (the slots and the resident blocks) within the budget less the reserve
    # (the allocator's peak would also count cuBLAS's workspace for the capture's own streams).
    assert _held_bytes(group, model) <= budget - reserve
    with torch.inference_mode():
        want = reference(x)
    for _ in range(3):
        assert torch.equal(graph(x), want)
    _finish(model, reference)
