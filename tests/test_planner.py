"""The residency planner and the pipeline simulation on synthetic cost tables (pure functions, no engine)."""
from __future__ import annotations

import itertools
import random
import re

import pytest

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, OffloadPlan, plan_offload, simulate_step

MiB = 1024**2
BLOCK = 100 * MiB
GBPS = 50.0
COPY_MS = BLOCK / (GBPS * 1e6)  # 2.097 ms per block


def uniform(n: int, compute_ms: float, activation: int = 0, other_ms: float = 0.0) -> BlockCosts:
    return BlockCosts([compute_ms] * n, [BLOCK] * n, GBPS, other_ms=other_ms, activation_bytes=activation)


def random_costs(rng: random.Random, n: int) -> BlockCosts:
    return BlockCosts([rng.uniform(0.2, 4.0) for _ in range(n)], [rng.choice((1, 2, 3)) * 40 * MiB for _ in range(n)],
                      GBPS, other_ms=rng.uniform(0.0, 1.0), activation_bytes=rng.choice((0, 10 * MiB)))


def footprint(costs: BlockCosts, resident: frozenset[int], depth: int) -> tuple[int, int]:
    """(device bytes, host bytes), computed here independently of the planner."""
    off = [costs.block_bytes[b] for b in range(costs.blocks) if b not in resident]
    slots = (depth + 1) * max(off) if off else 0
    return sum(costs.block_bytes[b] for b in resident) + slots + costs.activation_bytes, sum(off)


def brute_force(costs: BlockCosts, budget: int | None, host_budget: int | None = None,
                depths: tuple[int, ...] = (1, 2, 3), keep: frozenset[int] = frozenset()) -> float | None:
    best = None
    for r in range(costs.blocks + 1):
        for chosen in itertools.combinations(range(costs.blocks), r):
            if not keep <= set(chosen):
                continue
            for depth in depths:
                device, host = footprint(costs, frozenset(chosen), depth)
                if (budget is not None and device > budget) or (host_budget is not None and host > host_budget):
                    continue
                ms = simulate_step(costs, chosen, depth).step_ms
                best = ms if best is None else min(best, ms)
    return best


# ---- the simulation ------------------------------------------------------------------------------

@pytest.mark.parametrize("compute_ms", [0.5, COPY_MS, 5.0])
def test_uniform_pipeline_runs_at_the_slower_of_compute_and_copy(compute_ms: float) -> None:
    costs = uniform(8, compute_ms)
    timeline = simulate_step(costs, [], 1)
    assert timeline.step_ms == pytest.approx(8 * max(compute_ms, COPY_MS), rel=1e-9)
    assert timeline.copies == 8 and timeline.copied_bytes == 8 * BLOCK


def test_all_resident_costs_compute_only_and_no_copy() -> None:
    costs = uniform(4, 1.0, other_ms=0.5)
    timeline = simulate_step(costs, range(4), 2)
    assert timeline.step_ms == pytest.approx(4.5) and timeline.copies == 0 and timeline.exposed_ms == 0.0


def test_host_as_device_serialises_copies_with_compute() -> None:
    costs = BlockCosts([1.0] * 4, [BLOCK] * 4, GBPS, overlap=False)
    assert simulate_step(costs, [], 1).step_ms == pytest.approx(4 * (1.0 + COPY_MS))
    assert simulate_step(costs, [0], 1).step_ms == pytest.approx(4.0 + 3 * COPY_MS)
    assert simulate_step(costs, [0, 2], 3).step_ms == pytest.approx(4.0)  # four slots keep both offloaded blocks


