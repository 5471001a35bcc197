"""The depth-k schedule bound of the models section: the replayed schedule against hand-worked cases, the
per-block clock on a host model, and the ext rows that carry it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.schedule_bound import BlockClock, schedule_ms, steps_for


def test_a_resident_forward_is_the_sum_of_its_steps() -> None:
    assert schedule_ms([(5.0, None), (3.0, None), (2.0, None)], 1) == 10.0


def test_depth_one_pairs_each_copy_with_the_compute_before_it() -> None:
    # Copy i+1 runs while block i computes: sum of max(c_i, t_{i+1}), the last block's gap (with the
    # rest of the forward) against the next forward's first copy.
    steps = [(9.0, 14.0)] * 3 + [(6.0, 4.0)] * 4 + [(2.0, None)]
    expected = 2 * 14.0 + max(9.0, 4.0) + 3 * max(6.0, 4.0) + max(6.0 + 2.0, 14.0)
    assert schedule_ms(steps, 1) == expected
    # The transfer floor max(sum c, sum t) is lower: the copy-bound blocks' excess cannot hide later.
    assert expected > max(3 * 9.0 + 4 * 6.0 + 2.0, 3 * 14.0 + 4 * 4.0)


def test_a_copy_bound_ring_takes_its_copies_and_more_slots_help() -> None:
    assert schedule_ms([(1.0, 10.0)] * 3 + [(1.0, None)], 1) == 30.0
    # Two blocks computing 1 and 9 ms, each copying 5: depth 1 pays max(1, 5) + max(9, 5); depth 2 issues the
    # next forward's copy a block earlier, so it is not slower.
    steps = [(1.0, 5.0), (9.0, 5.0)]
    assert schedule_ms(steps, 1) == 14.0
    assert schedule_ms(steps, 2) <= 14.0


def test_a_bad_depth_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^fastoffload: prefetch_depth must be >= 1, got 0"):
        schedule_ms([(1.0, 1.0)], 0)


def test_the_rest_of_the_forward_is_one_last_step() -> None:
    assert steps_for([2.0, 3.0], 7.5, [1.0, None]) == [(2.0, 1.0), (3.0, None), (2.5, None)]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):  # not the list's order: the clock records the order they ran
            x = block(x)
        return x


def test_the_clock_times_every_block_in_the_order_they_ran_and_leaves_no_hook() -> None:
    net = _Net()
    clock = BlockClock(list(net.blocks), cuda=False)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        reference = net(x)
        totals = clock.timer(lambda: net(x), iters=2)()
    assert len(totals) == 2 and len(clock.rounds) == 1
    order, per_block, total = clock.rounds[0]
    assert order == [2, 1, 0] and len(per_block) == 3 and all(ms > 0 for ms in per_block)
    assert sum(per_block) <= total
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in net.blocks)
    with torch.inference_mode():
        assert torch.equal(net(x), reference)
    # Copies are given in the list's order and matched to the blocks as they ran. One offloaded block in a
    # ring of two slots: its next copy overlaps the whole forward, so the bound is max(copy, forward).
    (bound,) = clock.round_bounds([None, None, 1000.0], prefetch_depth=1)
    assert bound == pytest.approx(max(1000.0, total))
    # Every block offloaded with free copies: the forward itself.
    (free,) = clock.round_bounds([0.0, 0.0, 0.0], prefetch_depth=1)
    assert free == pytest.approx(max(total, sum(per_block)))
    assert clock.block_medians() == [per_block[2], per_block[1], per_block[0]]


def test_the_least_budget_plan_keeps_the_copy_bound_blocks_and_reaches_the_target() -> None:
    from benchmarks.model_budget import least_budget_plan
    from fastoffload_ext.planning import BlockCosts, plan_offload

    # FLUX.1-like at 9216 tokens: 19 blocks that copy longer than they compute, 38 the reverse.
    gb = 10**9
    costs = BlockCosts(compute_ms=(9.0,) * 19 + (6.0,) * 38,
                       block_bytes=(int(0.777 * gb),) * 19 + (int(0.2225 * gb),) * 38,
                       h2d_gbps=55.5, other_ms=2.0, activation_bytes=gb)
    floor = max(sum(costs.compute_ms) + 2.0, sum(costs.block_bytes) / (55.5 * gb) * 1e3)
    assert schedule_ms(steps_for(list(costs.compute_ms), sum(costs.compute_ms) + 2.0,
                                 [b / (55.5 * gb) * 1e3 for b in costs.block_bytes]), 1) > 1.05 * floor
    plan = least_budget_plan(costs, 1.05 * floor)
    assert plan is not None and plan.predicted_step_ms <= 1.05 * floor and plan.resident
    assert plan.device_budget is not None and plan.device_bytes <= plan.device_budget
    # A budget a good step below it plans slower than the target (or fits nothing).
    try:
        tighter = plan_offload(costs, int(plan.device_budget * 0.9)).predicted_step_ms
    except ValueError:
        tighter = float("inf")
    assert tighter > 1.05 * floor
    # Out of reach even with every block resident: no plan.
    assert least_budget_plan(costs, 1.0) is None


@pytest.mark.cuda
def test_the_clock_times_every_block_with_cuda_events() -> None:
    net = _Net().cuda()
    clock = BlockClock(list(net.blocks), cuda=True)
    x = torch.randn(4, 16, device="cuda")
    with torch.inference_mode():
        totals = clock.timer(lambda: net(x), iters=3)()
    order, per_block, total = clock.rounds[0]
    assert len(totals) == 3 and order == [2, 1, 0] and all(ms > 0 for ms in per_block) and sum(per_block) <= total
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in net.blocks)


@pytest.mark.cuda
def test_a_placeholder_on_the_device_counts_as_offloaded() -> None:
    from benchmarks.peers import offloaded_parts

    net = _Net().cuda()
    shapes = {name: param.shape for name, param in net.named_parameters()}
    device = torch.device("cuda", torch.cuda.current_device())
    assert offloaded_parts(net, device, shapes, ["blocks"]) == frozenset()
    net.blocks[0].weight.data = torch.empty(0, 0, device=device, dtype=net.blocks[0].weight.dtype)
    assert offloaded_parts(net, device, shapes, ["blocks"]) == frozenset({"blocks"})
