"""Re-planning an offloaded model, adversarially: what a re-plan must keep (the caller's fixed half of the
layout, ordinary tensors, exact values) and what it must refuse. The host as the device, both backends."""
from __future__ import annotations

import copy

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, module_packed_bytes, plan_offload

from benchmarks.workloads import BlockStack

from ._models import Block, make_pair, params_equal

BACKENDS = ["ext", "python"]
N = 6
BLOCK_BYTES = module_packed_bytes(Block(16, 2))


def _setup(seed: int = 0):
    model, reference = make_pair(N, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed + 1))
    return model, reference, x


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fixed_resident_set_survives_a_second_replan(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES,
                                        resident_blocks=[0])
    assert group.resident == (0,) and group.prefetch_depth == 1
    # One compute-heavy block: the planner deepens the prefetch, a new layout that is applied again.
    fresh = group.replan(BlockCosts([3.0] + [0.1] * 5, [BLOCK_BYTES] * N, 1e-2))
    assert fresh is not group and fresh.resident == (0,) and fresh.prefetch_depth == 2
    # A table on which a free choice would spread the resident blocks: the caller fixed block 0 alone.
    again = fresh.replan(BlockCosts([1.0, 0.1] * 3, [BLOCK_BYTES] * N, 1e-3))
    assert again.resident == (0,)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fixed_prefetch_depth_survives_a_second_replan(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES,
                                        prefetch_depth=2)
    assert group.plan.prefetch_depth == 2
    # A measured table: the two resident blocks spread, a new layout at the depth the caller fixed.
    fresh = group.replan(BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3))
    assert fresh is not group and fresh.resident == (0, 3)
    again = fresh.replan(BlockCosts([0.1] * 5 + [3.0], [BLOCK_BYTES] * N, 1e-2))
    assert again is not fresh and again.resident == (2, 5)
    assert again.plan.prefetch_depth == 2 and again.prefetch_depth == 2
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_inside_inference_mode_leaves_ordinary_parameters(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * BLOCK_BYTES)
    with torch.inference_mode():  # a denoising loop that re-plans as it goes (calibrate, observe_step)
        fresh = group.replan(BlockCosts([1.0, 0.1] * 3, [BLOCK_BYTES] * N, 1e-3))
        assert fresh is not group and torch.equal(model(x), reference(x))
    # Still offloaded: gradients to the input through the frozen blocks, as on the resident model.
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(got).sum().backward()
    reference(want).sum().backward()
    assert torch.equal(got.grad, want.grad)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    assert not any(p.is_inference() for p in model.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_calibration_inside_inference_mode_leaves_parameters_trainable(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * BLOCK_BYTES)
    with torch.inference_mode():
        group.calibrate(lambda: model(x), repeats=1)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    model.requires_grad_(True)
    reference.requires_grad_(True)
    model(x).sum().backward()
    reference(x).sum().backward()
    grads, expected = dict(model.named_parameters()), dict(reference.named_parameters())
    assert all(torch.equal(grads[name].grad, expected[name].grad) for name in expected)


@pytest.mark.parametrize("resident", [(i for i in (0, 1)), iter([0, 1]), 2, "01"])
def test_plan_offload_refuses_a_resident_set_that_is_not_a_collection(resident: object) -> None:
    costs = BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3)
    with pytest.raises(OffloadConfigError, match="plan_offload's resident must be None or a collection of block indices"):
        plan_offload(costs, 5 * BLOCK_BYTES, resident=resident)
    # The same indices as a collection fix the resident set exactly.
    assert plan_offload(costs, 5 * BLOCK_BYTES, resident=(0, 1)).resident == (0, 1)


def _compressible_pair(d: int = 64):
    """bf16 blocks with small weights (as initialised models have): the codec codes them."""
    torch.manual_seed(0)
    model = BlockStack(d, N, 2).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.02)
    model.requires_grad_(False)
    return model, copy.deepcopy(model)


def test_a_raw_table_given_to_a_compressed_group_is_planned_with_the_coded_copies() -> None:
    model, reference = _compressible_pair()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=True, device_budget=4 * block)
    # A table as one measured on a GPU (copies beside compute) with raw sizes: the coded copies need the
    # decoder's staging on the device, which the re-plan must count, not discover at enable and refuse.
    fresh = group.replan(BlockCosts([1.0, 0.1] * 3, [block] * N, 1e-3))
    assert fresh is fo.get_offload_group(model) and fresh.compress_mode == "on"
    assert fresh.plan.staging_bytes > 0 and fresh.plan.device_bytes <= 4 * block
    with torch.inference_mode():
        want = reference(x)
        assert all(torch.equal(model(x), want) for _ in range(3))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_inside_mutate_params_scope_is_refused_and_the_scope_still_lands(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * BLOCK_BYTES)
    offloaded = next(i for i in range(N) if i not in group.resident)
    hook = fo.ModuleHookManager.get_from(model.blocks[offloaded]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    with hook.mutate_params_scope(), torch.no_grad():
        model.blocks[offloaded].o.weight.mul_(2)
        with pytest.raises(fo.OffloadStateError, match=f"offloaded block {offloaded} is inside mutate_params_scope"):
            group.replan(BlockCosts([1.0, 0.1] * 3, [BLOCK_BYTES] * N, 1e-3))
    assert fo.get_offload_group(model) is group
    with torch.no_grad():
        reference.blocks[offloaded].o.weight.mul_(2)
    # The scope's change landed in the host copy; a re-plan after the scope is fine and keeps it.
    fresh = group.replan(BlockCosts([1.0, 0.1] * 3, [BLOCK_BYTES] * N, 1e-3))
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(fresh.model_ref)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cost_table_for_another_block_count_is_refused_before_anything_changes(backend: str) -> None:
    model, reference, x = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * BLOCK_BYTES)
    with pytest.raises(OffloadConfigError, match="the cost table has 7 blocks, but the offloaded list 'blocks' has 6; "
                                                 "nothing was changed"):
        group.replan(BlockCosts([1.0] * 7, [BLOCK_BYTES] * 7, 1e-3))
    assert fo.get_offload_group(model) is group
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_made_without_a_budget_keeps_the_budget_enable_was_given(backend: str) -> None:
    """enable(plan=p, device_budget=b) with p made without a budget: re-plans keep to b (they used p's None
    and re-planned every block resident, twice the budget)."""
    model, reference, x = _setup()
    costs = BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3)
    plan = plan_offload(costs, resident=(0,), prefetch_depth=1)
    assert plan.device_budget is None
    budget = 4 * BLOCK_BYTES
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, plan=plan, device_budget=budget)
    assert group.plan.device_budget == budget
    assert (group.resident, group.prefetch_depth) == ((0,), 1)  # the layout is the plan's
    fresh = group.replan(costs)
    assert fresh.plan.device_budget == budget and fresh.plan.device_bytes <= budget
    assert len(fresh.resident) == 2  # the most that fit beside two slots
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