def test_a_short_window_exposes_its_copy_and_depth_borrows_from_a_long_one() -> None:
    # Block 1 is fast, block 2's copy must hide behind it alone at depth 1; at depth 2 it starts during block 0.
    costs = BlockCosts([3.0, 0.1, 3.0, 3.0], [BLOCK] * 4, GBPS)
    shallow = simulate_step(costs, [], 1)
    deep = simulate_step(costs, [], 2)
    assert shallow.exposed_ms == pytest.approx(COPY_MS - 0.1, rel=1e-6)
    assert deep.step_ms == pytest.approx(9.1, rel=1e-9) and deep.exposed_ms == pytest.approx(0.0, abs=1e-9)


def test_a_list_that_fits_the_slots_is_copied_once() -> None:
    costs = uniform(2, 0.1)
    assert simulate_step(costs, [], 2).copies == 0  # three slots hold both blocks after the first step


def test_non_cyclic_steps_start_with_a_synchronous_load() -> None:
    costs = uniform(4, 5.0)
    # When each step waits for the one before it, nothing loads block 0 ahead of it.
    assert simulate_step(costs, [], 1, cyclic=False, host_waits=True).step_ms == pytest.approx(COPY_MS + 20.0)
    # Back to back the host is already at the next step's first hook: its load runs in the slot block 2 left
    # free, behind block 3 of the step before.
    assert simulate_step(costs, [], 1, cyclic=False).step_ms == pytest.approx(20.0)
    assert simulate_step(costs, [], 1, cyclic=True).step_ms == pytest.approx(20.0)


# ---- the planner ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_optimal_on_small_tables_by_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 6))
    total = sum(costs.block_bytes)
    for fraction in (0.3, 0.6, 1.0, 2.0):
        budget = int(fraction * total) + 4 * max(costs.block_bytes) + costs.activation_bytes
        plan = plan_offload(costs, budget)
        assert plan.predicted_step_ms == pytest.approx(brute_force(costs, budget), rel=1e-9, abs=1e-9)
        assert plan.device_bytes == footprint(costs, frozenset(plan.resident), plan.prefetch_depth)[0] <= budget


@pytest.mark.parametrize("seed", range(8))
def test_kept_blocks_are_in_every_plan_which_is_optimal_among_those_sets(seed: int) -> None:
    """keep_resident (the blocks enable finds tied to another block or to the rest of the model) is in every
    searched plan, the plan is the brute-force best among the sets that hold it, and a budget too small for
    it is refused naming those blocks."""
    rng = random.Random(200 + seed)
    n = rng.randint(3, 6)
    costs = random_costs(rng, n)
    keep = frozenset(rng.sample(range(n), rng.randint(1, 2)))
    total = sum(costs.block_bytes)
    for fraction in (0.3, 0.6, 1.0, 2.0):
        budget = int(fraction * total) + 4 * max(costs.block_bytes) + costs.activation_bytes
        want = brute_force(costs, budget, keep=keep)
        if want is None:
            with pytest.raises(OffloadConfigError, match=r"whose weights are tied to another block"):
                plan_offload(costs, budget, keep_resident=keep)
            continue
        plan = plan_offload(costs, budget, keep_resident=keep)
        assert keep <= set(plan.resident) and plan.device_bytes <= budget
        assert plan.predicted_step_ms == pytest.approx(want, rel=1e-9, abs=1e-9)
    # Too small for the kept blocks and two slots: refused with their numbers, whatever else would fit.
    kept = sum(costs.block_bytes[b] for b in keep)
    with pytest.raises(OffloadConfigError, match=r"too small for %d resident blocks \(.*: blocks %s, whose weights"
                       % (len(keep), ", ".join(map(str, sorted(keep))))):
        plan_offload(costs, kept + costs.activation_bytes, keep_resident=keep)
    # A fixed resident set is taken as given; indices out of range are refused.
    assert plan_offload(costs, None, resident=(), keep_resident=keep).resident == ()
    with pytest.raises(OffloadConfigError, match=r"keep_resident block indices must be integers in 0..%d" % (n - 1)):
        plan_offload(costs, None, keep_resident=[n])


