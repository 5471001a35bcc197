"""The cost model's fixed per-block cost and compressed copies: simulation, calibration fit, planner, engine."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, plan_offload, simulate_step
from fastoffload_ext.planning.calibration import Measurement, fit_block_overhead, probe_bytes_for
from fastoffload_ext.planning.compressed import estimate_transfer_bytes
from fastoffload_ext.planning.costs import module_packed_bytes

from ._models import make_pair, place_outside_blocks

MiB = 1024**2
BLOCK = 100 * MiB
GBPS = 50.0
COPY_MS = BLOCK / (GBPS * 1e6)


def uniform(n: int, compute_ms: float, **extra) -> BlockCosts:
    return BlockCosts([compute_ms] * n, [BLOCK] * n, GBPS, **extra)


# --- the fixed per-block cost -------------------------------------------------------------------------------


def test_overhead_is_paid_by_each_offloaded_block_and_not_by_resident_ones() -> None:
    bare = uniform(8, 4.0)  # compute-bound: every copy hides
    costly = dataclasses.replace(bare, block_overhead_ms=0.05)
    for resident in ((), (1, 5), (0, 2, 4, 6)):
        offloaded = 8 - len(resident)
        step = simulate_step(costly, resident, 1).step_ms
        assert step == pytest.approx(simulate_step(bare, resident, 1).step_ms + 0.05 * offloaded)
    assert simulate_step(costly, range(8), 1).step_ms == pytest.approx(32.0)


def test_overhead_makes_a_compute_bound_plan_keep_what_fits_resident() -> None:
    costs = uniform(8, 4.0, block_overhead_ms=0.05)
    plan = plan_offload(costs, 5 * BLOCK)
    assert len(plan.resident) == 3  # 3 resident + 2 slots
    assert plan.predicted_step_ms == pytest.approx(32.0 + 5 * 0.05)
    assert plan.overhead_ms == pytest.approx(0.25)
    assert "per offloaded block" in plan.why


def _measured_from(costs: BlockCosts, resident: tuple[int, ...], depth: int) -> Measurement:
    timeline = simulate_step(costs, resident, depth)
    gaps = [0.0] + [timeline.block_start[i] - timeline.block_end[i - 1] for i in range(1, costs.blocks)]
    return Measurement(block_ms=costs.compute_ms, step_ms=timeline.step_ms, other_ms=costs.other_ms,
                       activation_bytes=None, repeats=5, spread=0.0, gap_ms=tuple(gaps))


@pytest.mark.parametrize("overhead", [0.0, 0.02, 0.3])
def test_fit_recovers_the_overhead_of_a_compute_bound_step(overhead: float) -> None:
    truth = uniform(10, 3.0, block_overhead_ms=overhead)
    measured = _measured_from(truth, (), 1)
    fitted = fit_block_overhead(dataclasses.replace(truth, block_overhead_ms=0.0), measured, (), 1)
    assert fitted == pytest.approx(overhead, abs=1e-9)


def test_fit_on_a_transfer_bound_step_never_exceeds_the_true_overhead() -> None:
    truth = uniform(10, 0.5, block_overhead_ms=0.05)  # every copy exposed: the hook hides in the wait
    measured = _measured_from(truth, (), 1)
    fitted = fit_block_overhead(dataclasses.replace(truth, block_overhead_ms=0.0), measured, (), 1)
    assert 0.0 <= fitted <= 0.05 + 1e-9


def test_fit_without_gaps_is_zero() -> None:
    truth = uniform(4, 3.0)
    measured = dataclasses.replace(_measured_from(truth, (), 1), gap_ms=None)
    assert fit_block_overhead(truth, measured, (), 1) == 0.0


def test_bandwidth_probe_copies_at_the_block_size() -> None:
    assert probe_bytes_for([BLOCK] * 4) == BLOCK
    assert probe_bytes_for([10] * 4) == MiB
    assert probe_bytes_for([4096 * MiB]) == 256 * MiB


# --- compressed copies in the planner -----------------------------------------------------------------------


def coded(costs: BlockCosts, ratio: float = 0.75) -> BlockCosts:
    return dataclasses.replace(costs, transfer_bytes=tuple(int(b * ratio) for b in costs.block_bytes))


def test_a_transfer_bound_step_moves_the_compressed_bytes() -> None:
    raw = uniform(8, 0.2)
    step_raw = simulate_step(raw, (), 1).step_ms
    step_coded = simulate_step(coded(raw), (), 1).step_ms
    assert step_raw == pytest.approx(8 * COPY_MS, rel=1e-6)
    assert step_coded == pytest.approx(0.75 * 8 * COPY_MS + raw.decode_ms(0), rel=1e-3)
    assert simulate_step(coded(raw), (), 1).copied_bytes == 8 * int(0.75 * BLOCK)


def test_compression_fits_budgets_that_raw_copies_do_not() -> None:
    raw = uniform(16, 0.2)
    device_budget, host_budget = 6 * BLOCK, 11 * BLOCK
    # Raw: at most 11 offloaded, so 5 resident + 2 slots = 7 blocks > 6.
    with pytest.raises(OffloadConfigError, match=re.escape("host_budget")):
        plan_offload(raw, device_budget, host_budget=host_budget)
    packed = plan_offload(coded(raw), device_budget, host_budget=host_budget)
    assert packed.compressed and len(packed.offloaded) > 11
    assert packed.host_bytes <= host_budget and packed.device_bytes <= device_budget


def test_compression_at_the_same_budget_moves_fewer_bytes_and_predicts_a_faster_step() -> None:
    raw = uniform(16, 0.2)
    budget = 6 * BLOCK  # the staging (1.5 blocks) costs residency, the 14 coded copies save more
    plain, packed = plan_offload(raw, budget), plan_offload(coded(raw), budget)
    assert packed.device_bytes <= budget and plain.device_bytes <= budget
    assert len(packed.offloaded) > len(plain.offloaded)
    assert packed.host_bytes < plain.host_bytes
    assert packed.predicted_step_ms < plain.predicted_step_ms
    same = plan_offload(coded(raw), None, resident=plain.resident, prefetch_depth=plain.prefetch_depth)
    assert same.host_bytes == pytest.approx(0.75 * plain.host_bytes, rel=1e-6)


def test_staging_for_coded_copies_counts_against_the_device_budget() -> None:
    costs = coded(uniform(4, 0.2))
    plan = plan_offload(costs, None, resident=(), prefetch_depth=1)
    assert plan.staging_bytes == 2 * int(0.75 * BLOCK)
    assert plan.device_bytes == 2 * BLOCK + plan.staging_bytes
    host = dataclasses.replace(costs, overlap=False)  # the host decodes straight from the host copy
    assert plan_offload(host, None, resident=(), prefetch_depth=1).staging_bytes == 0


def test_a_compressed_plan_says_so() -> None:
    plan = plan_offload(coded(uniform(8, 0.2)), 6 * BLOCK)
    assert plan.as_dict()["compressed"] is True
    assert plan.as_dict()["compressed_blocks"] == len(plan.offloaded)
    assert "compressed" in plan.why and "compressed from" in plan.explain()
    assert "blocks compressed" in str(plan)


def test_refusal_counts_the_staging_buffers() -> None:
    costs = coded(uniform(4, 0.2))
    with pytest.raises(OffloadConfigError, match=re.escape("staging for compressed copies")):
        plan_offload(costs, 2 * BLOCK + MiB)


@pytest.mark.parametrize("kwargs, message", [
    (dict(transfer_bytes=(1, 2)), "transfer_bytes needs one size >= 0 per block"),
    (dict(transfer_bytes=(1, -2, 3)), "transfer_bytes needs one size >= 0 per block"),
    (dict(block_overhead_ms=-1.0), "block_overhead_ms and copy_latency_ms must be >= 0"),
    (dict(decode_gbps=0.0), "decode_gbps must be > 0"),
])
def test_bad_cost_fields(kwargs: dict, message: str) -> None:
    with pytest.raises(OffloadConfigError, match=re.escape(message)):
        BlockCosts([1.0] * 3, [BLOCK] * 3, GBPS, **kwargs)


# --- with the engine (ext backend, the host as the device) --------------------------------------------------

D = 128


def _pair(n: int = 6):
    model, reference = make_pair(n, torch.bfloat16, d=D)
    place_outside_blocks(model, "cpu")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    return model, reference, x


def _engine_bytes(group) -> list[int]:
    return [b["compressed_bytes"] if b["mode"] == "compressed" else b["raw_bytes"] for b in group.stats()["codec"]]


def test_sampled_estimate_errs_high_by_little() -> None:
    pytest.importorskip("fastoffload_ext._C")
    model, _, _ = _pair(4)
    estimate = estimate_transfer_bytes(list(model.blocks))
    raws = [module_packed_bytes(b) for b in model.blocks]
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=True)
    real = _engine_bytes(group)
    for guess, actual, raw in zip(estimate, real, raws):
        assert actual <= guess <= actual + 0.02 * raw
        assert actual < 0.8 * raw


def test_compressed_planned_model_is_bit_exact_and_plans_with_the_engine_bytes() -> None:
    pytest.importorskip("fastoffload_ext._C")
    model, reference, x = _pair(6)
    raws = [module_packed_bytes(b) for b in model.blocks]
    block = raws[0]
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=True,
                                        device_budget=4 * block, activation_reserve=0)
    plan = group.stats()["plan"]
    assert plan["compressed"] and plan["host_bytes"] == sum(_engine_bytes(group))  # re-checked after the encode
    before = dict(zip(group.offloaded_indices, _engine_bytes(group)))
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        costs = group.calibrate(lambda: model(x))
    group = fo.get_offload_group(model)
    assert costs.compressed and costs.block_overhead_ms >= 0.0
    for block, real in zip(group.offloaded_indices, _engine_bytes(group)):
        if block in before:  # offloaded while calibrating: the engine's own figure
            assert costs.moved_bytes(block) == real == before[block]
        else:  # resident while calibrating: the sampled estimate, a little high
            assert real <= costs.moved_bytes(block) <= real + 0.02 * raws[block]
    with torch.inference_mode():
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    fo.disable_layerwise_offload(model, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_compression_fits_a_host_budget_that_raw_copies_do_not() -> None:
    pytest.importorskip("fastoffload_ext._C")
    model, reference, x = _pair(6)
    block = module_packed_bytes(model.blocks[0])
    # Raw: 4.6 blocks of host copies allow 4 offloaded, so 2 resident + 2 slots > 3.5 blocks: refused.
    # Coded (~0.76 of the bytes, no staging with the host as the device): 1 resident, 5 offloaded.
    device_budget, host_budget = int(3.5 * block), int(4.6 * block)
    raw_model, _, _ = _pair(6)
    with pytest.raises(OffloadConfigError, match=re.escape("host_budget")):
        fo.enable_layerwise_offload(raw_model, device="cpu", backend="ext", device_budget=device_budget,
                                    host_budget=host_budget, activation_reserve=0)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=True, device_budget=device_budget,
                                        host_budget=host_budget, activation_reserve=0)
    assert len(group.plan.offloaded) == 5 and group.plan.compressed
    assert group.stats()["pinned_bytes"] <= host_budget
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x)) and torch.equal(model(x), reference(x))


def test_ties_go_to_the_evenly_spread_resident_set() -> None:
    costs = BlockCosts([1.4] * 30, [87 * MiB] * 30, GBPS, other_ms=1.5)
    plan = plan_offload(costs, 17 * 87 * MiB)
    assert plan.resident == tuple(range(0, 30, 2)) and plan.prefetch_depth == 1


@pytest.mark.cuda
def test_cuda_compressed_plan_counts_the_staging_and_stays_within_the_budget() -> None:
    model, reference = make_pair(12, torch.bfloat16, d=D)
    reference.to("cuda")
    place_outside_blocks(model, "cuda")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    block = module_packed_bytes(model.blocks[0])
    reserve = 256 * 1024  # activations of a 2x5x128 input and the allocator's rounding of each tensor
    budget = 6 * block + reserve
    with torch.inference_mode():
        want = reference(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    group = fo.enable_layerwise_offload(model, device="cuda", backend="ext", compress=True, device_budget=budget,
                                        activation_reserve=reserve)
    plan = group.plan
    assert plan.compressed and plan.staging_bytes > 0 and plan.device_bytes <= budget
    assert plan.host_bytes == sum(_engine_bytes(group))
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    fo.disable_layerwise_offload(model, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q.to(p.device)), name


def test_a_fixed_layout_with_compression_is_checked_against_the_coded_host_bytes() -> None:
    pytest.importorskip("fastoffload_ext._C")
    model, reference, x = _pair(4)
    block = module_packed_bytes(model.blocks[0])
    host_budget = int(3.5 * block)  # four raw copies do not fit, four coded ones (~0.76 each) do
    raw_model, _, _ = _pair(4)
    with pytest.raises(OffloadConfigError, match=re.escape("more than host_budget")):
        fo.enable_layerwise_offload(raw_model, device="cpu", backend="ext", host_budget=host_budget)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=True, host_budget=host_budget)
    assert group.plan is None and len(group.states) == 4
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
