"""A plan given to enable_layerwise_offload beside other arguments, or for another model: what it is checked
against, what its re-plans keep to, and that what runs is bit-exact against the resident model."""
from __future__ import annotations

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, module_packed_bytes, plan_offload

from ._models import Block, make_pair, params_equal

BACKENDS = ["ext", "python"]
N = 6
BLOCK_BYTES = module_packed_bytes(Block(16, 2))


def _setup(d: int = 16, dtype: torch.dtype = torch.float32):
    model, reference = make_pair(N, dtype=dtype, d=d)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, reference, x


def _run_exactly_and_finish(model, reference, x) -> None:
    with torch.inference_mode():
        want = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_made_for_smaller_blocks_is_refused_not_run_over_its_budget(backend: str) -> None:
    """A plan made for another model's blocks (same count, smaller) was applied as it was: its 70 KiB budget
    was checked against its own figures while the engine held 3.6x as much."""
    costs = BlockCosts([1.0] * N, [BLOCK_BYTES] * N, 1e-3)
    plan = plan_offload(costs, 5 * BLOCK_BYTES)
    model, reference, x = _setup(d=32)
    with pytest.raises(OffloadConfigError, match=r"the plan was made for blocks of other sizes than 'blocks' has "
                                                 r"\(block 0: 14\.0 KiB in the plan, 50\.5 KiB here\)"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan, device_budget=5 * BLOCK_BYTES)
    assert fo.get_offload_group(model) is None
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))


def test_a_plan_reused_after_model_half_is_refused() -> None:
    model, reference, x = _setup()
    costs = BlockCosts([1.0] * N, [module_packed_bytes(b) for b in model.blocks], 1e-3)
    plan = plan_offload(costs, 5 * BLOCK_BYTES)
    model.half()
    with pytest.raises(OffloadConfigError, match="make a plan from this model's costs"):
        fo.enable_layerwise_offload(model, device="cpu", plan=plan)
    assert fo.get_offload_group(model) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_activation_reserve_given_beside_a_plan_is_counted(backend: str) -> None:
    """enable(plan=p, device_budget=b, activation_reserve=r): r was checked nowhere and the plan reported the
    reserve it was made with (0), so a plan that filled b was applied with r on top of it."""
    costs = BlockCosts([1.0, 0.1] * 3, [BLOCK_BYTES] * N, 1e-3)
    plan = plan_offload(costs, 5 * BLOCK_BYTES)
    assert plan.device_bytes == 5 * BLOCK_BYTES and plan.activation_bytes == 0
    model, reference, x = _setup()
    with pytest.raises(OffloadConfigError, match=r"with activation_reserve 14\.0 KiB makes 84\.0 KiB, more than "
                                                 r"device_budget 70\.0 KiB"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan, device_budget=5 * BLOCK_BYTES,
                                    activation_reserve=BLOCK_BYTES)
    assert fo.get_offload_group(model) is None
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan,
                                        device_budget=6 * BLOCK_BYTES, activation_reserve=BLOCK_BYTES)
    assert (group.resident, group.prefetch_depth) == (plan.resident, plan.prefetch_depth)
    reported = group.stats()["plan"]
    assert reported["activation_bytes"] == BLOCK_BYTES and reported["device_bytes"] == 6 * BLOCK_BYTES
    _run_exactly_and_finish(model, reference, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_budget_given_beside_a_plan_is_the_one_its_replans_keep_to(backend: str) -> None:
    """enable(plan=p, host_budget=h) with p made without a host budget: stats reported none, and a re-plan
    chose a layout whose host copies passed h (then refused by enable) although one within h exists."""
    costs = BlockCosts([0.01, 0.01, 0.01, 2.0, 0.01, 2.0], [BLOCK_BYTES] * N, 0.02)
    assert plan_offload(costs, 4 * BLOCK_BYTES).host_bytes == 5 * BLOCK_BYTES  # the fastest without a host budget
    within = plan_offload(costs, 4 * BLOCK_BYTES, host_budget=4 * BLOCK_BYTES)
    plan = plan_offload(costs, resident=(0, 1), prefetch_depth=1)
    assert plan.host_budget is None
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan,
                                        device_budget=4 * BLOCK_BYTES, host_budget=4 * BLOCK_BYTES)
    assert group.stats()["plan"]["host_budget"] == 4 * BLOCK_BYTES
    assert (group.resident, group.prefetch_depth) == ((0, 1), 1)
    fresh = group.replan(costs)
    assert (fresh.resident, fresh.prefetch_depth) == (within.resident, within.prefetch_depth)
    assert fresh.plan.host_bytes <= 4 * BLOCK_BYTES and fresh.plan.host_budget == 4 * BLOCK_BYTES
    _run_exactly_and_finish(model, reference, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_table_of_other_block_sizes_is_refused_before_anything_changes(backend: str) -> None:
    """group.replan(table) with blocks 0-2 at half their size planned all six resident under a budget of five
    and the engine held six full blocks, 84 KiB under device_budget 70 KiB, while the plan reported 63 KiB."""
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES)
    with pytest.raises(OffloadConfigError, match=r"the cost table's block sizes are not those of 'blocks' \(block 0: "
                                                 r"7\.0 KiB in the table, 14\.0 KiB here\); nothing was changed"):
        group.replan(BlockCosts([0.1] * N, [BLOCK_BYTES // 2] * 3 + [BLOCK_BYTES] * 3, 1e-3))
    assert fo.get_offload_group(model) is group and group.resident == (0, 1, 2)
    _run_exactly_and_finish(model, reference, x)


@pytest.mark.parametrize("measured", [float("nan"), float("inf"), -5.0, 0.0, True, "12.5"])
def test_observe_step_refuses_a_measurement_that_is_not_a_step_time(measured: object) -> None:
    """A NaN step (a timer that divided by zero) read as "no drift" and a negative one as drift; neither is a
    step the plan can be judged by."""
    model, reference, x = _setup()
    costs = BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3)
    group = fo.enable_layerwise_offload(model, device="cpu", device_budget=5 * BLOCK_BYTES)
    fresh = group.replan(costs)
    assert not fresh.observe_step(fresh.plan.predicted_step_ms)
    with pytest.raises(OffloadConfigError, match=r"fastoffload: a measured step must be a time in milliseconds > 0"):
        fresh.observe_step(measured)
    _run_exactly_and_finish(model, reference, x)