@pytest.mark.parametrize("n, compute_ms", [(9, 0.5), (9, 1.8), (10, 1.0), (12, 2.0)])
def test_heuristic_search_is_within_3_percent_of_brute_force(n: int, compute_ms: float) -> None:
    costs = uniform(n, compute_ms)
    for resident_fraction in (0.2, 0.5, 0.8):
        budget = int(resident_fraction * n) * BLOCK + 3 * BLOCK
        plan = plan_offload(costs, budget, exhaustive_limit=0)
        assert plan.candidates > 0
        assert plan.predicted_step_ms <= 1.03 * brute_force(costs, budget, depths=(1, 2))


@pytest.mark.parametrize("seed", range(4))
def test_monotone_in_budget_and_never_over_it(seed: int) -> None:
    rng = random.Random(100 + seed)
    costs = random_costs(rng, 14 if seed % 2 else 7)
    floor = 2 * max(costs.block_bytes) + costs.activation_bytes
    previous = None
    for budget in range(floor, sum(costs.block_bytes) + 5 * max(costs.block_bytes), 20 * MiB):
        plan = plan_offload(costs, budget)
        assert plan.device_bytes <= budget
        assert plan.resident_bytes + plan.num_slots * plan.slot_bytes + plan.activation_bytes == plan.device_bytes
        if previous is not None:
            assert plan.predicted_step_ms <= previous + 1e-9
        previous = plan.predicted_step_ms


def test_host_budget_forces_blocks_resident_and_is_respected() -> None:
    costs = uniform(6, 0.1)
    plan = plan_offload(costs, 10 * BLOCK, host_budget=2 * BLOCK)
    assert plan.host_bytes <= 2 * BLOCK and len(plan.resident) >= 4
    assert plan.predicted_step_ms == pytest.approx(brute_force(costs, 10 * BLOCK, 2 * BLOCK))


@pytest.mark.parametrize("seed", range(5))
def test_stable_under_measurement_noise(seed: int) -> None:
    rng = random.Random(200 + seed)
    clean = uniform(16, 1.0)
    budget = 8 * BLOCK + 3 * BLOCK
    best = plan_offload(clean, budget).predicted_step_ms
    noisy = BlockCosts([c * rng.uniform(0.8, 1.2) for c in clean.compute_ms], clean.block_bytes,
                       GBPS * rng.uniform(0.9, 1.1))
    plan = plan_offload(noisy, budget)
    # The layout chosen on noisy figures, run on the true ones, is as good as the true optimum within 5 %.
    assert simulate_step(clean, plan.resident, plan.prefetch_depth).step_ms <= 1.05 * best


def test_half_the_bytes_resident_halves_a_transfer_bound_step_at_the_ideal() -> None:
    costs = uniform(16, 0.5)  # transfer-bound: copy 2.1 ms per block against 0.5 ms of compute
    everything = plan_offload(costs, 2 * BLOCK)
    half = plan_offload(costs, 8 * BLOCK + 2 * BLOCK)
    assert everything.resident == () and everything.prefetch_depth == 1
    assert len(half.resident) == 8
    assert half.predicted_step_ms <= 1.05 * half.ideal_ms
    assert half.predicted_step_ms <= 0.55 * everything.predicted_step_ms


def test_compute_bound_hides_every_copy_and_still_uses_the_budget() -> None:
    tight = plan_offload(uniform(8, 5.0), 2 * BLOCK)
    assert tight.resident == () and tight.prefetch_depth == 1 and tight.num_slots == 2
    assert "compute-bound" in tight.why and tight.predicted_step_ms == pytest.approx(40.0)
    # Residency costs nothing the simulation sees, and it saves what it does not see (hook cost, copies).
    roomy = plan_offload(uniform(8, 5.0), 5 * BLOCK)
    assert len(roomy.resident) == 3 and roomy.predicted_step_ms == pytest.approx(40.0)


