"""The host timeline of the cost model: a launch-bound step set by the host's dispatch and the hooks' host cost.

Simulation, planner, calibration fit and the host clock of the calibration, on synthetic tables and on the
CPU; a table without host figures must predict exactly what it did before the host timeline existed.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, plan_offload, simulate_step
from fastoffload_ext.planning.calibration import (Measurement, calibrate_costs, fit_host_overhead, measure_blocks,
                                                  with_host_figures)

from ._models import OFFLOAD_DEVICES, make_pair, params_equal, place_outside_blocks
from ._trees import has_hooks

MiB = 1024**2
BLOCK = 10 * MiB
GBPS = 50.0
COPY_MS = BLOCK / (GBPS * 1e6)  # 0.21 ms: hides behind a host-bound block


def launch_bound(n: int, *, host_ms: float = 1.0, compute_ms: float = 0.05, hooks_ms: float = 0.0,
                 host_other_ms: float = 0.0, sizes: list[int] | None = None) -> BlockCosts:
    """Many small blocks: the host dispatches each in ``host_ms``, the device computes it in ``compute_ms``."""
    return BlockCosts([compute_ms] * n, sizes or [BLOCK] * n, GBPS, host_ms=[host_ms] * n,
                      host_overhead_ms=hooks_ms, host_other_ms=host_other_ms)


def random_host_bound(rng: random.Random, n: int) -> BlockCosts:
    compute = [rng.uniform(0.05, 0.6) for _ in range(n)]
    return BlockCosts(compute, [rng.choice((1, 2, 3)) * 8 * MiB for _ in range(n)], GBPS,
                      host_ms=[c * rng.uniform(1.2, 3.0) for c in compute], host_overhead_ms=rng.uniform(0.0, 0.1),
                      host_other_ms=rng.uniform(0.0, 0.3), other_ms=rng.uniform(0.0, 0.2),
                      activation_bytes=rng.choice((0, MiB)))


def footprint(costs: BlockCosts, resident: frozenset[int], depth: int) -> int:
    """Device bytes of a layout, computed here independently of the planner."""
    off = [costs.block_bytes[b] for b in range(costs.blocks) if b not in resident]
    return sum(costs.block_bytes[b] for b in resident) + ((depth + 1) * max(off) if off else 0) + costs.activation_bytes


def brute_force(costs: BlockCosts, budget: int) -> float:
    best = None
    for r in range(costs.blocks + 1):
        for chosen in itertools.combinations(range(costs.blocks), r):
            for depth in (1, 2, 3):
                if footprint(costs, frozenset(chosen), depth) <= budget:
                    ms = simulate_step(costs, chosen, depth).step_ms
                    best = ms if best is None else min(best, ms)
    assert best is not None
    return best


# ---- the simulation ------------------------------------------------------------------------------

def test_a_resident_block_cannot_run_before_the_host_dispatched_it() -> None:
    costs = BlockCosts([0.1] * 3, [BLOCK] * 3, GBPS, host_ms=[1.0] * 3)
    timeline = simulate_step(costs, range(3), 1)
    assert timeline.block_start == (0.0, 1.0, 2.0) and timeline.block_end == (1.0, 2.0, 3.0)
    assert timeline.step_ms == 3.0 and timeline.host_ms == 3.0 and timeline.copies == 0


def test_a_prefetch_is_issued_when_the_host_reaches_the_hook_that_issues_it() -> None:
    # Copies of 2 ms; the host takes 5 ms to dispatch block 0, so block 1's hook, which prefetches block 2,
    # is reached at 5 ms: block 2's copy runs 5..7 and the block starts at 7 (without host figures: 6).
    # Each step starts when the one before it ended (host_waits), so block 0 is loaded from the step's start.
    costs = BlockCosts([0.1] * 3, [BLOCK] * 3, BLOCK / 2e6, host_ms=[5.0, 0.01, 0.01])
    timeline = simulate_step(costs, (), 1, cyclic=False, host_waits=True)
    assert timeline.block_start == pytest.approx((2.0, 5.0, 7.0), abs=1e-9)
    assert timeline.step_ms == pytest.approx(7.1, abs=1e-9)
    device = simulate_step(costs.device_only(), (), 1, cyclic=False, host_waits=True)
    assert device.block_start == pytest.approx((2.0, 4.0, 6.0), abs=1e-9) and device.host_ms == 0.0


@pytest.mark.parametrize("resident", [(), (1, 5), (0, 2, 4, 6), tuple(range(8))])
def test_a_launch_bound_step_is_the_host_dispatch_plus_the_hooks_of_the_offloaded_blocks(resident) -> None:
    costs = launch_bound(8, hooks_ms=0.1, host_other_ms=0.5)
    offloaded = 8 - len(resident)
    timeline = simulate_step(costs, resident, 1)
    assert timeline.step_ms == pytest.approx(0.5 + 8 * 1.0 + 0.1 * offloaded, rel=1e-12)
    assert timeline.host_ms == pytest.approx(timeline.step_ms, rel=1e-12)
    # The device alone would compute it in a fraction of that.
    assert simulate_step(costs.device_only(), resident, 1).step_ms < 0.5 * timeline.step_ms


def test_the_step_is_the_later_of_the_host_and_the_device() -> None:
    # Transfer-bound on the device (copies 2.1 ms a block), the host at 1 ms a block: the copies set the step.
    slow_copies = BlockCosts([0.05] * 6, [100 * MiB] * 6, GBPS, host_ms=[1.0] * 6)
    assert simulate_step(slow_copies, (), 1).step_ms == pytest.approx(simulate_step(
        slow_copies.device_only(), (), 1).step_ms, rel=1e-12)
    fast_copies = launch_bound(6)
    assert simulate_step(fast_copies, (), 1).step_ms == pytest.approx(6.0, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_host_only_ever_adds_to_the_step(seed: int) -> None:
    rng = random.Random(700 + seed)
    for _ in range(40):
        n = rng.randint(1, 9)
        sizes = [rng.choice((1, 2, 3)) * 20 * MiB for _ in range(n)]
        costs = BlockCosts([rng.uniform(0.0, 2.0) for _ in range(n)], sizes, GBPS, other_ms=rng.uniform(0.0, 1.0),
                           block_overhead_ms=rng.uniform(0.0, 0.1), host_ms=[rng.uniform(0.0, 2.0) for _ in range(n)],
                           host_overhead_ms=rng.uniform(0.0, 0.3),
                           host_other_ms=rng.uniform(0.0, 1.0))
        resident = [b for b in range(n) if rng.random() < 0.4]
        depth, cyclic = rng.randint(0, 3), rng.random() < 0.7
        timeline = simulate_step(costs, resident, depth, cyclic=cyclic)
        device = simulate_step(costs.device_only(), resident, depth, cyclic=cyclic)
        # The step holds the host's busy time and is never shorter than the device's timelines alone.
        assert timeline.step_ms >= timeline.host_ms - 1e-9 and timeline.step_ms >= device.step_ms - 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_steps_back_to_back_are_never_slower_than_steps_that_wait(seed: int) -> None:
    """Running steps back to back only lifts a constraint (the host meeting the device at each step's start),
    with or without host figures: no layout is predicted slower for it."""
    rng = random.Random(900 + seed)
    for _ in range(30):
        n = rng.randint(1, 9)
        timed = rng.random() < 0.6
        costs = BlockCosts([rng.uniform(0.0, 3.0) for _ in range(n)], [rng.choice((1, 2, 4)) * 20 * MiB for _ in range(n)],
                           GBPS, other_ms=rng.uniform(0.0, 2.0), block_overhead_ms=rng.uniform(0.0, 0.1),
                           host_ms=[rng.uniform(0.0, 3.0) for _ in range(n)] if timed else None,
                           host_overhead_ms=rng.uniform(0.0, 0.3) if timed else 0.0,
                           host_other_ms=rng.uniform(0.0, 2.0) if timed else 0.0)
        resident = [b for b in range(n) if rng.random() < 0.4]
        depth, cyclic = rng.randint(0, 3), rng.random() < 0.7
        ahead = simulate_step(costs, resident, depth, cyclic=cyclic)
        waits = simulate_step(costs, resident, depth, cyclic=cyclic, host_waits=True)
        assert ahead.step_ms <= waits.step_ms + 1e-9 and ahead.step_ms >= ahead.host_ms - 1e-9


# FLUX.1's block sizes, 4 double-stream then 8 single-stream blocks at 1024 tokens: the table an H200
# calibration measured (compute and host dispatch per block, ms), rounded.
_FLUX_4_8 = dict(
    compute_ms=[2.131, 1.223, 1.214, 1.221, 0.976, 0.984, 0.978, 0.98, 0.977, 0.977, 0.98, 0.981],
    block_bytes=[679662592] * 4 + [283183616] * 8, h2d_gbps=53.41, other_ms=2.353, activation_bytes=165194752,
    host_ms=[1.924, 1.89, 1.697, 1.729, 1.053, 1.04, 1.051, 1.027, 0.968, 0.956, 1.007, 0.912], host_other_ms=2.319,
    host_overhead_ms=0.115)


def test_a_layout_whose_host_is_a_step_ahead_is_predicted_with_its_copies_back_to_back() -> None:
    """The first six Flux blocks resident at depth 1 ran 30.8 ms on the H200, six single-stream copies back to
    back: a step ahead, the host had issued each copy long before its slot freed. Made to wait for the
    device at each step's start, the host reaches block 6's hook only after 11.7 ms of dispatch and the
    prediction was 39.1 ms, which let calibration noise pick a depth-2 layout that ran 1.17x slower. (It is
    35.0 ms now that the last block's release starts block 7's copy while the host waits.)"""
    costs = BlockCosts(**_FLUX_4_8)
    first_six = tuple(range(6))
    assert simulate_step(costs, first_six, 1, host_waits=True).step_ms == pytest.approx(35.01, abs=0.01)
    assert simulate_step(costs, first_six, 1).step_ms == pytest.approx(33.27, abs=0.01)
    plan = plan_offload(costs, 4 * 679662592 + 4 * 283183616 + costs.activation_bytes)  # the 50 % row's budget
    assert len(plan.resident) == 6 and plan.prefetch_depth == 1 and set(range(4)) <= set(plan.resident)
    assert plan.predicted_step_ms < 0.9 * simulate_step(costs, (0, 1, 2, 3, 5), 2).step_ms


def test_host_figures_of_zero_predict_what_no_host_figures_do() -> None:
    rng = random.Random(5)
    for _ in range(6):
        bare = BlockCosts([rng.uniform(0.1, 3.0) for _ in range(7)], [rng.choice((1, 2)) * 40 * MiB for _ in range(7)],
                          GBPS, other_ms=rng.uniform(0.0, 1.0), block_overhead_ms=0.01)
        zero = dataclasses.replace(bare, host_ms=[0.0] * 7)
        for resident, depth in (((), 1), ((0, 3), 2), ((1, 2, 4, 5, 6), 3)):
            assert simulate_step(zero, resident, depth) == simulate_step(bare, resident, depth)


def test_host_figures_are_left_out_with_the_host_as_the_device() -> None:
    # There the compute timeline is the host's: a second host timeline would count its time twice.
    bare = BlockCosts([1.0] * 4, [BLOCK] * 4, GBPS, overlap=False)
    timed = dataclasses.replace(bare, host_ms=[3.0] * 4, host_overhead_ms=0.5)
    assert not timed.host_timed
    assert simulate_step(timed, (1,), 1) == simulate_step(bare, (1,), 1)


# Predictions of tables without host figures, taken before the host timeline existed: each table's step for
# four layouts ((), 1), ((0, n // 2), 2), ((1,), 1, not cyclic), (all resident, 1), and its plan at half the bytes
# plus three slots (resident set, depth, predicted, ideal).
_BEFORE = [
    ((10.792443200000005, 9.152999999999999, 10.708721600000008, 9.153), ((0, 1, 2, 3, 4), 1, 9.153, 9.153)),
    ((21.57916480000003, 18.83200000000003, 21.559164800000026, 18.712000000000003),
     ((0, 1, 2, 3, 4, 5, 6, 7), 1, 18.712000000000003, 18.712000000000003)),
    ((28.35219040000002, 25.07000000000002, 28.049886400000027, 24.709999999999997),
     ((0, 2, 3, 4, 6, 7, 8, 10), 1, 24.82999999999999, 24.709999999999997)),
    ((33.66440567272731, 33.47800000000002, 34.13692581818185, 32.758),
     ((1, 3, 4, 6, 7, 9, 10, 12, 13), 1, 33.05800000000001, 32.758)),
    ((18.582912000000007, 14.388608000000005, 16.485760000000006, 6.0), ((0, 1, 2, 3, 4, 5), 1, 6.0, 6.0)),
]


def _old_tables() -> list[BlockCosts]:
    tables = []
    for seed in range(4):
        rng = random.Random(300 + seed)
        n = 5 + seed * 3
        tables.append(BlockCosts([round(rng.uniform(0.2, 4.0), 3) for _ in range(n)],
                                 [rng.choice((1, 2, 3)) * 40 * MiB for _ in range(n)], 50.0,
                                 other_ms=round(rng.uniform(0.0, 1.0), 3), block_overhead_ms=0.02 * seed,
                                 copy_latency_ms=0.01 * seed, transfer_bytes=[30 * MiB] * n if seed == 3 else None))
    tables.append(BlockCosts([1.0] * 6, [100 * MiB] * 6, 50.0, overlap=False))
    return tables


@pytest.mark.parametrize("index", range(len(_BEFORE)))
def test_tables_without_host_figures_predict_exactly_as_before(index: int) -> None:
    costs = _old_tables()[index]
    steps, (resident, depth, predicted, ideal) = _BEFORE[index]
    n = costs.blocks
    layouts = (((), 1, True), ((0, n // 2), 2, True), ((1,), 1, False), (tuple(range(n)), 1, True))
    # Those predictions made every step wait for the one before it (host_waits); the planner now runs steps
    # back to back, which lifts that one constraint and so is never slower.
    assert tuple(simulate_step(costs, r, d, cyclic=c, host_waits=True).step_ms for r, d, c in layouts) == steps
    assert all(simulate_step(costs, r, d, cyclic=c).step_ms <= ms + 1e-9 for (r, d, c), ms in zip(layouts, steps))
    plan = plan_offload(costs, sum(costs.block_bytes) // 2 + 3 * max(costs.block_bytes))
    assert plan.predicted_step_ms <= predicted + 1e-9 and plan.ideal_ms == ideal
    assert plan.predicted_step_ms == simulate_step(costs, plan.resident, plan.prefetch_depth).step_ms
    assert plan.host_ms == 0.0 and not plan.host_bound and "host-bound" not in plan.why


def test_a_bytes_only_plan_has_no_host_timeline() -> None:
    from fastoffload_ext.planning.layout import resolve_layout

    model, _ = make_pair(4)
    plan = resolve_layout(list(model.blocks), torch.device("cpu"), "blocks", resident_blocks="auto",
                          prefetch_depth=None, device_budget=10 * MiB, activation_reserve=0).plan
    assert not plan.calibrated and plan.costs.host_ms is None and plan.host_ms == 0.0 and not plan.host_bound


# ---- the planner ---------------------------------------------------------------------------------

def test_a_launch_bound_plan_predicts_the_host_bound_and_says_so() -> None:
    costs = launch_bound(8, hooks_ms=0.1)
    plan = plan_offload(costs, 5 * BLOCK)  # 3 resident + 2 slots
    assert len(plan.resident) == 3 and plan.host_bound
    assert plan.predicted_step_ms == pytest.approx(8 * 1.0 + 5 * 0.1, rel=1e-12) == plan.host_ms
    assert plan.ideal_ms == pytest.approx(8.0)  # the host's dispatch without hooks: no layout beats it
    assert re.search(r"^host-bound: the host dispatches the step in 8\.500 ms \(0\.500 ms of it the hooks of 5 "
                     r"offloaded blocks, 100 us each\), the GPU computes it in \d+\.\d{3} ms; ", plan.why)
    assert plan.as_dict()["host_bound"] is True and plan.as_dict()["host_ms"] == plan.host_ms
    assert plan.explain().splitlines()[3] == (f"host: dispatches a step in 8.500 ms (0.500 ms of it the hooks), the "
                                              f"device's timelines alone {plan.device_ms:.3f} ms: host-bound")
    everything = plan_offload(costs, 8 * BLOCK)
    assert everything.predicted_step_ms == 8.0 and everything.why == (
        "every block fits the budget: nothing is copied; host-bound: the host dispatches the step in 8.000 ms, "
        "the GPU computes it in 0.400 ms")


def test_a_device_bound_plan_with_host_figures_does_not_claim_the_host() -> None:
    costs = BlockCosts([2.0] * 6, [BLOCK] * 6, GBPS, host_ms=[0.2] * 6, host_overhead_ms=0.02)
    plan = plan_offload(costs, 4 * BLOCK)
    assert not plan.host_bound and "host-bound" not in plan.why
    assert plan.predicted_step_ms == pytest.approx(12.0, rel=1e-12)


def test_the_hooks_host_cost_makes_fewer_offloaded_blocks_better() -> None:
    # Four large blocks and two small ones; the budget holds two slots and one large block or both small
    # ones. Every copy hides behind the host, so without the hooks' host cost the layouts tie and the one
    # keeping more bytes resident wins (one large block: five offloaded); with it, two small blocks resident
    # leave one offloaded block fewer, and that is one hook less per step.
    sizes = [BLOCK] * 4 + [BLOCK // 4] * 2
    free = launch_bound(6, sizes=sizes)
    plan = plan_offload(free, 3 * BLOCK)
    assert len(plan.resident) == 1 and plan.resident[0] < 4 and plan.predicted_step_ms == 6.0
    costly = dataclasses.replace(free, host_overhead_ms=0.1)
    plan = plan_offload(costly, 3 * BLOCK)
    assert plan.resident == (4, 5) and plan.predicted_step_ms == pytest.approx(6.0 + 4 * 0.1, rel=1e-12)
    assert plan.predicted_step_ms < simulate_step(costly, (0,), plan.prefetch_depth).step_ms


@pytest.mark.parametrize("seed", range(10))
def test_host_bound_tables_are_planned_optimally_by_brute_force(seed: int) -> None:
    rng = random.Random(400 + seed)
    costs = random_host_bound(rng, rng.randint(2, 6))
    for fraction in (0.3, 0.6, 1.0):
        budget = int(fraction * sum(costs.block_bytes)) + 4 * max(costs.block_bytes) + costs.activation_bytes
        plan = plan_offload(costs, budget)
        assert plan.predicted_step_ms == pytest.approx(brute_force(costs, budget), rel=1e-9, abs=1e-9)
        assert plan.device_bytes == footprint(costs, frozenset(plan.resident), plan.prefetch_depth) <= budget


@pytest.mark.parametrize("n, hooks_ms", [(9, 0.0), (10, 0.05), (10, 0.3)])
def test_the_heuristic_search_on_host_bound_tables_is_within_3_percent_of_brute_force(n: int, hooks_ms: float) -> None:
    costs = dataclasses.replace(launch_bound(n, host_ms=0.3, hooks_ms=hooks_ms), h2d_gbps=GBPS / 2)  # 0.42 ms copies
    for resident_fraction in (0.2, 0.5, 0.8):
        budget = int(resident_fraction * n) * BLOCK + 3 * BLOCK
        plan = plan_offload(costs, budget, exhaustive_limit=0)
        assert plan.predicted_step_ms <= 1.03 * brute_force(costs, budget)


def test_a_w3_shaped_table_predicts_the_host_and_its_hooks() -> None:
    # The H200's W3: 64 blocks, 5.25 ms of device compute, ~10 ms of host dispatch, 0.46 ms copies.
    block = int(0.46e-3 * GBPS * 1e9)
    costs = BlockCosts([5.25 / 64] * 64, [block] * 64, GBPS, host_ms=[10.0 / 64] * 64, host_overhead_ms=0.11)
    plan = plan_offload(costs, 50 * block)  # 75 %: 48 resident + 2 slots
    assert len(plan.resident) == 48 and plan.host_bound
    assert plan.predicted_step_ms == pytest.approx(10.0 + 16 * 0.11, rel=1e-9)  # not the device's 7.4 ms
    assert plan.device_ms == pytest.approx(7.36, abs=0.01)
    everything = plan_offload(costs, 64 * block)
    assert everything.predicted_step_ms == pytest.approx(10.0, rel=1e-12)  # not the device's 5.25 ms


@pytest.mark.parametrize("seed", range(4))
def test_host_bound_plans_are_monotone_in_budget_and_never_over_it(seed: int) -> None:
    rng = random.Random(500 + seed)
    costs = random_host_bound(rng, 14 if seed % 2 else 7)
    floor = 2 * max(costs.block_bytes) + costs.activation_bytes
    previous = None
    for budget in range(floor, sum(costs.block_bytes) + 5 * max(costs.block_bytes), 4 * MiB):
        plan = plan_offload(costs, budget)
        assert plan.device_bytes <= budget
        if previous is not None:
            assert plan.predicted_step_ms <= previous + 1e-9
        previous = plan.predicted_step_ms


@pytest.mark.parametrize("seed", range(5))
def test_host_bound_plans_are_stable_under_5_percent_noise(seed: int) -> None:
    rng = random.Random(600 + seed)
    clean = launch_bound(16, hooks_ms=0.08, host_other_ms=0.3)
    budget = 8 * BLOCK + 3 * BLOCK
    best = plan_offload(clean, budget).predicted_step_ms
    noisy = dataclasses.replace(
        clean, compute_ms=tuple(c * rng.uniform(0.95, 1.05) for c in clean.compute_ms),
        host_ms=tuple(h * rng.uniform(0.95, 1.05) for h in clean.host_ms),
        host_overhead_ms=clean.host_overhead_ms * rng.uniform(0.95, 1.05), h2d_gbps=GBPS * rng.uniform(0.95, 1.05))
    plan = plan_offload(noisy, budget)
    # The layout chosen on noisy figures, run on the true ones, is as good as the true optimum within 5 %.
    assert simulate_step(clean, plan.resident, plan.prefetch_depth).step_ms <= 1.05 * best
    assert len(plan.resident) == 9  # every block the budget holds stays (9 + 2 slots): each saves a hook


# ---- the cost table ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"host_ms": [1.0]}, "fastoffload: BlockCosts host_ms needs one dispatch time >= 0 (ms) per block: got [1.0] "
                         "for 2 blocks; pass None when the host was not timed"),
    ({"host_ms": [1.0, -0.5]}, "fastoffload: BlockCosts host_ms needs one dispatch time >= 0 (ms) per block: got "
                               "[1.0, -0.5] for 2 blocks"),
    ({"host_overhead_ms": -0.1}, "fastoffload: BlockCosts host_other_ms and host_overhead_ms must be >= 0 (ms), got "
                                 "0.0 and -0.1"),
    ({"host_other_ms": float("nan")}, "fastoffload: BlockCosts host_other_ms and host_overhead_ms must be >= 0 (ms), "
                                      "got nan and 0.0"),
])
def test_bad_host_figures(kwargs: dict, message: str) -> None:
    with pytest.raises(OffloadConfigError, match=re.escape(message)):
        BlockCosts([1.0, 1.0], [BLOCK, BLOCK], GBPS, **kwargs)


# ---- the calibration -----------------------------------------------------------------------------

def _measured(host_gaps: tuple[float, ...] | None, n: int = 6) -> Measurement:
    return Measurement(block_ms=(0.05,) * n, step_ms=10.0, other_ms=0.1, activation_bytes=None, repeats=5,
                       spread=0.0, gap_ms=(0.0,) * n, host_block_ms=(1.0,) * n, host_step_ms=10.0, host_other_ms=0.4,
                       host_gap_ms=host_gaps)


def test_host_overhead_is_the_offloaded_gaps_above_the_resident_ones() -> None:
    # Blocks 0-2 resident, 3-5 offloaded: gap 1 and 2 sit between resident blocks, 4 and 5 between offloaded.
    measured = _measured((0.0, 0.02, 0.03, 0.5, 0.12, 0.14))
    assert fit_host_overhead(measured, (0, 1, 2)) == pytest.approx(0.13 - 0.025)
    # Every block offloaded: nothing to subtract, the whole gap counts (errs towards residency).
    assert fit_host_overhead(measured, ()) == pytest.approx(0.12)  # median of 0.02, 0.03, 0.5, 0.12, 0.14
    assert fit_host_overhead(measured, range(6)) == 0.0  # no hook ran
    assert fit_host_overhead(_measured(None), ()) == 0.0  # a block ran twice: no gaps


def test_host_figures_go_into_a_gpu_table_only() -> None:
    measured = _measured((0.0, 0.1, 0.1, 0.1, 0.1, 0.1))
    gpu = BlockCosts(measured.block_ms, [BLOCK] * 6, GBPS)
    timed = with_host_figures(gpu, measured, ())
    assert timed.host_ms == (1.0,) * 6 and timed.host_other_ms == 0.4 and timed.host_overhead_ms == pytest.approx(0.1)
    assert with_host_figures(gpu, measured, None).host_overhead_ms == 0.0  # layout unknown: no hook fit
    host = dataclasses.replace(gpu, overlap=False)
    assert with_host_figures(host, measured, ()) is host


def test_a_starved_device_s_gaps_are_the_host_s_hooks_not_device_overhead() -> None:
    from fastoffload_ext.planning.calibration import fit_block_overhead

    # A launch-bound step measured on CUDA: the device waits for the host, so its gaps between blocks are
    # the hooks' host time (0.1 ms); the host's gaps say so directly.
    truth = dataclasses.replace(launch_bound(10, hooks_ms=0.1, host_other_ms=0.2), h2d_gbps=10 * GBPS)  # copies hide
    timeline = simulate_step(truth, (), 1)
    device_gaps = (0.0,) + tuple(timeline.block_start[i] - timeline.block_end[i - 1] for i in range(1, 10))
    assert device_gaps[1:] == pytest.approx((0.1,) * 9)
    measured = Measurement(block_ms=truth.compute_ms, step_ms=timeline.step_ms, other_ms=0.0, activation_bytes=None,
                           repeats=5, spread=0.0, gap_ms=device_gaps, host_block_ms=truth.host_ms,
                           host_step_ms=timeline.step_ms, host_other_ms=0.2, host_gap_ms=(0.0,) + (0.1,) * 9)
    bare = BlockCosts(truth.compute_ms, truth.block_bytes, truth.h2d_gbps)
    # Without the host's figures the device's gaps read as device overhead; with them they are explained.
    assert fit_block_overhead(bare, measured, (), 1) == pytest.approx(0.1)
    fitted = with_host_figures(bare, measured, ())
    assert fitted.host_overhead_ms == pytest.approx(0.1)
    assert fit_block_overhead(fitted, measured, (), 1) == pytest.approx(0.0, abs=1e-9)
    for resident in ((), (2, 7), tuple(range(10))):
        assert simulate_step(fitted, resident, 1).step_ms == pytest.approx(simulate_step(truth, resident, 1).step_ms)


def test_on_the_cpu_the_host_clock_is_the_device_clock() -> None:
    model, _ = make_pair(4)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    measured = measure_blocks(list(model.blocks), lambda: model(x), torch.device("cpu"), repeats=3)
    assert measured.host_block_ms == measured.block_ms and measured.host_step_ms == measured.step_ms
    assert measured.host_gap_ms == measured.gap_ms and measured.host_other_ms == measured.other_ms
    assert len(measured.block_ms) == 4 and measured.gap_ms is not None and measured.gap_ms[0] == 0.0
    costs, _ = calibrate_costs(list(model.blocks), lambda: model(x), torch.device("cpu"), [BLOCK] * 4, h2d_gbps=GBPS,
                               repeats=3, depth=1)
    assert costs.host_ms is None and not costs.host_timed  # one timeline there, already the host's


def test_the_host_pass_leaves_the_drains_out() -> None:
    from fastoffload_ext.planning.calibration import BlockTimer, _drained_host_clock, _Mark

    cpu = torch.device("cpu")

    def mark(host: float, resumed: float | None = None) -> _Mark:
        m = _Mark(cpu)
        m.host, m.resumed = host, resumed
        return m

    # Host seconds: the step begins at 0; block 0 dispatches 0.001..0.003 and its drain waits until 0.010;
    # block 1's hooks run 0.010..0.0105, it dispatches until 0.0125, drains until 0.020; the step returns at 0.0204.
    timers = [BlockTimer(cpu), BlockTimer(cpu)]
    timers[0].spans.append((mark(0.001), mark(0.003, 0.010)))
    timers[1].spans.append((mark(0.0105), mark(0.0125, 0.020)))
    clock = _drained_host_clock(timers, mark(0.0), mark(0.0204))
    assert clock.block_ms == pytest.approx([2.0, 2.0]) and clock.gaps == pytest.approx([0.0, 0.5])
    assert clock.other_ms == pytest.approx(1.0 + 0.4) and clock.step_ms == pytest.approx(4.0 + 0.5 + 1.4)


def test_each_host_figure_is_the_smaller_of_the_timed_steps_and_the_host_pass() -> None:
    from fastoffload_ext.planning.calibration import _least_host

    # Block 0 waited for a full launch queue in the timed steps (5.0 against 2.0 drained); block 1 started
    # cold after a drain (3.0 against 1.5 timed). Gaps and the time outside the blocks likewise.
    drained = ((2.0, 3.0), 99.0, 0.8, (0.0, 0.9))
    block, other, gaps = _least_host(drained, (5.0, 1.5), 0.6, (0.0, 0.4))
    assert block == (2.0, 1.5) and other == 0.6 and gaps == (0.0, 0.4)
    # Timed steps without gaps (a block ran twice): the host pass's gaps stand.
    assert _least_host(drained, (5.0, 1.5), 0.6, None)[2] == (0.0, 0.9)


def test_a_host_pass_on_the_cpu_gives_host_figures_beside_the_timed_ones() -> None:
    model, _ = make_pair(4)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    measured = measure_blocks(list(model.blocks), lambda: model(x), torch.device("cpu"), repeats=3, host_pass=True)
    assert measured.host_block_ms is not None and len(measured.host_block_ms) == 4
    assert all(h > 0 for h in measured.host_block_ms)
    assert measured.host_gap_ms is not None and measured.host_gap_ms[0] == 0.0 and min(measured.host_gap_ms) >= 0.0
    assert measured.host_other_ms is not None and measured.host_other_ms >= 0.0
    assert measured.host_step_ms == measured.step_ms  # the step's host time is the timed steps', one clock here
    assert not any(has_hooks(block) for block in model.blocks)


# ---- plans from host-bound tables run bit for bit ------------------------------------------------

@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_host_bound_plan_is_bit_exact(device: str, backend: str) -> None:
    from fastoffload_ext.planning import module_packed_bytes

    model, reference = make_pair(6, seed=3)
    model.requires_grad_(False)
    target = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    reference.requires_grad_(False).to(target)
    place_outside_blocks(model, device)
    size = module_packed_bytes(model.blocks[0])
    costs = BlockCosts([0.05] * 6, [size] * 6, GBPS, host_ms=[1.0] * 6, host_overhead_ms=0.1)
    plan = plan_offload(costs, 4 * size)
    assert plan.host_bound and len(plan.resident) == 2
    fo.enable_layerwise_offload(model, device=device, backend=backend, plan=plan)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4)).to(target)
    with torch.inference_mode():
        want = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_cuda_calibration_measures_the_host_dispatch_of_each_block() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model, reference = make_pair(12)
    model.requires_grad_(False)
    reference.requires_grad_(False).to(device)
    place_outside_blocks(model, "cuda")
    group = fo.enable_layerwise_offload(model, device=device, prefetch_depth=1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(device)
    measured = measure_blocks(group.blocks, lambda: model(x), device, repeats=3)
    assert measured.host_block_ms is not None and len(measured.host_block_ms) == 12
    assert all(h > 0 for h in measured.host_block_ms) and measured.host_gap_ms is not None
    # The host pass: each gap runs from a drain's end to the next block's start, in program order.
    assert measured.host_gap_ms[0] == 0.0 and min(measured.host_gap_ms) >= 0.0
    assert measured.host_other_ms is not None and measured.host_other_ms >= 0.0
    assert measured.host_step_ms is not None and measured.host_step_ms > 0.0
    costs = group.calibrate(lambda: model(x), replan=False)
    assert costs.host_timed and costs.host_ms is not None and len(costs.host_ms) == 12
    assert costs.host_overhead_ms >= 0.0
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
