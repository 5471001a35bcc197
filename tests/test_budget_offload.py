"""Budgets, resident sets and plans through enable_layerwise_offload, bit for bit against the resident model.

Both backends, with the host as the device (CI) and, marked ``cuda``, on a GPU.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning import BlockCosts, OffloadPlan, module_packed_bytes, plan_offload

from ._models import OFFLOAD_DEVICES, Block, make_pair, params_equal, place_outside_blocks
from ._trees import has_hooks

BACKENDS = ["ext", "python"]
N = 6
BLOCK_BYTES = module_packed_bytes(Block(16, 2))


def _device(name: str) -> torch.device:
    return torch.device("cpu") if name == "cpu" else torch.device("cuda", torch.cuda.current_device())


def _setup(device: str, n: int = N, seed: int = 0):
    model, reference = make_pair(n, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False).to(_device(device))
    place_outside_blocks(model, device)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed + 1)).to(_device(device))
    return model, reference, x


def _run_exactly(model, reference, x, steps: int = 3) -> None:
    with torch.inference_mode():
        want = reference(x)
        for _ in range(steps):
            assert torch.equal(model(x), want)


def _finish(model, reference) -> None:
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    assert not any(has_hooks(block) for block in model.blocks)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("resident, depth", [
    ((), 1), ((0,), 2), ((5,), 1), ((1, 3), 1), ((0, 2, 4), 3), ((1, 2, 3, 4), 2), ((0, 1, 2, 3, 4), 1),
    (tuple(range(N)), 1), ((2, 5), 0),
])
def test_any_resident_set_and_depth_is_bit_exact(device: str, backend: str, resident: tuple[int, ...],
                                                 depth: int) -> None:
    model, reference, x = _setup(device)
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, resident_blocks=list(resident),
                                        prefetch_depth=depth)
    assert group.resident == resident and group.resident_blocks == len(resident)
    assert group.offloaded_indices == tuple(i for i in range(N) if i not in resident)
    for index, block in enumerate(model.blocks):
        # Resident blocks are on the device and never hooked; the others hold placeholders.
        assert has_hooks(block) == (index not in resident)
        assert all((p.numel() > 0) == (index in resident) for p in block.parameters())
    _run_exactly(model, reference, x)
    assert group.stats()["resident"] == list(resident)
    _finish(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra_blocks", [0, 1, 3, N])
def test_device_budget_plans_within_it_and_is_bit_exact(device: str, backend: str, extra_blocks: int) -> None:
    model, reference, x = _setup(device)
    budget = (2 + extra_blocks) * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, device_budget=budget)
    plan = group.plan
    assert isinstance(plan, OffloadPlan) and plan.device_budget == budget
    assert plan.device_bytes <= budget and not plan.calibrated
    # Bytes only (nothing measured yet): the most blocks resident that the budget allows, at depth 1.
    expected = N if extra_blocks >= N else extra_blocks
    assert len(plan.resident) == expected and group.resident == plan.resident
    assert plan.prefetch_depth == 1 and group.prefetch_depth == min(1, N - len(plan.resident))  # clamped when none is offloaded
    _run_exactly(model, reference, x)
    stats = group.stats()
    assert stats["plan"]["resident"] == list(plan.resident)
    if backend == "ext" and group.engine is not None:
        held = stats["num_slots"] * stats["slot_bytes"] + sum(module_packed_bytes(model.blocks[i]) for i in plan.resident)
        assert held <= budget
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fixed_depth_beyond_the_offloaded_blocks_plans_the_slots_enable_makes(backend: str) -> None:
    # Two offloaded blocks run at depth 2 (3 slots) whatever depth is asked; the plan counted 6 slots and
    # refused this budget, which the resident blocks and the engine's slots fit exactly.
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[0, 1, 2, 3],
                                        prefetch_depth=5, device_budget=7 * BLOCK_BYTES)
    assert group.prefetch_depth == group.plan.prefetch_depth == 2 and group.plan.num_slots == 3
    assert group.stats()["plan"]["device_bytes"] == 7 * BLOCK_BYTES
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_from_plan_offload_is_applied_as_it_is(backend: str) -> None:
    model, reference, x = _setup("cpu")
    costs = BlockCosts([1.0, 0.1, 1.0, 0.1, 1.0, 0.1], [BLOCK_BYTES] * N, 1e-3)  # transfer-bound
    plan = plan_offload(costs, 5 * BLOCK_BYTES)
    assert len(plan.resident) == 3
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan)
    assert group.plan is plan and group.resident == plan.resident and group.prefetch_depth == plan.prefetch_depth
    _run_exactly(model, reference, x)
    assert group.stats()["plan"] == plan.as_dict()
    _finish(model, reference)


def test_no_budget_keeps_fastvideo_defaults() -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu")
    assert group.plan is None and group.resident == () and group.prefetch_depth == 1
    assert group.stats()["plan"] is None
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_residency_without_a_budget_uses_free_memory(backend: str) -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks="auto",
                                        prefetch_depth="auto")
    assert group.plan is not None and group.resident == tuple(range(N))  # a tiny model fits the host
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calibrate_measures_every_block_and_replans_bit_exactly(backend: str) -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * BLOCK_BYTES)

    def step() -> None:
        model(x)

    costs = group.calibrate(step, repeats=3)
    assert costs.calibrated and costs.blocks == N and all(c > 0 for c in costs.compute_ms)
    assert costs.block_bytes == (BLOCK_BYTES,) * N and not costs.overlap and costs.h2d_gbps > 0
    current = fo.get_offload_group(model)
    assert current.plan.calibrated and current.plan.device_bytes <= 4 * BLOCK_BYTES
    assert current.costs == costs
    # The timing hooks are gone again: resident blocks have no manager, offloaded ones only the offload hook.
    for index, block in enumerate(model.blocks):
        assert has_hooks(block) == (index not in current.resident)
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replan_to_another_layout_reapplies_and_the_old_group_is_refused(backend: str) -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES)
    first = group.resident
    # A measured, transfer-bound table: the same three resident blocks, spread so each copy hides behind one.
    costs = BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3)
    fresh = group.replan(costs)
    assert fresh is fo.get_offload_group(model) and fresh is not group
    assert first == (0, 1, 2) and fresh.resident == (0, 2, 4)
    assert fresh.plan.calibrated and fresh.plan.device_bytes <= 5 * BLOCK_BYTES and fresh.costs == costs
    _run_exactly(model, reference, x)
    message = ("fastoffload: this offload group is no longer the one on its model (offload was disabled or "
               "re-planned); use get_offload_group(model) for the current one")
    with pytest.raises(OffloadStateError, match=re.escape(message)):
        group.replan(costs)
    # The same costs again: same layout, so nothing is re-applied.
    assert fresh.replan(costs) is fresh
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_no_longer_on_its_model_refuses_stats_and_observe_step(backend: str) -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES)
    assert group.stats()["offloaded_blocks"] == 3
    fresh = group.replan(BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3))
    assert fresh is not group and fresh.resident == (0, 2, 4)
    message = ("fastoffload: this offload group is no longer the one on its model (offload was disabled or "
               "re-planned); use get_offload_group(model) for the current one")
    # The old group's figures (3 blocks offloaded, its plan) and its plan's verdict describe a layout
    # the model no longer runs: refused like calibrate and replan, not answered from the old plan.
    for call in (group.stats, lambda: group.observe_step(1e9), lambda: group.observe_step(1e-9, lambda: model(x)),
                 lambda: group.observe_step(group.plan.predicted_step_ms, lambda: model(x))):
        with pytest.raises(OffloadStateError, match=re.escape(message)):
            call()
    assert "no longer on its model" in repr(group)
    assert fresh.stats()["offloaded_blocks"] == 3 and "no longer" not in repr(fresh)
    _run_exactly(model, reference, x)
    _finish(model, reference)
    with pytest.raises(OffloadStateError, match=re.escape(message)):
        fresh.stats()
    with pytest.raises(OffloadStateError, match=re.escape(message)):
        fresh.observe_step(1e9)


def test_replan_without_costs_is_refused() -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget=4 * BLOCK_BYTES)
    with pytest.raises(OffloadStateError, match=re.escape(
            "fastoffload: nothing to re-plan from: call group.calibrate(step) first, or pass a BlockCosts table")):
        group.replan()
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_a_fixed_layout_is_not_replanned() -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", resident_blocks=2)
    costs = group.calibrate(lambda: model(x), repeats=3)  # measures, leaves the layout alone
    assert fo.get_offload_group(model) is group and group.costs == costs and group.resident == (0, 1)
    with pytest.raises(OffloadStateError, match=re.escape(
            "fastoffload: this offload has a fixed layout (enabled without device_budget or 'auto'), so there is "
            "nothing to re-plan; enable with device_budget=... or resident_blocks='auto' to let the planner choose")):
        group.replan(costs)
    assert not group.observe_step(1e9)
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_observe_step_flags_drift_beyond_the_tolerance() -> None:
    model, reference, _ = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget=4 * BLOCK_BYTES)
    assert group.observe_step(1.0)  # a bytes-only plan never vouches for a step
    costs = BlockCosts([1.0] * N, [BLOCK_BYTES] * N, 1.0, overlap=False)
    fresh = group.replan(costs)
    predicted = fresh.plan.predicted_step_ms
    assert not fresh.observe_step(predicted * 1.05) and fresh.observe_step(predicted * 1.5)
    _finish(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_a_calibrated_plan_judges_drift_against_the_step_it_timed_not_its_prediction(device: str) -> None:
    model, reference, x = _setup(device)
    # A budget for the blocks alone: the reserve is given, so the activations measured on CUDA do not count.
    group = fo.enable_layerwise_offload(model, device=device, device_budget=4 * BLOCK_BYTES, activation_reserve=0)
    assert group.plan.measured_step_ms == 0.0 and group.plan.reference_step_ms == group.plan.predicted_step_ms
    with torch.inference_mode():
        want = reference(x)
        group.calibrate(lambda: model(x), repeats=3)
        now = fo.get_offload_group(model)
        measured = now.plan.measured_step_ms
        assert measured > 0 and now.plan.reference_step_ms == measured
        assert now.stats()["plan"]["measured_step_ms"] == measured
        assert "once applied" in now.plan.explain()
        # A prediction that errs by half (as a biased calibration can) does not read as drift by itself.
        now.plan = dataclasses.replace(now.plan, predicted_step_ms=measured * 2.0)
        assert not now.observe_step(measured * 1.1) and not now.observe_step(measured * 0.9)
        assert now.observe_step(measured * 1.3) and now.observe_step(measured * 0.7)
        assert torch.equal(model(x), want)
    _finish(model, reference)


def test_observe_step_with_a_step_calibrates_and_replans_a_drifted_group() -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget=4 * BLOCK_BYTES)
    fresh = group.replan(BlockCosts([1.0] * N, [BLOCK_BYTES] * N, 1.0, overlap=False))
    with torch.inference_mode():
        want = reference(x)
        step = lambda: model(x)  # noqa: E731
        assert not fresh.observe_step(fresh.plan.predicted_step_ms, step=step)
        # Within the tolerance nothing is measured: the group keeps the table it was planned from.
        assert fo.get_offload_group(model) is fresh and fresh.costs.h2d_gbps == 1.0
        assert fresh.observe_step(fresh.plan.predicted_step_ms * 3.0, step=step)
        now = fo.get_offload_group(model)
        assert now.costs is not None and now.costs.h2d_gbps != 1.0  # measured on this machine, then re-planned
        assert now.plan.calibrated and torch.equal(model(x), want)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_activation_reserve_without_a_budget_is_refused_and_counts_under_auto(backend: str) -> None:
    model, reference, x = _setup("cpu")
    with pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: activation_reserve is the part of a device_budget kept for activations, and no "
            "device_budget was given (nor resident_blocks or prefetch_depth 'auto', nor a plan), so nothing would "
            "count it; pass device_budget=... (or 'auto'), or leave activation_reserve out")):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, activation_reserve="1MiB")
    assert fo.get_offload_group(model) is None and params_equal(model, reference)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks="auto",
                                        activation_reserve="1MiB")
    assert group.plan.costs.activation_bytes == 1 << 20
    _run_exactly(model, reference, x)
    _finish(model, reference)


def _peak_measured_as(monkeypatch: pytest.MonkeyPatch, peak: int) -> None:
    """Calibrations on the host-as-device measure no activation peak; this one reports ``peak``."""
    from fastoffload_ext.planning import calibration

    measure = calibration.measure_blocks
    monkeypatch.setattr(calibration, "measure_blocks",
                        lambda *a, **k: dataclasses.replace(measure(*a, **k), activation_bytes=peak))


@pytest.mark.parametrize("backend", BACKENDS)
def test_calibration_replaces_the_reserve_enable_assumed_with_the_peak_it_measured(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x = _setup("cpu")
    budget = (2 + N) * BLOCK_BYTES  # every block resident, two slots' worth to spare, no reserve given
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=budget)
    assert group.plan.costs.activation_bytes == 0 and len(group.resident) == N
    _peak_measured_as(monkeypatch, 3 * BLOCK_BYTES)
    with torch.inference_mode():
        group.calibrate(lambda: model(x), repeats=3)
    now = fo.get_offload_group(model)
    # Three blocks' worth of activations: with two slots, three of the six blocks still fit.
    assert now.plan.costs.activation_bytes == 3 * BLOCK_BYTES and now.costs.activation_bytes == 3 * BLOCK_BYTES
    assert now.plan.device_bytes <= budget and len(now.resident) == N - 3
    # A later re-plan from a table of bytes only keeps the measured reserve.
    later = now.replan(BlockCosts([1.0] * N, [BLOCK_BYTES] * N, 1.0, overlap=False))
    assert later.plan.costs.activation_bytes == 3 * BLOCK_BYTES and len(later.resident) == N - 3
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_measured_peak_no_layout_fits_beside_is_refused_and_the_layout_kept(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x = _setup("cpu")
    budget = 4 * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=budget)
    resident = group.resident
    _peak_measured_as(monkeypatch, budget)
    with torch.inference_mode(), pytest.raises(OffloadConfigError, match=re.escape(
            "fastoffload: this step's activations peaked at 56.0 KiB (with the allocator's slack), which the plan "
            "now keeps as its activation reserve, and no layout fits device_budget 56.0 KiB beside it; the layout "
            "enable applied is kept")):
        group.calibrate(lambda: model(x), repeats=3)
    assert fo.get_offload_group(model) is group and group.resident == resident
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_a_given_reserve_outranks_the_measured_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget=(2 + N) * BLOCK_BYTES,
                                        activation_reserve=3 * BLOCK_BYTES)
    assert len(group.resident) == N - 3
    _peak_measured_as(monkeypatch, BLOCK_BYTES)  # would let every block stay resident
    with torch.inference_mode():
        group.calibrate(lambda: model(x), repeats=3)
    now = fo.get_offload_group(model)
    assert now.plan.costs.activation_bytes == 3 * BLOCK_BYTES and len(now.resident) == N - 3
    _run_exactly(model, reference, x)
    _finish(model, reference)


def test_without_a_measured_peak_the_reserve_enable_applied_stands() -> None:
    model, reference, x = _setup("cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget="auto")
    assumed = group.plan.costs.activation_bytes
    assert assumed > 0  # 10 % of the free memory
    with torch.inference_mode():
        group.calibrate(lambda: model(x), repeats=3)
        now = fo.get_offload_group(model)
        assert now.plan.costs.activation_bytes == assumed
        fresh = now.replan(BlockCosts([1.0] * N, [BLOCK_BYTES] * N, 1.0, overlap=False))
        assert fresh.plan.costs.activation_bytes == assumed
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_auto_budget_counts_the_measured_activation_peak_after_calibration(backend: str) -> None:
    model, reference, x = _setup("cuda", n=8)
    group = fo.enable_layerwise_offload(model, device="cuda", backend=backend, device_budget="auto")
    guess = group.plan.costs.activation_bytes  # 10 % of the free memory: gigabytes on a GPU
    with torch.inference_mode():
        group.calibrate(lambda: model(x), repeats=3)
    now = fo.get_offload_group(model)
    reserve = now.plan.costs.activation_bytes
    # The peak of a 2x5x16 input plus the allocator's slack, not the guess.
    assert 0 < reserve < 8 * 1024 * 1024 < guess
    _run_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_peak_memory_stays_within_the_budget(backend: str) -> None:
    model, reference, x = _setup("cuda", n=8)
    with torch.inference_mode():
        want = reference(x)
    reserve = 64 * 1024  # activations of a 2x5x16 input, the allocator's rounding of each parameter
    budget = 5 * BLOCK_BYTES + reserve
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    group = fo.enable_layerwise_offload(model, device="cuda", backend=backend, device_budget=budget,
                                        activation_reserve=reserve)
    assert len(group.resident) == 3 and group.plan.device_bytes <= budget
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    _finish(model, reference)