def test_uncalibrated_costs_keep_the_most_bytes_resident_at_depth_1() -> None:
    costs = BlockCosts([0.0] * 10, [BLOCK] * 10, GBPS, calibrated=False)
    plan = plan_offload(costs, 6 * BLOCK)
    assert len(plan.resident) == 4 and plan.prefetch_depth == 1 and not plan.calibrated
    assert plan.why.startswith("not calibrated")
    assert plan.drifted(1.0)  # an uncalibrated prediction never vouches for a step


def test_uncalibrated_why_names_the_depth_the_plan_has() -> None:
    costs = BlockCosts([0.0] * 10, [BLOCK] * 10, GBPS, calibrated=False)
    plan = plan_offload(costs, 6 * BLOCK, prefetch_depth=2)
    assert plan.prefetch_depth == 2 and ", depth 2; call group.calibrate(step)" in plan.why  # it said depth 1


def test_everything_fits_means_nothing_is_copied() -> None:
    plan = plan_offload(uniform(4, 0.1), 4 * BLOCK)
    assert plan.resident == (0, 1, 2, 3) and plan.num_slots == 0 and plan.slot_bytes == 0
    assert plan.why == "every block fits the budget: nothing is copied"


def test_no_budget_plans_everything_resident() -> None:
    assert plan_offload(uniform(3, 0.1)).resident == (0, 1, 2)


def test_fixed_depth_and_fixed_resident_set() -> None:
    costs = uniform(8, 0.5)
    assert plan_offload(costs, 20 * BLOCK, prefetch_depth=3).prefetch_depth == 3
    plan = plan_offload(costs, 20 * BLOCK, resident=[1, 5])
    assert plan.resident == (1, 5) and plan.prefetch_depth in (1, 2, 3)


def test_a_fixed_depth_beyond_the_offloaded_blocks_counts_the_slots_the_engine_makes() -> None:
    # enable runs prefetch_depth clamped to the offloaded blocks (2 here: 3 slots), so the plan counts
    # those slots: it counted depth + 1 = 6 and refused a budget the engine fits in.
    costs = uniform(6, 0.5)
    plan = plan_offload(costs, 7 * BLOCK, resident=[0, 1, 2, 3], prefetch_depth=5)
    assert (plan.prefetch_depth, plan.num_slots, plan.device_bytes) == (2, 3, 7 * BLOCK)
    with pytest.raises(OffloadConfigError) as raised:
        plan_offload(costs, 6 * BLOCK, resident=[0, 1, 2, 3], prefetch_depth=5)
    assert str(raised.value) == (
        "fastoffload: device_budget 600.0 MiB is too small for 4 resident blocks (400.0 MiB) + 3 slots x 100.0 MiB + "
        "0 B activation reserve = 700.0 MiB; keep fewer blocks resident, use resident_blocks='auto', or raise "
        "device_budget")
    with pytest.raises(OffloadConfigError) as raised:
        plan_offload(uniform(2, 0.5), BLOCK, prefetch_depth=5)
    assert str(raised.value).startswith("fastoffload: device_budget 100.0 MiB is smaller than what offload needs at "
                                        "least: 3 slots x 100.0 MiB (the largest block)")


def test_offloaded_blocks_that_fit_the_slots_are_not_counted_as_copied_every_step() -> None:
    # Two offloaded blocks in two slots stay there: the step copies nothing. The plan said "transfer-bound"
    # and "predicted 0.400 ms = 0.095x the ideal 4.194 ms", an ideal that counted copies never made.
    plan = plan_offload(uniform(4, 0.1), 4 * BLOCK, resident=[0, 1], prefetch_depth=1)
    assert plan.num_slots == 2 and simulate_step(plan.costs, plan.resident, 1).copies == 0
    assert plan.copy_ms == 0.0 and plan.ideal_ms == pytest.approx(0.4) == plan.predicted_step_ms
    assert plan.why == ("compute-bound: compute 0.400 ms vs copies of the offloaded bytes 0.000 ms; the 2 offloaded "
                        "blocks fit the 2 slots: each is copied once, not every step; predicted 0.400 ms = 1.000x the "
                        "ideal 0.400 ms")
    assert plan.explain().splitlines()[2] == "moved per step: none after the first step (200.0 MiB stays in the slots)"
    # One slot fewer than the offloaded blocks: every one is copied every step, as before.
    copied = plan_offload(uniform(4, 0.1), 4 * BLOCK, resident=[0], prefetch_depth=1)
    assert copied.copy_ms == pytest.approx(3 * COPY_MS) and copied.explain().splitlines()[2] == "moved per step: 300.0 MiB raw"


