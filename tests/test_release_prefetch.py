"""Prefetch on release: where other compute follows an offloaded block (resident blocks, or the rest of the
forward at the wrap-around), the ext backend's release starts the next copy into the slot it just freed.

The wiring (``planning/schedule.py``), what the engine then holds while the other compute runs, the step
the simulator and the benchmark's schedule bound predict for it, and outputs bit-exact on both backends.
"""
from __future__ import annotations

import pytest
import torch

import fastoffload_ext as fo
from benchmarks.schedule_bound import schedule_ms
from fastoffload_ext.planning import BlockCosts, simulate_step
from fastoffload_ext.planning.schedule import acquire_targets, backward_targets, release_target

from ._models import OFFLOAD_DEVICES, make_pair, params_equal, place_outside_blocks


def test_acquire_targets_are_the_next_blocks_wrapping_only_when_cyclic() -> None:
    assert acquire_targets(1, 4, 2, cyclic=True) == [2, 3]
    assert acquire_targets(3, 4, 2, cyclic=True) == [0, 1]
    assert acquire_targets(3, 4, 2, cyclic=False) == []
    assert acquire_targets(2, 4, 2, cyclic=False) == [3]


def test_backward_targets_are_the_blocks_before_never_wrapping() -> None:
    assert backward_targets(3, 2) == [2, 1]
    assert backward_targets(1, 2) == [0]
    assert backward_targets(0, 3) == []


@pytest.mark.parametrize(("depth", "cyclic", "expected"), [
    # Blocks 0, 1, 3, 4 offloaded (2 resident): a gap after offloaded block 1 and at the wrap-around.
    (1, True, [None, 3, None, 1]),
    (2, True, [None, 0, None, 2]),
    (1, False, [None, 3, None, None]),  # no next step to copy for
    (3, True, [None, None, None, None]),  # four slots hold all four blocks: nothing is evicted
])
def test_release_targets_are_where_other_compute_follows(depth: int, cyclic: bool, expected: list[int | None]) -> None:
    positions = [0, 1, 3, 4]
    assert [release_target(i, positions, depth, cyclic) for i in range(4)] == expected
    # Each is the block the next offloaded block would prefetch last as it starts.
    for i, target in enumerate(expected):
        if target is not None:
            assert target == acquire_targets((i + 1) % 4, 4, depth, cyclic)[-1]


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_only_the_ext_backend_prefetches_on_release(backend: str) -> None:
    model, _ = make_pair(6)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[2])
    assert group is not None
    by_block = {block_index: state for block_index, state in zip((0, 1, 3, 4, 5), group.states)}
    if backend == "ext":
        assert [list(state.release_targets) for state in group.states] == [
            [], [by_block[4]], [], [], [by_block[1]]]
    else:
        # FastVideo's acquire waits for every copy in flight: an early copy would hold up the block before it.
        assert all(not state.release_targets for state in group.states)
    fo.disable_layerwise_offload(model)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_the_freed_slot_fills_while_a_resident_block_runs_bit_exact(device: str, backend: str) -> None:
    model, reference = make_pair(6)
    place_outside_blocks(model, device)
    reference.to(device)
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, resident_blocks=[2])
    assert group is not None
    offloaded = dict(zip((0, 1, 3, 4, 5), group.states))
    seen: list[bool] = []

    def loaded(block: int) -> bool:
        state = offloaded[block]
        if backend == "python":
            return bool(state.gpu_named_parameters)
        return bool(state.engine.slot_of(state.handle) >= 0)

    # While resident block 2 runs, block 3 (prefetched by block 1's start) and block 4 (by block 1's release,
    # ext only) are both on their way.
    handle = model.blocks[2].register_forward_pre_hook(lambda module, args: seen.append(loaded(3) and loaded(4)))
    x = torch.randn(2, 3, 16, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
        if backend == "ext":
            # The last block released: the next step's first two blocks are both in their slots.
            assert loaded(0) and loaded(1)
    handle.remove()
    assert seen == [backend == "ext"] * 3
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_the_simulator_starts_the_copy_after_a_resident_tail_as_the_last_block_releases() -> None:
    # Three offloaded blocks (1 ms each, 10 ms copies) then a 30 ms resident block; the host keeps pace with
    # the device and meets it at each step's start. Block 1's copy starts as block 2 releases and hides behind
    # the resident block; issued only at block 0's start, it would hold block 1 back 9 ms (51 ms a step).
    costs = BlockCosts([1.0, 1.0, 1.0, 30.0], [100_000_000] * 4, 10.0, host_ms=[1.0, 1.0, 1.0, 30.0])
    timeline = simulate_step(costs, (3,), 1, host_waits=True)
    assert timeline.step_ms == pytest.approx(42.0)
    assert timeline.block_start[:3] == pytest.approx((0.0, 1.0, 11.0))
    # The host a step ahead issued it early anyway: the same step.
    assert simulate_step(costs, (3,), 1).step_ms == pytest.approx(42.0)


def test_the_schedule_bound_copies_into_a_slot_as_it_frees() -> None:
    # The same ring with the host in step with the device: 3 copies of 10 ms behind 1 + 1 + 30 ms of compute.
    # Block 0's and block 1's copies run during the 30 ms tail; block 2's waits for block 0's slot.
    assert schedule_ms([(1.0, 10.0)] * 3 + [(30.0, None)], 1) == 42.0


@pytest.mark.parametrize("fixed_slots", [False, True], ids=["ring", "graph-slots"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("resident", [(), (2,), (0,), (7,), (2, 5), (1, 2), (0, 3, 7)])
def test_a_steady_step_loads_nothing_synchronously_and_skips_no_prefetch(resident: tuple[int, ...], depth: int,
                                                                         fixed_slots: bool) -> None:
    from fastoffload_ext.planning.slots import cyclic_slot_assignment

    model, reference = make_pair(8)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", resident_blocks=list(resident),
                                        prefetch_depth=depth)
    assert group is not None
    if fixed_slots:  # what a CUDA-graph capture sets: each block's own slot on every step
        group.engine.set_slot_assignment(*cyclic_slot_assignment(len(group.states), group.prefetch_depth))
    x = torch.randn(2, 3, 16)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))  # the first step loads what nothing prefetched yet
        before = group.engine.stats()
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    after = group.engine.stats()
    assert after["sync_loads"] == before["sync_loads"]
    assert after["skipped_prefetches"] == 0
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