def test_drift_tolerance() -> None:
    plan = plan_offload(uniform(4, 1.0), 3 * BLOCK)
    assert not plan.drifted(plan.predicted_step_ms * 1.1)
    assert plan.drifted(plan.predicted_step_ms * 1.2) and plan.drifted(plan.predicted_step_ms * 0.8)
    assert isinstance(plan, OffloadPlan) and plan.as_dict()["resident"] == list(plan.resident)


# ---- refusals ------------------------------------------------------------------------------------

REFUSALS = [
    pytest.param(dict(device_budget=BLOCK), re.escape(
        "fastoffload: device_budget 100.0 MiB is smaller than what offload needs at least: 2 slots x 100.0 MiB (the "
        "largest block) + 10.0 MiB activation reserve = 210.0 MiB. Raise device_budget to at least 210.0 MiB, lower "
        "prefetch_depth, or lower activation_reserve"), id="device_budget_below_two_slots"),
    pytest.param(dict(device_budget=5 * BLOCK, resident=[0, 1, 2]), re.escape(
        "fastoffload: device_budget 500.0 MiB is too small for 3 resident blocks (300.0 MiB) + 2 slots x 100.0 MiB + "
        "10.0 MiB activation reserve = 510.0 MiB; keep fewer blocks resident, use resident_blocks='auto', or raise "
        "device_budget"), id="fixed_resident_over_budget"),
    pytest.param(dict(device_budget=3 * BLOCK, host_budget=BLOCK), re.escape(
        "fastoffload: host_budget 100.0 MiB is too small: no resident set that fits device_budget 300.0 MiB leaves "
        "the offloaded blocks' pinned copies within it (all 4 blocks need 400.0 MiB). Raise host_budget (free host "
        "memory), or raise device_budget so that more blocks stay resident"), id="host_budget_too_small"),
    pytest.param(dict(device_budget="1GiB"), re.escape(
        "fastoffload: plan_offload's device_budget must be None or bytes >= 0 (parse strings with "
        "planning.parse_size), got '1GiB'"), id="string_budget_to_the_pure_function"),
    pytest.param(dict(resident=[4]), re.escape(
        "fastoffload: resident block indices must be integers in 0..3, got [4]"), id="resident_index_out_of_range"),
    pytest.param(dict(device_budget=10 * BLOCK, resident=[0], host_budget=BLOCK), re.escape(
        "fastoffload: host_budget 100.0 MiB cannot hold the 300.0 MiB of pinned host copies that the 3 offloaded blocks "
        "need; keep more blocks resident, or raise host_budget"), id="fixed_resident_over_host_budget"),
    pytest.param(dict(max_depth=0), re.escape(
        "fastoffload: plan_offload's max_depth must be an integer >= 1, got 0"), id="max_depth_zero"),
    pytest.param(dict(cyclic="no"), re.escape(
        "fastoffload: plan_offload's cyclic must be True or False, got 'no'"), id="string_cyclic"),
    pytest.param(dict(prefetch_depth=-1), re.escape(
        "fastoffload: plan_offload's prefetch_depth must be None or an integer >= 0, got -1"), id="negative_depth"),
]


@pytest.mark.parametrize("kwargs, message", REFUSALS)
def test_refusals(kwargs: dict, message: str) -> None:
    with pytest.raises(OffloadConfigError) as raised:
        plan_offload(uniform(4, 1.0, activation=10 * MiB), **kwargs)
    assert re.fullmatch(message, str(raised.value)), str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_simulate_refuses_a_negative_depth() -> None:
    with pytest.raises(OffloadConfigError, match=re.escape("fastoffload: simulate_step's depth must be an integer >= 0, "
                                                           "got -1")):
        simulate_step(uniform(2, 1.0), [], -1)


def test_bad_cost_tables() -> None:
    with pytest.raises(OffloadConfigError, match=re.escape("fastoffload: BlockCosts needs one compute time per block: "
                                                           "got 2 compute times for 3 blocks")):
        BlockCosts([1.0, 1.0], [1, 2, 3], GBPS)
    with pytest.raises(OffloadConfigError, match=re.escape("fastoffload: BlockCosts h2d_gbps must be > 0 (GB/s), "
                                                           "got 0.0")):
        BlockCosts([1.0], [1], 0.0)
    with pytest.raises(OffloadConfigError, match=re.escape("fastoffload: BlockCosts compute times and bytes must be "
                                                           ">= 0, got compute [-1.0], bytes [1], other 0.0")):
        BlockCosts([-1.0], [1], GBPS)



NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, message", [
    pytest.param(dict(compute_ms=[NAN, 1.0]), "compute_ms must be finite numbers (ms), got [nan, 1.0]", id="nan_compute"),
    pytest.param(dict(compute_ms=[INF, 1.0]), "compute_ms must be finite numbers (ms), got [inf, 1.0]", id="inf_compute"),
    pytest.param(dict(compute_ms=[True, 1.0]), "compute_ms must be finite numbers (ms), got [True, 1.0]",
                 id="bool_compute"),
    pytest.param(dict(other_ms=NAN), "other_ms must be a finite number, got nan", id="nan_other"),
    pytest.param(dict(block_overhead_ms=NAN), "block_overhead_ms must be a finite number, got nan", id="nan_overhead"),
    pytest.param(dict(copy_latency_ms=NAN), "copy_latency_ms must be a finite number, got nan", id="nan_latency"),
    pytest.param(dict(h2d_gbps=INF), "h2d_gbps must be a finite number, got inf", id="inf_bandwidth"),
    pytest.param(dict(host_ms=[INF, 1.0]), "host_ms needs one dispatch time >= 0 (ms) per block: got [inf, 1.0] for 2 "
                 "blocks; pass None when the host was not timed", id="inf_host"),
    pytest.param(dict(host_overhead_ms=INF), "host_other_ms and host_overhead_ms must be >= 0 (ms), got 0.0 and inf",
                 id="inf_host_overhead"),
    pytest.param(dict(block_bytes=[BLOCK + 0.5, BLOCK]), f"block_bytes must be whole numbers of bytes, got "
                 f"[{BLOCK + 0.5}, {BLOCK}]", id="fractional_bytes"),
    pytest.param(dict(block_bytes=[True, BLOCK]), f"block_bytes must be whole numbers of bytes, got [True, {BLOCK}]",
                 id="bool_bytes"),
    pytest.param(dict(transfer_bytes=[NAN, 1]), "transfer_bytes must be whole numbers of bytes, got [nan, 1]",
                 id="nan_transfer_bytes"),
    pytest.param(dict(activation_bytes=-BLOCK), f"activation_bytes must be bytes >= 0, got {-BLOCK}",
                 id="negative_activation"),
    pytest.param(dict(activation_bytes=0.5), "activation_bytes must be bytes >= 0, got 0.5", id="fractional_activation"),
    pytest.param(dict(overlap="no"), "overlap must be True or False, got 'no'", id="string_overlap"),
])
def test_cost_tables_refuse_numbers_the_planner_cannot_use(kwargs: dict, message: str) -> None:
    # NaN passed every ">= 0" check and failed in the planner's round() (or, elsewhere, made its
    # comparisons arbitrary); a negative activation reserve let a plan hold more than the budget.
    table = dict(compute_ms=[1.0, 1.0], block_bytes=[BLOCK, BLOCK], h2d_gbps=GBPS) | kwargs
    with pytest.raises(OffloadConfigError) as raised:
        BlockCosts(**table)
    assert str(raised.value) == "fastoffload: BlockCosts " + message


def test_cost_tables_take_numpy_numbers_and_whole_floats_and_generators() -> None:
    np = pytest.importorskip("numpy")
    costs = BlockCosts((c for c in [np.float32(1.0), 2]), [np.int64(BLOCK), float(BLOCK)], np.float64(GBPS),
                       activation_bytes=np.int64(MiB))
    assert costs.compute_ms == (1.0, 2.0) and costs.block_bytes == (BLOCK, BLOCK) and costs.activation_bytes == MiB
    assert type(costs.activation_bytes) is int


# ---- a ring of two kinds of block: Flux's double-stream and single-stream blocks at a balanced size ------

DOUBLE_BYTES = int(14.0 * GBPS * 1e6)  # 14 ms to copy, 9 ms to compute: copy-bound
SINGLE_BYTES = int(4.0 * GBPS * 1e6)   # 4 ms to copy, 6 ms to compute: compute-bound


def flux_ring(doubles: int, singles: int) -> BlockCosts:
    return BlockCosts([9.0] * doubles + [6.0] * singles, [DOUBLE_BYTES] * doubles + [SINGLE_BYTES] * singles, GBPS)


def test_a_mixed_ring_costs_the_per_block_schedule_not_the_slower_of_the_sums() -> None:
    costs = flux_ring(19, 38)
    per_block = sum(max(c, costs.copy_ms(b)) for b, c in enumerate(costs.compute_ms))  # 19 x 14 + 38 x 6 ms
    sums = max(sum(costs.compute_ms), sum(map(costs.copy_ms, range(costs.blocks))))
    plan = plan_offload(costs, 2 * DOUBLE_BYTES)
    assert plan.resident == () and plan.prefetch_depth == 1
    assert plan.predicted_step_ms == pytest.approx(per_block, rel=0.01)
    assert plan.predicted_step_ms > 1.15 * sums and plan.ideal_ms == pytest.approx(sums)


@pytest.mark.parametrize("extra", [1, 3, 6, 10])
def test_a_mixed_ring_keeps_copy_bound_blocks_resident_and_predicts_their_schedule(extra: int) -> None:
    costs = flux_ring(19, 38)
    budget = 2 * DOUBLE_BYTES + extra * DOUBLE_BYTES
    plan = plan_offload(costs, budget)
    assert plan.device_bytes <= budget
    assert plan.resident and all(b < 19 for b in plan.resident), plan.resident  # double-stream blocks only
    assert plan.predicted_step_ms == simulate_step(costs, plan.resident, plan.prefetch_depth).step_ms
    assert plan.predicted_step_ms < plan_offload(costs, 2 * DOUBLE_BYTES).predicted_step_ms
    if extra == 10:  # half the copy-bound blocks kept, spread among them: every other copy hides
        assert plan.predicted_step_ms == pytest.approx(sum(costs.compute_ms))


@pytest.mark.parametrize("extra", [1, 2, 3, 5])
def test_a_mixed_ring_search_matches_brute_force_on_the_cut_ring(extra: int) -> None:
    costs = flux_ring(4, 8)  # the budgets section's Flux: 4 double-stream + 8 single-stream blocks
    budget = 2 * DOUBLE_BYTES + extra * DOUBLE_BYTES
    plan = plan_offload(costs, budget, exhaustive_limit=0)
    assert plan.predicted_step_ms == pytest.approx(brute_force(costs, budget), rel=1e-9)
